"""A step as a graph of operations, the order they are issued in, and what that order costs.

A compiler that schedules communication (XLA's latency-hiding scheduler, inductor's
``reorder_for_compute_comm_overlap`` passes) sees a step as a graph: compute operations,
and each collective split into a *start* (issued, then running on its own stream) and a
*wait* (the first point that needs its result). Its job is an order of those operations
that keeps the compute stream busy while collectives travel::

    program order              start ar2 ── wait ar2, then backward 1 waits for nothing
    compute  |bwd2|      |bwd1|      |upd2|upd1|
    link          |ar2...|    |ar1...|

    latency-hiding order       start ar2 early, its wait sunk to the update that needs it
    compute  |bwd2|bwd1|upd2 … |upd1|
    link          |ar2...|ar1...|

:func:`simulate` prices an order on two resources, as a GPU runs them: one compute
stream (operations one after another, in the order) and one link (collectives one at a
time, in the order they were started). A wait holds the compute stream until its
collective is done. Each started collective holds its buffer (``nbytes``) until its
wait: ``max_in_flight`` bounds their sum, as a compiler bounds the memory its
prefetching may pin. :func:`run` issues the same order on ranks, with the kit's
asynchronous collectives over the emulated link and compute emulated by sleeping.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from . import collectives
from .costmodel import collectives as cost
from .spans import COMM, COMPUTE, Span
from .timeline import Timeline
from .training import emulate_compute

COLLECTIVES = {"all_reduce": cost.ring_all_reduce, "all_gather": cost.ring_all_gather}


@dataclass(frozen=True)
class Op:
    """One operation of a step. ``needs``: the names of the operations whose results it
    reads (a wait needs its start; a consumer of a collective's result needs its wait).
    ``seconds``: a compute operation's time, or a collective's time on the link (for a
    start); ``nbytes``: the buffer a collective holds from its start to its wait."""

    name: str
    kind: str
    seconds: float = 0.0
    needs: tuple[str, ...] = ()
    nbytes: int = 0
    collective: str = ""  # a start's: "all_reduce" or "all_gather"


@dataclass(frozen=True)
class Graph:
    """A step's operations in program order (the order the code was written in: each
    collective waited for right after it was started, as eager code does)."""

    ops: tuple[Op, ...]
    title: str = ""

    def __post_init__(self):
        # frozen, its ops a tuple: a scheduler works on a copy (list(graph.ops)), and the
        # graph it was given stays whole for the next call
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "by_name", {op.name: op for op in self.ops})
        # each start's wait
        object.__setattr__(self, "wait_of", {n: op.name for op in self.ops if op.kind == "wait"
                                             for n in op.needs
                                             if self.by_name[n].kind == "start"})  # fmt: skip

    def op(self, name: str) -> Op:
        return self.by_name[name]

    def program_order(self) -> list[str]:
        return [op.name for op in self.ops]

    def __repr__(self) -> str:
        return f"Graph({self.title!r}, {len(self.ops)} ops)"


class OrderError(ValueError):
    """An order that cannot run: an operation missing, repeated or unknown, one issued
    before what it needs, or more bytes in flight than allowed."""


@dataclass
class Simulated:
    """What an order costs: the step, the compute in it, and each operation's span."""

    step: float
    compute: float
    spans: list[Span] = field(default_factory=list)
    stalls: dict[str, float] = field(default_factory=dict)  # wait -> seconds the compute stood

    @property
    def exposed(self) -> float:
        """Seconds of the step in which the compute stream waited for the link."""
        return self.step - self.compute


def validate(graph: Graph, order, max_in_flight: float = float("inf")) -> None:
    """Raise :class:`OrderError` unless ``order`` (operation names) issues every operation
    of ``graph`` once, each after all it needs, with at most ``max_in_flight`` bytes of
    started collectives not yet waited for."""
    if isinstance(order, str) or not hasattr(order, "__iter__"):
        raise OrderError(f"an order is a list of operation names; got {type(order).__name__}")
    order = list(order)
    seen: dict[str, int] = {}
    in_flight: dict[str, int] = {}
    for i, name in enumerate(order):
        if not isinstance(name, str):
            raise OrderError(f"order[{i}]: {name!r} is not an operation's name (a str)")
        if name not in graph.by_name:
            raise OrderError(f"order[{i}]: {name!r} is not an operation of {graph.title}")
        if name in seen:
            raise OrderError(f"order[{i}]: {name!r} is issued twice (first at order[{seen[name]}])")
        op = graph.by_name[name]
        missing = [n for n in op.needs if n not in seen]
        if missing:
            where = ", ".join(f"{n!r} (order[{order.index(n)}])" if n in order
                              else f"{n!r} (left out)" for n in missing)  # fmt: skip
            raise OrderError(f"order[{i}]: {name!r} needs {where}, not issued before it")
        seen[name] = i
        if op.kind == "start":
            in_flight[name] = op.nbytes
            total = sum(in_flight.values())
            if total > max_in_flight and len(in_flight) > 1:  # one too big runs alone
                held = ", ".join(in_flight)
                raise OrderError(
                    f"order[{i}]: starting {name!r} puts {total / 2**20:g} MiB in flight "
                    f"({held}), above the limit {max_in_flight / 2**20:g} MiB: wait for an "
                    "earlier collective first")  # fmt: skip
        elif op.kind == "wait":
            for n in op.needs:
                in_flight.pop(n, None)
    left = [op.name for op in graph.ops if op.name not in seen]
    if left:
        raise OrderError(f"the order leaves out {len(left)} of {len(graph.ops)} operations: "
                         + ", ".join(repr(n) for n in left))  # fmt: skip


def simulate(graph: Graph, order, max_in_flight: float = float("inf")) -> Simulated:
    """The step ``order`` takes on one compute stream and one link (module docstring),
    after :func:`validate`. Spans start at 0."""
    validate(graph, order, max_in_flight)
    now = link = 0.0  # when the compute stream and the link are next free
    done: dict[str, float] = {}  # a start's collective: when it ends
    spans, stalls, compute = [], {}, 0.0
    for name in order:
        op = graph.by_name[name]
        if op.kind == "compute":
            spans.append(Span(name, now, now + op.seconds, COMPUTE))
            now += op.seconds
            compute += op.seconds
        elif op.kind == "start":  # issued now; runs once the link is free
            begin = max(now, link)
            link = done[name] = begin + op.seconds
            spans.append(Span(name.removeprefix("start "), begin, link, COMM))
        else:
            ready = max(done[n] for n in op.needs if n in done)
            if ready > now:
                stalls[name] = ready - now
                now = ready
    return Simulated(max(now, link), compute, spans, stalls)


def latency_hiding_order(graph: Graph, max_in_flight: float = float("inf")) -> list[str]:
    """A list scheduler that hides what it can: at each point, of the operations whose
    needs are issued, (1) start the next collective in program order if its buffer fits in
    flight — collectives raised as early as their inputs and the limit allow, in the order
    the program starts them (a later, smaller one jumping ahead would hold bytes the earlier
    one needs); else (2) run a compute operation — in program order; else (3) wait, for the
    collective started first (on one link it finishes first) — waits sunk to where nothing
    else can run. Choices follow the graph alone, so every rank issues one order."""
    issued: set[str] = set()
    order: list[str] = []
    in_flight: list[Op] = []  # started, not yet waited for, oldest first
    pending = list(graph.ops)
    while pending:
        held = sum(op.nbytes for op in in_flight)
        start = next((op for op in pending if op.kind == "start"), None)
        if start is not None and not (
            all(n in issued for n in start.needs)
            and (held + start.nbytes <= max_in_flight or not in_flight)
        ):
            start = None
        pick = start or next((op for op in pending if op.kind == "compute"
                              and all(n in issued for n in op.needs)), None)  # fmt: skip
        if pick is None:
            pick = graph.by_name[graph.wait_of[in_flight[0].name]]
        if pick.kind == "start":
            in_flight.append(pick)
        elif pick.kind == "wait":
            in_flight = [op for op in in_flight if op.name not in pick.needs]
        issued.add(pick.name)
        order.append(pick.name)
        pending.remove(pick)
    return order


# --------------------------------------------------------------------------- the kit's steps


def ddp_backward(layers, link, world: int = 2, update_s: float = 0.0) -> Graph:
    """Data parallelism's backward: ``layers`` as (name, backward seconds, gradient
    bytes), first layer first. Backward runs from the last layer; each gradient's
    AllReduce is started, waited for, then its update applied."""
    ops = []
    previous: tuple[str, ...] = ()
    for name, seconds, nbytes in reversed(list(layers)):
        ops += [Op(f"backward {name}", "compute", seconds, previous),
                Op(f"start ar {name}", "start", _cost("all_reduce", nbytes, world, link),
                   (f"backward {name}",), nbytes, "all_reduce"),
                Op(f"wait ar {name}", "wait", needs=(f"start ar {name}",)),
                Op(f"update {name}", "compute", update_s, (f"wait ar {name}",))]  # fmt: skip
        previous = (f"backward {name}",)
    return Graph(ops, f"data-parallel backward of {len(ops) // 4} layers")


def fsdp_forward(layers, link, world: int = 2) -> Graph:
    """Fully sharded forward: ``layers`` as (name, forward seconds, full parameter bytes).
    Each layer's parameters are gathered (AllGather), waited for, then its forward runs."""
    ops = []
    previous: tuple[str, ...] = ()
    for name, seconds, nbytes in layers:
        ops += [Op(f"start ag {name}", "start", _cost("all_gather", nbytes, world, link),
                   (), nbytes, "all_gather"),
                Op(f"wait ag {name}", "wait", needs=(f"start ag {name}",)),
                Op(f"forward {name}", "compute", seconds,
                   previous + (f"wait ag {name}",))]  # fmt: skip
        previous = (f"forward {name}",)
    return Graph(ops, f"fully sharded forward of {len(ops) // 3} layers")


def _cost(collective: str, nbytes: int, world: int, link) -> float:
    return COLLECTIVES[collective](nbytes, world, link.alpha, link.beta)


# --------------------------------------------------------------------------- on ranks


def run(graph: Graph, order, repeats: int = 5, max_in_flight: float = float("inf")) -> dict:
    """Issue ``order`` on this rank (inside ``ok.launch``), ``repeats`` times: compute by
    sleeping its seconds, each start as the kit's ring collective with ``async_op=True``
    on a buffer of its ``nbytes``, each wait as the handle's ``wait()``. Every rank must
    issue the same order: the kit pairs each rank's k-th collective with the others' k-th.
    Returns the median step (``step``, s), every repeat's (``steps``) and the last
    repeat's ``timeline``."""
    validate(graph, order, max_in_flight)
    buffers = {op.name: torch.ones(max(1, op.nbytes // 4)) for op in graph.ops
               if op.kind == "start"}  # fmt: skip
    steps, timeline = [], Timeline()
    for _ in range(repeats):
        collectives.ring_all_reduce(torch.zeros(1))  # every rank starts the step together
        timeline = Timeline()
        handles: dict[str, object] = {}
        t0 = time.perf_counter()
        for name in order:
            op = graph.by_name[name]
            if op.kind == "compute":
                with timeline.span(name):
                    emulate_compute(op.seconds)
            elif op.kind == "start":
                handles[name] = _start(op, buffers[name])
            else:
                for n in op.needs:
                    if n in handles:
                        handles.pop(n).wait()
        steps.append(time.perf_counter() - t0)
    return {"step": statistics.median(steps), "steps": steps, "timeline": timeline}


def _start(op: Op, buffer: torch.Tensor):
    if op.collective == "all_gather":
        world = torch.distributed.get_world_size()
        shard = buffer[: max(1, buffer.numel() // world)].clone()
        return collectives.ring_all_gather(buffer[: shard.numel() * world], shard,
                                           async_op=True)  # fmt: skip
    return collectives.ring_all_reduce(buffer, async_op=True)
