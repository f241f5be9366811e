"""Check for lab 15's latency-hiding scheduler: ``latency_hiding_order(graph, max_in_flight)``
returns an order of the graph's operations, judged by what it costs when simulated.

On a data-parallel backward (four layers, each AllReduce as long as a backward)::

    program order    bwd4 ▶ar4 ◀ar4 upd4 bwd3 ▶ar3 ◀ar3 …      step: compute + every AllReduce
    hiding order     bwd4 ▶ar4 bwd3 ▶ar3 bwd2 ▶ar2 bwd1 ▶ar1 ◀ar4 upd4 ◀ar3 …
                     starts raised to their inputs, waits sunk to their first consumer

An order passes a case when it is valid (each operation once, after what it needs, within
the bytes in flight) and its step is no longer than the kit's list scheduler's. Otherwise
the ✘ line names the first thing that lost time: a wait issued while compute that does
not need it could run, a start issued later than its inputs allowed, a wait for a later
collective while an earlier one is still on the link.
"""

from __future__ import annotations

import io

from .. import scheduling
from ..p2p import Link
from ..sandbox import answers
from ..sandbox.sealed import seal
from .cases import not_reached
from .common import Unfinished, call_or_report
from .exercises import answers_of
from .report import Report

MiB = 2**20
LINK = Link(100, 0.25)


def _branches() -> scheduling.Graph:
    """A block whose attention output is reduced (tensor parallelism) while the MLP's
    first half, which does not read it, can run: then both meet."""
    ar = scheduling.COLLECTIVES["all_reduce"](4 * MiB, 2, LINK.alpha, LINK.beta)
    ops = [
        scheduling.Op("attention", "compute", 0.006),
        scheduling.Op("start ar attention", "start", ar, ("attention",), 4 * MiB, "all_reduce"),
        scheduling.Op("wait ar attention", "wait", needs=("start ar attention",)),
        scheduling.Op("mlp up", "compute", 0.008),
        scheduling.Op("add", "compute", 0.001, ("wait ar attention", "mlp up")),
        scheduling.Op("mlp down", "compute", 0.008, ("add",)),
    ]
    return scheduling.Graph(ops, "a block with an independent branch")


def _two_heads() -> scheduling.Graph:
    """Two heads of nearly equal cost, each reduced, then merged: which head runs first is
    a tie that measured times can tip either way on different ranks."""
    ar = scheduling.COLLECTIVES["all_reduce"](2 * MiB, 2, LINK.alpha, LINK.beta)
    ops = []
    for head, seconds in (("a", 0.0050), ("b", 0.0051)):
        ops += [scheduling.Op(f"head {head}", "compute", seconds),
                scheduling.Op(f"start ar {head}", "start", ar, (f"head {head}",), 2 * MiB,
                              "all_reduce"),
                scheduling.Op(f"wait ar {head}", "wait", needs=(f"start ar {head}",))]  # fmt: skip
    ops.append(scheduling.Op("merge", "compute", 0.002, ("wait ar a", "wait ar b")))
    return scheduling.Graph(ops, "two heads, each reduced, then merged")


#: a sharded forward whose wide layer's AllGather outlasts the forward before it: a limit
#: of 16 MiB lets it start beside block2's parameters and hides more of it (lab 15's §3)
WIDE = [
    ("embed", 0.010, 2 * MiB),
    ("block1", 0.014, 4 * MiB),
    ("block2", 0.014, 4 * MiB),
    ("wide", 0.006, 12 * MiB),
    ("block3", 0.014, 4 * MiB),
    ("head", 0.010, 2 * MiB),
]


def cases() -> list[tuple[str, scheduling.Graph, float]]:
    """(what, graph, max_in_flight) for each case, the kit's own steps first."""
    layers = [(f"fc{i}", 0.008, 2 * MiB) for i in range(1, 5)]
    sharded = [(f"layer{i}", 0.009, 4 * MiB) for i in range(1, 6)]
    inf = float("inf")
    return [
        ("data-parallel backward, 4 layers", scheduling.ddp_backward(layers, LINK, 2, 0.001), inf),
        ("data-parallel backward, 2 MiB in flight",
         scheduling.ddp_backward(layers, LINK, 2, 0.001), 2 * MiB),
        ("fully sharded forward, 5 layers, 4 MiB in flight",
         scheduling.fsdp_forward(sharded, LINK, 2), 4 * MiB),
        ("fully sharded forward with a wide layer, 8 MiB in flight",
         scheduling.fsdp_forward(WIDE, LINK, 2), 8 * MiB),
        ("fully sharded forward with a wide layer, 16 MiB in flight",
         scheduling.fsdp_forward(WIDE, LINK, 2), 16 * MiB),
        ("a block with an independent branch", _branches(), inf),
        ("two heads, each reduced, then merged", _two_heads(), inf),
    ]  # fmt: skip


def _as_rank_1(graph: scheduling.Graph) -> scheduling.Graph:
    """The graph with the compute times rank 1 measured, each 6% off rank 0's (up and
    down by turns): the operations, needs and collectives are the same on every rank."""
    compute = [op for op in graph.ops if op.kind == "compute"]
    scale = {op.name: 1.06 if i % 2 == 0 else 0.94 for i, op in enumerate(compute)}
    ops = [scheduling.Op(op.name, op.kind, op.seconds * scale.get(op.name, 1.0), op.needs,
                         op.nbytes, op.collective) for op in graph.ops]  # fmt: skip
    return scheduling.Graph(ops, graph.title)


def check_latency_hiding_order(latency_hiding_order) -> Report:
    """Check ``latency_hiding_order(graph, max_in_flight) -> list of operation names`` on
    the kit's steps and a branching block, each simulated against the kit's scheduler."""
    report = Report("latency_hiding_order")
    fn = seal(latency_hiding_order)  # called on a rank of its own, out of our reach
    quiet = Report(report.exercise, file=io.StringIO())
    got, every = [], cases()
    with answers.running(answers_of("check_latency_hiding_order")) as ran:
        try:
            for what, graph, limit in every:
                called, order = call_or_report(quiet, what, fn, graph, limit)
                got.append((what, graph, limit, order if called else quiet.cases[-1][1]))
            what, graph, limit = every[-1]
            other = call_or_report(quiet, f"{what}, rank 1's times", fn, _as_rank_1(graph), limit)
            # the same graph again: an order that changes from call to call (a set's order,
            # a random pick among ready operations) would differ between ranks too
            again = [call_or_report(quiet, f"{w}, again", fn, g, m) for w, g, m in every]
        except Unfinished:
            report.fail(quiet.cases[-1][1])
            for what, *_ in every[len(got) + 1 :]:
                report.fail(not_reached(what))
            return report
    if ran:
        report.fail(f"your function {answers.said(ran)}")
        return report
    for what, graph, limit, order in got:
        if isinstance(order, str) and order.startswith(what):  # its call raised: the ✘ line
            report.fail(order + (_LOOPS if "did not return within" in order else ""))
        else:
            _judge(report, what, graph, limit, order)
    if isinstance(got[-1][3], list):  # an order came back for the two heads
        _judge_ranks(report, got[-1], other[1] if other[0] else None)
    _judge_repeat(report, got, again)
    return report


#: after a call that did not return: the likeliest loop in a list scheduler
_LOOPS = (
    " — a scheduler that never returns is often waiting for bytes to fit that never "
    "will: a collective larger than the limit runs alone, once nothing is in flight"
)


def _judge_repeat(report: Report, got: list, again: list) -> None:
    """Each case's order, asked for twice, must be the same: every rank computes it."""
    for (what, _, _, first), (called, second) in zip(got, again, strict=True):
        if called and isinstance(first, list) and isinstance(second, list) and first != second:
            k = next((k for k, (a, b) in enumerate(zip(first, second, strict=False)) if a != b),
                     min(len(first), len(second)))  # fmt: skip
            report.fail(f"{what}: asked twice for the same graph, your function returned two "
                        f"orders (order[{k}] is {first[k] if k < len(first) else None!r}, then "
                        f"{second[k] if k < len(second) else None!r}): every rank runs it, and "
                        "ranks must start the same collectives in the same order. Choose by "
                        "the graph alone: no set's order, no random pick")  # fmt: skip
            return


def _judge(report: Report, what: str, graph, limit: float, order) -> bool:
    if isinstance(order, tuple):
        order = list(order)
    try:
        mine = scheduling.simulate(graph, order, limit)
    except scheduling.OrderError as exc:
        report.fail(f"{what}: {exc}")
        return False
    best = scheduling.simulate(graph, scheduling.latency_hiding_order(graph, limit), limit)
    program = scheduling.simulate(graph, graph.program_order())
    ms = 1e3
    if mine.step <= best.step * (1 + 1e-9) + 1e-12:
        report.ok(f"{what}: step {mine.step * ms:.1f} ms ({mine.exposed * ms:.1f} ms of it "
                  f"waiting for the link; program order: {program.step * ms:.1f} ms)")  # fmt: skip
        return True
    report.fail(f"{what}: step {mine.step * ms:.1f} ms, where a latency-hiding order takes "
                f"{best.step * ms:.1f} ms: " + _why(graph, order, mine, limit))  # fmt: skip
    return False


def _depends(graph, name: str) -> set[str]:
    """Every operation ``name`` needs, directly or not."""
    seen, todo = set(), [name]
    while todo:
        for n in graph.op(todo.pop()).needs:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def _held(graph, order: list[str], position: int) -> int:
    """The bytes in flight just before ``order[position]``: started, not yet waited for."""
    done = set(order[:position])
    return sum(graph.op(n).nbytes for n in done
               if graph.op(n).kind == "start" and graph.wait_of[n] not in done)  # fmt: skip


def _why(graph, order: list[str], mine, limit: float = float("inf")) -> str:
    """The first place the order loses time, in the learner's words."""
    at = {name: i for i, name in enumerate(order)}
    starts = [op.name for op in graph.ops if op.kind == "start"]  # in program order
    for i, name in enumerate(order):
        op = graph.op(name)
        ahead = [n for n in starts[: starts.index(name)] if at[n] > i] if op.kind == "start" else []
        if ahead:
            return (f"{name!r} (order[{i}]) starts before {ahead[0]!r} (order[{at[ahead[0]]}]), "
                    "which the program starts first: a later collective that jumps ahead holds "
                    "bytes and link time the earlier one needs, so the earlier one, needed "
                    "sooner, arrives later. Start the collectives in program order")  # fmt: skip
        if op.kind == "start":
            inputs = [at[n] for n in op.needs]
            ready = max(inputs, default=-1)
            skipped = [n for n in order[ready + 1 : i] if graph.op(n).kind == "compute"]
            if skipped:
                since = (f"its input {order[ready]!r} is at order[{ready}]" if ready >= 0
                         else "it needs nothing")  # fmt: skip
                # it fitted exactly, and the order never held exactly the limit: a "<"
                exact = any(_held(graph, order, p) + op.nbytes == limit
                            for p in range(ready + 1, i)) and all(
                    _held(graph, order, p) < limit for p in range(len(order) + 1))  # fmt: skip
                fits = (f" It fitted there: {limit / 2**20:g} MiB in flight is at most the "
                        "limit (<=, not <; and only collectives started and not yet waited "
                        "for hold bytes)") if exact else ""  # fmt: skip
                return (f"{name!r} is at order[{i}], but {since}: {skipped[0]!r} and the "
                        f"compute after it ran first, while the link could have carried "
                        f"{name.removeprefix('start ')!r}. Start each collective as soon as "
                        "its inputs are issued" + (f" and its bytes fit.{fits}" if exact
                                                   else ""))  # fmt: skip
        if op.kind == "wait" and name in mine.stalls:
            start = op.needs[0]
            older = [n for n in order[: at[start]] if graph.op(n).kind == "start"
                     and at[graph.wait_of[n]] > i]  # fmt: skip
            if older:
                return (f"{name!r} (order[{i}]) waits while {older[0]!r}, started before it, "
                        "is still in flight: on one link collectives finish in the order they "
                        "were started, so wait for the oldest first")  # fmt: skip
            free = [n for n in order[i + 1 :] if graph.op(n).kind == "compute"
                    and name not in _depends(graph, n)]  # fmt: skip
            if free:
                return (f"{name!r} at order[{i}] stalls the compute stream "
                        f"{mine.stalls[name] * 1e3:.1f} ms, while {free[0]!r} (order"
                        f"[{at[free[0]]}]), which does not need it, could run first: issue "
                        "compute that does not need a collective before waiting for it (sink "
                        "each wait, and what uses its result, as late as the graph "
                        "allows)")  # fmt: skip
    return (
        "an order with less waiting exists: start each collective as soon as its "
        "inputs are issued, run compute that does not need a collective before "
        "waiting for it, and wait for the oldest collective first"
    )


def _judge_ranks(report: Report, first, other) -> None:
    """Rank 1, which measured slightly different compute times, must start the same
    collectives in the same order: ranks pair each one's k-th collective."""
    what, graph, _, order = first
    starts = [n for n in order if graph.op(n).kind == "start"]
    theirs = None if other is None else [n for n in other if n in graph.by_name
                                         and graph.op(n).kind == "start"]  # fmt: skip
    if theirs == starts:
        report.ok(f"{what}: with rank 1's measured times (a few percent off), the same "
                  "collectives in the same order")  # fmt: skip
        return
    k = next((k for k, (a, b) in enumerate(zip(starts, theirs or [], strict=False)) if a != b),
             None)  # fmt: skip
    differ = (f"its collective #{k} is {theirs[k]!r} where rank 0's is {starts[k]!r}"
              if k is not None else f"it starts {theirs!r:.80}")  # fmt: skip
    report.fail(f"{what}: given rank 1's measured times (each compute a few percent off), "
                f"{differ}: ranks pair their k-th collectives, so ranks that order them "
                "differently hang or mix up data (NCCL) — choose by the graph, or by costs "
                "every rank agrees on, never by one rank's own timings")  # fmt: skip
