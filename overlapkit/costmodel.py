"""The α-β cost model: time = α (latency) + β · bytes (β = 1 / bandwidth).

A point-to-point message of S bytes::

    sender   |──α──|───────── S·β ─────────|
    receiver                               ^ arrives

This module starts with the model of one message and the fit of α and β from
measurements; the collectives' formulas build on it.

What the formulas leave out, and where it shows: the software on each end of
a message (for the kit's Python collectives, roughly 0.1–0.15 ms per ring step
and per operation on a 2-core VM; a fitted α absorbs the per-message part),
and the machine's own copies and sums when they, not the link, are the
bottleneck. ``python -m overlapkit bench collectives --link ...`` measures
both per row (``machine_ms``: the same algorithm over a link that costs
nothing), so a gap between model and measurement is named, not guessed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def message_time(nbytes: float, alpha: float, beta: float) -> float:
    """Seconds for one message of ``nbytes``: α + β·S."""
    return alpha + beta * nbytes


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Fit t = α + β·S to measurements, minimising *relative* error.

    Sizes span six orders of magnitude, and so do times. A plain least-squares
    fit minimises absolute error, which the largest messages dominate: a
    0.1 ms wobble at 64 MB swamps a 20 µs latency. Weighting each point by
    1/t fits every size equally well, so α comes from small messages and β
    from large ones, as it should.

    Returns (α in seconds, β in seconds per byte).
    """
    s = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if s.shape != t.shape or s.ndim != 1 or len(s) < 2:
        raise ValueError(
            f"need two equal-length 1-D sequences of >= 2 points, got {s.shape} and {t.shape}"
        )
    if np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise ValueError("times must be positive and finite (seconds)")
    design = np.stack([np.ones_like(s), s], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    return float(alpha), float(beta)


def bandwidth_gbps(beta: float) -> float:
    """β (s/byte) as a bandwidth in GB/s (10^9 bytes per second)."""
    return 1.0 / beta / 1e9 if beta > 0 else float("inf")


# --------------------------------------------------------------------------- collectives
# S: bytes per rank (the tensor being reduced), N: ranks, α: latency (s),
# β: seconds per byte on a link, γ: seconds per byte to reduce (0 by default).


def naive_all_reduce(S: float, N: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Master–worker: N−1 messages into the root share its link, N−1 go back out.

    2α + 2(N−1)·S·β + (N−1)·S·γ — linear in N: the root's link is the bottleneck.
    """
    if N == 1:
        return 0.0
    return 2 * alpha + 2 * (N - 1) * S * beta + (N - 1) * S * gamma


def ring_reduce_scatter(S: float, N: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """(N−1) steps of a chunk S/N: (N−1)·(α + S/N·β + S/N·γ). S: the input per rank."""
    return (N - 1) * (alpha + S / N * (beta + gamma))


def ring_all_gather(S: float, N: int, alpha: float, beta: float) -> float:
    """(N−1) steps of a chunk S/N: (N−1)·(α + S/N·β). S: the gathered output per rank."""
    return (N - 1) * (alpha + S / N * beta)


def ring_all_reduce(S: float, N: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """ReduceScatter + AllGather: 2(N−1)·α + 2(N−1)/N·S·β + (N−1)/N·S·γ.

    The bandwidth term is bounded (below 2·S·β) however large N grows — the
    ring's virtue; the latency term grows with N — its cost.
    """
    return ring_reduce_scatter(S, N, alpha, beta, gamma) + ring_all_gather(S, N, alpha, beta)


def all_to_all(S: float, N: int, alpha: float, beta: float) -> float:
    """Pairwise exchange of S bytes per rank in N equal blocks: N−1 steps, each sending one
    block of S/N and receiving one: (N−1)·(α + S/N·β). The bytes equal an AllGather's; the
    latency grows with N, as the ring's does."""
    return (N - 1) * (alpha + S / N * beta)


def recursive_doubling_all_reduce(
    S: float, N: int, alpha: float, beta: float, gamma: float = 0.0
) -> float:
    """log₂N rounds, each exchanging the whole vector: log₂N·(α + S·β + S·γ). Best for small S."""
    return math.ceil(math.log2(N)) * (alpha + S * (beta + gamma)) if N > 1 else 0.0


def halving_doubling_all_reduce(
    S: float, N: int, alpha: float, beta: float, gamma: float = 0.0
) -> float:
    """Rabenseifner: recursive-halving ReduceScatter + recursive-doubling AllGather.

    2·log₂N·α + 2(N−1)/N·S·β + (N−1)/N·S·γ: the ring's bandwidth with log latency.
    """
    if N == 1:
        return 0.0
    return 2 * math.ceil(math.log2(N)) * alpha + (N - 1) / N * S * (2 * beta + gamma)


def tree_all_reduce(
    S: float, N: int, alpha: float, beta: float, gamma: float = 0.0, chunks: int | None = None
) -> float:
    """Reduce up a binary tree, broadcast down it, the vector cut into ``chunks`` pipelined pieces.

    Depth d = ⌈log₂N⌉; each direction takes (d + k − 1) steps of a piece S/k:
    2·(d + k − 1)·(α + S/k·β) + (d + k − 1)·S/k·γ. ``chunks=None`` uses the
    best k, √((d − 1)·S·β / α) rounded, as a tuned library would; ``chunks=1``
    is the unpipelined tree.
    """
    if N == 1:
        return 0.0
    depth = math.ceil(math.log2(N))
    if chunks is None:
        best = math.sqrt((depth - 1) * S * beta / alpha) if alpha > 0 else float(depth)
        candidates = {max(1, math.floor(best)), max(1, math.ceil(best))}
        return min(tree_all_reduce(S, N, alpha, beta, gamma, k) for k in candidates)
    k = max(1, chunks)
    steps = depth + k - 1
    return 2 * steps * (alpha + S / k * beta) + steps * S / k * gamma


def bucketed_all_reduce(
    S: float, N: int, n_buckets: int, alpha: float, beta: float, gamma: float = 0.0
) -> float:
    """n ring AllReduces of S/n bytes each: n·2(N−1)·α + 2(N−1)/N·S·β (+ γ term)."""
    return n_buckets * ring_all_reduce(S / n_buckets, N, alpha, beta, gamma)


# --------------------------------------------------------------------------- data-parallel step

#: bucket sizes (MiB) the bench and the labs sweep
BUCKET_SWEEP_MB = (0.1, 0.25, 0.5, 1, 2, 4, 8, 25, 100)


def ddp_buckets(sizes: Sequence[int], bucket_mb: float | None) -> list[list[int]]:
    """Group gradients (bytes, in the order they become ready) into buckets as the
    wrappers do: consecutive, at most ``bucket_mb`` MiB, one per gradient too big.
    ``bucket_mb=None``: one bucket; ``0``: one per gradient (OverlapDDP)."""
    limit = math.inf if bucket_mb is None else bucket_mb * 2**20
    buckets: list[list[int]] = []
    size = 0.0
    for i, nbytes in enumerate(sizes):
        if buckets and size + nbytes <= limit:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size = nbytes
    return buckets


@dataclass(frozen=True)
class HostCost:
    """What one AllReduce costs the host beyond the link's α and β, measured once.

    ``per_op``: wall seconds per operation on an idle rank (issuing, bookkeeping, the
    kit's ring in Python: a fraction of a millisecond); ``per_op_busy``: the same while
    the rank computes (its threads then wait for a core; default ``per_op``);
    ``cpu_per_op`` and ``cpu_per_byte``: the rank's CPU time an operation takes
    (copies, sums, Python). Where each rank has about one core, that CPU time is taken
    from an overlapped backward; on a GPU (NCCL kernels, copy engines) it is ~0.
    """

    per_op: float = 0.0
    per_op_busy: float | None = None
    cpu_per_op: float = 0.0
    cpu_per_byte: float = 0.0

    def cpu(self, nbytes: float) -> float:
        return self.cpu_per_op + self.cpu_per_byte * nbytes


def _schedule(ready, sizes, groups, backward, N, alpha, beta, host: HostCost, naive: bool):
    """(start, end, bytes) per bucket on a link that carries one AllReduce at a time."""
    busy = host.per_op if host.per_op_busy is None else host.per_op_busy
    spans, end = [], 0.0
    for idx in groups:
        nbytes = sum(sizes[i] for i in idx)
        ready_at = backward if naive else max(ready[i][0] for i in idx)
        start = max(ready_at, end)
        overhead = busy if start < backward else host.per_op
        end = start + overhead + ring_all_reduce(nbytes, N, alpha, beta)
        spans.append((start, end, nbytes))
    return spans


def ddp_step(
    ready: Sequence[tuple[float, int]],
    forward: float,
    backward: float,
    N: int,
    alpha: float,
    beta: float,
    strategy: str = "bucketed",
    bucket_mb: float | None = 25,
    per_op: float = 0.0,
    host: HostCost | None = None,
) -> dict:
    """Predict one data-parallel step from when each gradient is ready during backward.

    ``ready``: (seconds after backward starts, bytes) per gradient in the order the
    buckets are filled (``ok.profile_backward`` measures it); ``per_op``: the
    software cost of one AllReduce beyond the α-β model; ``host`` (a
    :class:`HostCost`) instead, for a host whose CPU the communication shares.
    The AllReduces share one link and run one after another::

        backward |██████████████████|
        bucket 0      ready ─► |▒▒▒▒|
        bucket 1                ready ─► |▒▒▒▒▒|
        bucket 2 (last)                   ready ─►|▒▒▒▒▒▒|   ← the exposed tail

    bucket k starts at max(ready_k, end_{k−1}) and takes per_op + ring_all_reduce(S_k);
    naive starts every AllReduce after backward. With ``host``, the CPU time of the
    AllReduces that start during backward stretches it (one core per rank).
    step = forward + max(backward, end of the last AllReduce). Returns step, comm
    (sum of AllReduce times), exposed (comm not under backward), hidden_fraction, the
    buckets' (start, end, bytes), and the (stretched) backward.
    """
    if strategy not in ("naive", "overlap", "bucketed"):
        raise ValueError(f"strategy must be 'naive', 'overlap' or 'bucketed', got {strategy!r}")
    host = host or HostCost(per_op=per_op)
    sizes = [nbytes for _, nbytes in ready]
    groups = ddp_buckets(sizes, 0 if strategy != "bucketed" else bucket_mb)
    naive = strategy == "naive"
    spans = _schedule(ready, sizes, groups, backward, N, alpha, beta, host, naive)
    if not naive and backward > 0:
        # the AllReduces that start while backward runs take their CPU time from it
        stretch = sum(host.cpu(b) for s, _, b in spans if s < backward)
        if stretch:
            factor = (backward + stretch) / backward
            ready = [(t * factor, nbytes) for t, nbytes in ready]
            backward += stretch
            spans = _schedule(ready, sizes, groups, backward, N, alpha, beta, host, naive)
    comm = sum(e - s for s, e, _ in spans)
    finish = max(backward, spans[-1][1]) if spans else backward
    return {
        "step": forward + finish,
        "comm": comm,
        "exposed": finish - backward,
        "hidden_fraction": 1 - (finish - backward) / comm if comm else 1.0,
        "buckets": len(groups),
        "spans": spans,
        "forward": forward,
        "backward": backward,
    }


def best_bucket_mb(ready, forward, backward, N, alpha, beta, per_op=0.0, host=None,
                   candidates: Sequence[float] = BUCKET_SWEEP_MB) -> float:  # fmt: skip
    """The bucket size (among ``candidates``) with the shortest predicted step: big
    enough that per-message costs stop mattering, small enough that the first bucket
    starts early and the exposed last one is short."""

    def step(mb):
        return ddp_step(ready, forward, backward, N, alpha, beta, "bucketed", mb, per_op,
                        host)["step"]  # fmt: skip

    # sizes that make the same buckets predict the same step: name the largest of them
    return min(reversed(list(candidates)), key=step)


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


def fsdp_step(units, N: int, alpha: float, beta: float, prefetch: str = "none",
              backward_prefetch: bool = True, reshard_after_forward: bool = True,
              prefetch_depth: int = 1, shared_link: bool = True,
              per_op: float = 0.0, per_op_rs: float | None = None) -> dict:  # fmt: skip
    """Simulate one fully sharded step (``ok.FullyShardedDP``) from each unit's compute.

    ``units``: (forward seconds, backward seconds, bytes of the unit's whole parameters)
    per unit, in forward order. Each AllGather takes ``ring_all_gather(bytes)``, each
    ReduceScatter ``ring_reduce_scatter(bytes)`` (+ ``per_op``, or ``per_op_rs`` where given:
    what a collective costs a computing host beyond α-β, measured); with ``shared_link`` both
    queue on one link in the order issued, else each on its own::

        forward   unit k waits for AG_k, computes F_k, frees the unit (reshard)
        backward  unit k (last first) waits for AG_k again (when resharded), computes
                  B_k, then issues RS_k
        explicit  AG_{k+1..k+depth} are issued when unit k starts, before F_k
        backward_prefetch   AG of the next unit(s) in backward order issued before B_k
                            (``prefetch_depth`` of them with explicit prefetch, else one)

    ``"implicit"`` is ``"none"`` here: on a CPU the host that would run ahead is busy
    computing. Returns step, compute, comm (all transfers), exposed (step − compute),
    hidden_fraction, forward_wait (time forward spent waiting for AllGathers), the
    peak bytes of whole units held at once (from an AllGather's issue until its unit is
    freed) and every span (lane, name, start, end) for drawing.
    """
    if prefetch not in ("none", "implicit", "explicit"):
        raise ValueError(f"prefetch must be 'none', 'implicit' or 'explicit'; got {prefetch!r}")
    n = len(units)
    ag = [per_op + ring_all_gather(b, N, alpha, beta) for _, _, b in units]
    per_op_rs = per_op if per_op_rs is None else per_op_rs
    rs = [per_op_rs + ring_reduce_scatter(b, N, alpha, beta) for _, _, b in units]
    free = {"ag": 0.0, "rs": 0.0}
    spans, held = [], []  # held: (from, to, bytes) of whole units
    gathered: dict[int, float] = {}  # unit -> when its AllGather ends
    issued_at: dict[int, float] = {}

    def issue(k: int, at: float, phase: str) -> None:
        if k in gathered:
            return
        lane = "ag" if not shared_link else "link"
        start = max(at, free.get(lane, 0.0))
        free[lane] = start + ag[k]
        gathered[k], issued_at[k] = start + ag[k], at
        spans.append(("comm", f"AG {k}{phase}", start, start + ag[k]))

    def release(k: int, at: float) -> None:
        held.append((issued_at.pop(k), at, units[k][2]))
        del gathered[k]

    clock, forward_wait = 0.0, 0.0
    for k in range(n):
        issue(k, clock, "")
        if prefetch == "explicit":
            for j in range(k + 1, min(n, k + 1 + prefetch_depth)):
                issue(j, clock, "")
        forward_wait += max(0.0, gathered[k] - clock)
        clock = max(clock, gathered[k])
        spans.append(("compute", f"F {k}", clock, clock + units[k][0]))
        clock += units[k][0]
        if reshard_after_forward:
            release(k, clock)
    last_rs = 0.0
    for k in reversed(range(n)):
        issue(k, clock, " (again)")
        if backward_prefetch and reshard_after_forward:
            depth = prefetch_depth if prefetch == "explicit" else 1
            for j in range(k - 1, max(-1, k - 1 - depth), -1):
                issue(j, clock, " (again)")
        clock = max(clock, gathered[k])
        spans.append(("compute", f"B {k}", clock, clock + units[k][1]))
        clock += units[k][1]
        release(k, clock)
        lane = "rs" if not shared_link else "link"
        start = max(clock, free.get(lane, 0.0))
        free[lane] = last_rs = start + rs[k]
        spans.append(("comm", f"RS {k}", start, last_rs))
    step = max(clock, last_rs)
    compute = sum(f + b for f, b, _ in units)
    comm = sum(ag) * (2 if reshard_after_forward else 1) + sum(rs)
    exposed = step - compute
    moments = sorted({t for a, b, _ in held for t in (a, b)})
    peak = max((sum(nb for a, b, nb in held if a <= t < b) for t in moments), default=0)
    return {
        "step": step,
        "compute": compute,
        "comm": comm,
        "exposed": exposed,
        "hidden_fraction": 1 - exposed / comm if comm else 1.0,
        "forward_wait": forward_wait,
        "peak_gathered": peak,
        "spans": spans,
    }


# --------------------------------------------------------------------------- decomposition


def _hidden(spans) -> float:
    """Share of the ``comm`` spans' time that overlaps ``compute`` spans, for simulated
    spans (lane, name, start, end)."""
    from .timeline import intersect, length, union  # noqa: PLC0415

    comm = union((b, e) for lane, _, b, e in spans if lane == "comm")
    work = union((b, e) for lane, _, b, e in spans if lane == "compute")
    total = length(comm)
    return length(intersect(comm, work)) / total if total else 0.0


def collective_matmul(world: int, chunks: int, compute: float, transfer: float,
                      kind: str = "all_gather") -> dict:  # fmt: skip
    """Simulate one rank of the decomposed AllGather-matmul (``kind="all_gather"``) or
    matmul-ReduceScatter (``"reduce_scatter"``) of ``ok.tensor_parallel``, every rank
    alike: N·chunks pieces, each ``compute`` seconds to multiply, each ``transfer``
    seconds to cross to the right neighbour (α + piece bytes·β; one piece at a time on a
    rank's outgoing link).

    AllGather-matmul: a piece is multiplied once it is in hand and sent on (steps < N−1)
    as its multiplication starts. Matmul-ReduceScatter: a piece is multiplied, added to
    the running sum from the left (once that arrived) and sent on. Returns ``step``,
    ``serial`` (the same transfers and products one after another: the whole collective,
    then the matmul), ``hidden`` (share of transfer time under computation) and ``spans``
    (lane, name, start, end). More chunks: the first product starts sooner and less of
    the last transfer is exposed; each piece pays α once more.
    """
    if kind not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"kind must be 'all_gather' or 'reduce_scatter', got {kind!r}")
    arrive: dict = {}  # (step, piece) -> when it is here (from the left; same for all)
    link = clock = 0.0
    spans = []
    for k in range(world):
        for p in range(chunks):
            ready = arrive.get((k, p), 0.0)
            if kind == "all_gather":
                start = max(clock, ready)
                send_at = start
            else:
                start = clock
                send_at = max(start + compute, ready)
            clock = start + compute
            spans.append(("compute", f"matmul {k}.{p}", start, clock))
            if k < world - 1:
                leave = max(send_at, link)
                link = leave + transfer
                spans.append(("comm", f"send {k}.{p}", leave, link))
                arrive[(k + 1, p)] = link
    step = max(clock, link)
    serial = (world - 1) * chunks * transfer + world * chunks * compute
    return {"step": step, "serial": serial, "hidden": _hidden(spans), "spans": spans}


#: the chunk counts the benches and labs sweep
CHUNK_SWEEP = (1, 2, 4, 8, 16, 32)


def moe_step(chunks: int, route: float, expert, all_to_all, local: float | None = None) -> dict:
    """Simulate one rank of ``ok.moe.MoELayer`` with ``chunks`` token chunks.

    ``route``: seconds before the first dispatch (router, sort, count exchange);
    ``expert``: seconds of expert compute per chunk; ``all_to_all``: seconds of one
    chunk's dispatch (= its combine) — numbers, or one per chunk. The all-to-alls run
    one at a time in the order the layer issues them — D0, D1, C0, D2, C1, … (dispatch
    c+1 is issued before chunk c computes, combine c after) — and chunk c computes once
    D(c) is done. ``chunks=1`` is the serial layer: route, dispatch, compute, combine.

    ``local``: the layer's ``local_first`` schedule, with ``local`` seconds of compute for
    the tokens of the rank's own expert (``expert`` is then a chunk's compute of the
    others' tokens): every dispatch is issued at once, the own tokens computed while they
    travel, then D0 … C0 C1 … as before. Returns ``step``, ``hidden`` (share of
    all-to-all time under expert compute) and ``spans``. More chunks hide more; each
    all-to-all pays its latency and host cost once more, which ``all_to_all`` per chunk
    carries.
    """
    e = expert if isinstance(expert, (list, tuple)) else [expert] * chunks
    a = all_to_all if isinstance(all_to_all, (list, tuple)) else [all_to_all] * chunks
    if len(e) != chunks or len(a) != chunks:
        raise ValueError(f"give one expert time and one all-to-all time per chunk ({chunks})")
    spans = []

    def comm(name, issued, cost):
        nonlocal link
        start = max(issued, link)
        link = start + cost
        spans.append(("comm", name, start, link))
        return link

    link = clock = route
    ahead = chunks if local is not None else 1  # dispatches issued before any compute
    dispatched = {c: comm(f"dispatch {c}", clock, a[c]) for c in range(ahead)}
    if local is not None:
        spans.append(("compute", "expert local", clock, clock + local))
        clock += local
    for c in range(chunks):
        if c + ahead < chunks:
            dispatched[c + ahead] = comm(f"dispatch {c + ahead}", clock, a[c + ahead])
        start = max(clock, dispatched[c])
        clock = start + e[c]
        spans.append(("compute", f"expert {c}", start, clock))
        comm(f"combine {c}", clock, a[c])
    return {"step": link, "hidden": _hidden(spans), "spans": spans}


def moe_best_chunks(route: float, expert: float, nbytes: float, world: int, alpha: float,
                    beta: float, per_op: float = 0.0, per_chunk: float = 0.0,
                    candidates: Sequence[int] = CHUNK_SWEEP) -> tuple[int, dict]:  # fmt: skip
    """The chunk count with the shortest predicted MoE step, from α-β: ``expert`` seconds
    of expert compute for every token and ``nbytes`` of tokens each rank dispatches (all
    chunks); a chunk's all-to-all is ``all_to_all(nbytes/k)`` plus ``per_op`` of host
    cost, its compute ``expert/k + per_chunk``. Returns (best k, {k: step})."""
    steps = {
        k: moe_step(
            k, route, expert / k + per_chunk, all_to_all(nbytes / k, world, alpha, beta) + per_op
        )["step"]  # fmt: skip
        for k in candidates
    }
    return min(steps, key=steps.get), steps


#: nccl-tests' bus-bandwidth factors: busbw = algbw × factor
BUSBW_FACTOR = {
    "all_reduce": lambda N: 2 * (N - 1) / N,
    "reduce_scatter": lambda N: (N - 1) / N,
    "all_gather": lambda N: (N - 1) / N,
}


def bytes_moved_per_rank(collective: str, S: float, N: int) -> float:
    """Bytes each rank sends (= receives) in the ring algorithm for a tensor of S bytes.

    AllReduce 2(N−1)/N·S — bounded, not O(1) and not zero; ReduceScatter and
    AllGather (N−1)/N·S each, where S is the full (unsharded) size.
    """
    return BUSBW_FACTOR[collective](N) * S


def top_k_count(numel: int, fraction: float) -> int:
    """How many entries top-k sends of ``numel``: the ``fraction`` rounded, at least one."""
    return max(1, min(numel, round(fraction * numel)))


def powersgd_split(shapes, rank: int, min_rate: float = 2.0) -> tuple[list[int], list[int]]:
    """Which gradients PowerSGD sends low-rank (their positions in ``shapes``) and which
    whole: an n×m matrix (a gradient of 2+ dimensions, its trailing ones flattened) goes
    low-rank when (n + m)·r·``min_rate`` < n·m, r = min(n, m, ``rank``), as PyTorch's
    ``powerSGD_hook`` decides; 1-D gradients always go whole."""
    low, whole = [], []
    for i, shape in enumerate(shapes):
        shape = tuple(shape)
        if len(shape) >= 2:
            n, m = shape[0], math.prod(shape[1:])
            if (n + m) * min(n, m, rank) * min_rate < n * m:
                low.append(i)
                continue
        whole.append(i)
    return low, whole


def compressed_all_reduce(kind: str, shapes, N: int, alpha: float, beta: float,
                          compute: float = 0.0, fraction: float = 0.01, rank: int = 1,
                          min_rate: float = 2.0, itemsize: int = 4) -> dict:  # fmt: skip
    """Averaging one bucket of float gradients (``shapes``) over N ranks with ``kind``
    (``ok.compression``): the bytes a rank sends and the time on an α-β link, plus
    ``compute`` (compressing and decompressing, as measured: ``stats["compute_s"]``)::

        none      ring AllReduce of S                      2(N−1)/N·S bytes
        half      ring AllReduce of S/2                    2(N−1)/N·S/2
        topk      AllGathers of k values and k int64s      (N−1)·k·(4 + 8)
        powersgd  AllReduces of the whole ones, P, Q       2(N−1)/N·(whole + Σ(n+m)·r)·4
    """
    sizes = [math.prod(tuple(s)) for s in shapes]
    numel = sum(sizes)
    if kind == "none":
        ops = [("all_reduce", numel * itemsize)]
    elif kind == "half":
        ops = [("all_reduce", numel * 2)]
    elif kind == "topk":
        k = top_k_count(numel, fraction)
        ops = [("all_gather", N * k * itemsize), ("all_gather", N * k * 8)]
    elif kind == "powersgd":
        low, whole = powersgd_split(shapes, rank, min_rate)
        p = q = 0  # P is n×r, Q is m×r for each low-rank matrix
        for i in low:
            n, m = tuple(shapes[i])[0], sizes[i] // tuple(shapes[i])[0]
            p, q = p + n * min(n, m, rank), q + m * min(n, m, rank)
        ops = [("all_reduce", sum(sizes[i] for i in whole) * itemsize)] if whole else []
        ops += [("all_reduce", p * itemsize), ("all_reduce", q * itemsize)] if low else []
    else:
        raise ValueError(f"kind must be none, half, topk or powersgd; got {kind!r}")
    time, sent = compute, 0.0
    for op, nbytes in ops:  # a ring AllReduce sends 2(N−1)/N of its S, an AllGather (N−1)/N
        if op == "all_reduce":
            time += ring_all_reduce(nbytes, N, alpha, beta)
            sent += 2 * (N - 1) / N * nbytes
        else:
            time += ring_all_gather(nbytes, N, alpha, beta)
            sent += (N - 1) / N * nbytes
    return {"bytes": sent, "time": time, "messages": len(ops)}


def compression_pays_below(kind: str, shapes, N: int, alpha: float, compute: float = 0.0,
                           **settings) -> float:  # fmt: skip
    """The link bandwidth (GB/s) below which averaging ``shapes`` with ``kind`` beats the
    plain ring AllReduce. Both times are a + B·β (a: the latencies and the compute, B: the
    bytes a rank sends), so they cross at β* = (a_kind − a_none) / (B_none − B_kind):
    ``inf`` where compression wins at any speed, 0 where it never does (no fewer bytes)."""
    plain = compressed_all_reduce("none", shapes, N, alpha, 0.0, **settings)
    small = compressed_all_reduce(kind, shapes, N, alpha, 0.0, compute, **settings)
    saved = plain["bytes"] - small["bytes"]
    if saved <= 0:
        return 0.0
    extra = small["time"] - plain["time"]
    return math.inf if extra <= 0 else saved / extra / 1e9


ALGORITHMS = {
    "naive": naive_all_reduce,
    "ring": ring_all_reduce,
    "recursive_doubling": recursive_doubling_all_reduce,
    "halving_doubling": halving_doubling_all_reduce,
    "tree": tree_all_reduce,
}


def project(
    S: float, ranks, alpha: float, beta: float, algorithms=("naive", "ring", "tree")
) -> list[dict]:
    """AllReduce time of each algorithm for each world size in ``ranks`` (e.g. up to 1024)."""
    return [
        {"ranks": N, **{a: ALGORITHMS[a](S, N, alpha, beta) for a in algorithms}} for N in ranks
    ]
