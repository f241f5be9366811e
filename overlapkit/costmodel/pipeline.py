"""Pipeline steps simulated: the bubble of a schedule, its stages computing as their
inputs arrive (on a core each, or sharing a machine's cores), and the hybrid step whose
stages then average their gradients over their replicas."""

from __future__ import annotations

import math


def pipeline_bubble(stages: int, micro_batches: int) -> float:
    """Idle fraction of a GPipe/1F1B schedule: (p − 1) / (m + p − 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def pipeline_step(schedule, forward, backward, transfer: float = 0.0,
                  overlap: bool = True) -> dict:  # fmt: skip
    """Simulate a pipeline step: each stage runs its actions (``ok.pipeline.make_schedule``)
    in order, as soon as its input is there.

    ``forward``/``backward``: seconds per micro-batch on each stage (a number, or one per
    stage); ``transfer``: seconds one activation (or its gradient) takes between
    neighbouring stages, whose link carries one message at a time per direction. A
    forward of micro-batch k on stage s needs k's activation from stage s−1; a backward
    needs k's gradient from stage s+1. Without ``overlap`` a stage waits for its own
    sends to arrive before it computes again. Returns step, per-stage busy time, the
    bubble (mean idle fraction of the stages) and every action's (stage, name, start,
    end) for drawing — with transfer = 0 and equal stages, the bubble is
    (p − 1)/(m + p − 1).
    """
    p = len(schedule)
    t_f = forward if isinstance(forward, (list, tuple)) else [forward] * p
    t_b = backward if isinstance(backward, (list, tuple)) else [backward] * p
    arrive: dict = {}  # (stage, kind, micro) -> when the input is there
    link_free: dict = {}  # (from, to) -> when that direction of the link is free
    clock = [0.0] * p
    pending = [[] for _ in range(p)]  # per stage: when its sends arrive (no overlap)
    index = [0] * p
    spans = []
    progress = True
    while progress:
        progress = False
        for s in range(p):
            if index[s] == len(schedule[s]):
                continue
            action = schedule[s][index[s]]
            k = action.micro
            if action.op == "F":
                need = None if s == 0 else ("act", k)
                cost, to = t_f[s], s + 1
            else:
                need = None if s == p - 1 else ("grad", k)
                cost, to = t_b[s], s - 1
            if need is not None and (s, *need) not in arrive:
                continue  # its input is not there yet: another stage first
            start = clock[s]
            if need is not None:
                start = max(start, arrive[(s, *need)])
            if not overlap and pending[s]:
                start = max(start, *pending[s])
                pending[s] = []
            end = start + cost
            spans.append((s, f"{action.op}{k}", start, end))
            clock[s] = end
            if 0 <= to < p:  # send the activation on, or the gradient back
                leave = max(end, link_free.get((s, to), 0.0))
                link_free[(s, to)] = leave + transfer
                arrive[(to, "act" if action.op == "F" else "grad", k)] = leave + transfer
                pending[s].append(leave + transfer)
            index[s] += 1
            progress = True
    if any(index[s] != len(schedule[s]) for s in range(p)):
        raise ValueError("the schedule deadlocks: a stage waits for an input never sent")
    step = max(max(pending[s], default=0.0) for s in range(p))
    step = max(step, *(end for *_, end in spans))
    busy = [sum(e - b for st, _, b, e in spans if st == s) for s in range(p)]
    return {
        "step": step,
        "busy": busy,
        "bubble": sum(1 - b / step for b in busy) / p if step else 0.0,
        "spans": spans,
    }


def pipeline_on_cores(
    schedule, forward, backward, transfer: float, replicas: int, cores: int
) -> dict:
    """``pipeline_step`` (overlapped transfers) for ``replicas`` copies of the pipeline on a
    machine of ``cores`` cores: ``forward``/``backward`` are the seconds of an action with
    a core to itself; while n stages compute at once, each goes at min(1, cores / (n ·
    replicas)) of that speed (the ranks share the cores, as 4 ranks on a 2-core laptop:
    a pipeline's warm-up and cool-down run faster than its steady state)."""
    p = len(schedule)
    t_f = forward if isinstance(forward, (list, tuple)) else [forward] * p
    t_b = backward if isinstance(backward, (list, tuple)) else [backward] * p
    arrive: dict = {}
    link_free: dict = {}
    index, running, spans = [0] * p, {}, []  # running: stage -> (action, start, work left)
    now = 0.0
    while any(index[s] < len(schedule[s]) for s in range(p)) or running:
        for s in range(p):  # start what can start
            if s in running or index[s] == len(schedule[s]):
                continue
            a = schedule[s][index[s]]
            need = (None if s == 0 else ("act", a.micro)) if a.op == "F" else (
                None if s == p - 1 else ("grad", a.micro))  # fmt: skip
            if need is None or arrive.get((s, *need), math.inf) <= now:
                running[s] = (a, now, t_f[s] if a.op == "F" else t_b[s])
        if not running:
            waiting = [t for t in arrive.values() if t > now]
            if not waiting:
                raise ValueError("the schedule deadlocks: a stage waits for an input never sent")
            now = min(waiting)
            continue
        rate = min(1.0, cores / (len(running) * replicas))
        finish = min(left / rate for _, _, left in running.values())
        arrivals = [t - now for t in arrive.values() if t > now]
        dt = min([finish, *arrivals])
        now += dt
        for s in list(running):
            a, start, left = running[s]
            left -= dt * rate
            if left > 1e-12:
                running[s] = (a, start, left)
                continue
            del running[s]
            index[s] += 1
            spans.append((s, f"{a.op}{a.micro}", start, now))
            to = s + 1 if a.op == "F" else s - 1
            if 0 <= to < p:
                leave = max(now, link_free.get((s, to), 0.0))
                link_free[(s, to)] = leave + transfer
                arrive[(to, "act" if a.op == "F" else "grad", a.micro)] = leave + transfer
    step = max(e for *_, e in spans)
    return {"step": step, "spans": spans}


def hybrid_step(
    schedule,
    forward,
    backward,
    transfer: float,
    all_reduce,
    dp_start: str = "overlap",
    buckets: int = 1,
    shared_link: bool = True,
    replicas: int = 1,
    cores: int | None = None,
) -> dict:
    """Simulate one step of ``ok.hybrid``: a pipeline (``pipeline_step``'s arguments) whose
    every stage then averages its gradients over its replicas, one AllReduce of
    ``all_reduce`` seconds per stage (a number, or one per stage; the replicas of a stage
    have a link of their own), started as ``dp_start`` says::

        flush     every stage at the pipeline's end (its last action anywhere)
        after     each stage at its own last backward's end (+ ``transfer`` for a stage
                  whose input gradient leaves first on a ``shared_link``)
        overlap   the kit's overlapped plan (``ok.hybrid.plan_for``): stage 0's ``buckets``
                  equal buckets sent one after another, bucket j from (j+1)/buckets of the
                  way through its last backward on; the later stages as in "after"

    ``cores``: the pipeline's compute shares that many cores among its ``replicas`` × stages
    ranks (``pipeline_on_cores``); None: a core per rank.
    Returns step, the pipeline's own step (``pipe``), per stage the AllReduce's (start,
    end), and ``hidden``: the share of the AllReduce time before the pipeline's end (under
    some stage's work), over every stage.
    """
    if dp_start not in ("flush", "after", "overlap"):
        raise ValueError(f"dp_start must be 'flush', 'after' or 'overlap', got {dp_start!r}")
    if buckets < 1:
        raise ValueError(f"buckets must be ≥ 1, got {buckets}")
    if cores is None:
        pipe = pipeline_step(schedule, forward, backward, transfer)
    else:
        pipe = pipeline_on_cores(schedule, forward, backward, transfer, replicas, cores)
    p = len(schedule)
    ar = all_reduce if isinstance(all_reduce, (list, tuple)) else [all_reduce] * p
    end_of_pipe = pipe["step"]
    reduce = []
    for s in range(p):
        start, end = next((b, e) for st, name, b, e in reversed(pipe["spans"])
                          if st == s and name.startswith("B"))  # fmt: skip
        if dp_start == "flush":
            at = end_of_pipe
            reduce.append((at, at + ar[s]))
        elif dp_start == "after" or s > 0 or buckets == 1:
            at = end + (transfer if shared_link and s > 0 else 0.0)
            reduce.append((at, at + ar[s]))
        else:
            t = start
            for j in range(buckets):
                t = max(t, start + (end - start) * (j + 1) / buckets) + ar[s] / buckets
            reduce.append((start + (end - start) / buckets, t))
    step = max(end_of_pipe, *(e for _, e in reduce))
    total = sum(ar)
    hidden = sum(max(0.0, ar[s] - max(0.0, e - end_of_pipe)) for s, (_, e) in enumerate(reduce))
    return {
        "step": step,
        "pipe": end_of_pipe,
        "reduce": reduce,
        "hidden": hidden / total if total else 1.0,
        "spans": pipe["spans"],
    }
