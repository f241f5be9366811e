"""Lab 05's step on a rank of the check: the learner's step run with a ``compute()`` that
outlasts the AllReduce, and every time taken from outside (the op's issue, its steps, its
true end, the waits, compute's span, the timeline's); the verdicts are :mod:`.lab05_async`'s."""

from __future__ import annotations

import contextlib
import functools
import time

import cloudpickle
import torch

from .. import handles
from ..p2p import Link

#: the link of the check: 100 µs, 0.25 GB/s (this machine keeps up with it)
LINK = Link(latency_us=100, bandwidth_gbps=0.25)
#: the gradient: 4 MiB of float32, about 20 ms of AllReduce over LINK on 2 ranks
NUMEL = 1 << 20
#: the check's compute() runs at least this long
COMPUTE_S = 0.04
#: ... and, called while the AllReduce is in flight, until this long after it ended, so
#: that all of it can hide and a wait() after compute() returns this long after its end
MARGIN_S = 0.03
WORLD = 2
TIMEOUT_S = 30.0


def _now() -> float:
    return time.perf_counter()


def _gradient(rank: int) -> torch.Tensor:
    """Small integers stored as floats: sums are exact in any order."""
    g = torch.Generator().manual_seed(500 + rank)
    return torch.randint(-9, 10, (NUMEL,), generator=g).float()


class _Compute:
    """The independent work of the step: one small layer's output, computed while the
    rest of the time is spent in more matrix products (real arithmetic, as a layer's
    backward would do, not a sleep). It runs ``seconds`` at least; called while some
    of ``in_flight()``'s operations run, it goes on until they have ended (their
    future's callbacks included, such as ``Timeline.track``'s) and ``margin`` more: the
    AllReduce then ends inside compute() however long the load makes it."""

    def __init__(self, rank: int, seconds: float, margin: float = MARGIN_S, in_flight=list,
                 hold_s: float = TIMEOUT_S / 3):  # fmt: skip
        g = torch.Generator().manual_seed(700 + rank)
        self.x, self.w = torch.randn(32, 64, generator=g), torch.randn(64, 16, generator=g)
        self.burn = torch.randn(160, 160, generator=g)
        self.seconds, self.margin, self.in_flight = seconds, margin, in_flight
        # an op that never ends (a peer that never joined) is left to the learner's wait(),
        # where the launch's timeout then finds the rank
        self.hold_s = hold_s
        self.expected = torch.tanh(self.x @ self.w)
        self.runs: list[tuple[float, float]] = []
        #: per run: when the last in-flight op's callbacks had run (None: none in flight)
        self.held: list[float | None] = []

    def __call__(self) -> torch.Tensor:
        start = _now()
        ended: list[float] = []  # appended on the communication worker
        futures = self.in_flight()
        for future in futures:
            # registered after the learner's own callbacks (track's): runs after them
            future.add_done_callback(lambda _: ended.append(_now()))
        out = torch.tanh(self.x @ self.w)
        while True:
            now = _now()
            if (
                now - start >= self.seconds
                and len(ended) == len(futures)
                and (not ended or now - max(ended) >= self.margin)
            ) or now - start >= self.hold_s:
                break
            self.burn @ self.burn
        self.runs.append((start, _now()))
        whole = ended and len(ended) == len(futures)
        self.held.append(max(ended) if whole else None)
        return out


class _Call:
    """One call of ``ok.ring_all_reduce`` by the learner, as seen from outside."""

    def __init__(self, async_op: bool):
        self.issued = _now()
        self.returned = self.issued
        self.async_op = async_op
        self.steps: list[tuple[float, float]] = []  # the kit's RS/AG step spans
        self.waits: list[float] = []  # when wait() was called
        self.waited: list[float] = []  # when it returned
        self.polls: list[float] = []  # when is_completed() was called
        self.polled_done: float | None = None  # when is_completed() first said True
        self.handle = None
        self.on_grad = False  # its tensor was the exercise's grad (see _same_tensor)
        self.issued_op = 0  # kit ops it issued (one: the probe counts the others)

    @contextlib.contextmanager
    def span(self, name: str, lane: str = "comm", forward=None):
        """What ``ring_all_reduce(timeline=...)`` records into: the op's steps, on its worker."""
        start = _now()
        try:
            if forward is None:
                yield
            else:  # the learner passed a timeline of their own: it gets the spans too
                with forward.span(name, lane):
                    yield
        finally:
            self.steps.append((start, _now()))

    @property
    def done(self) -> float | None:
        """When the AllReduce really ended (its last step), whatever waited for it."""
        return max((end for _, end in self.steps), default=None)

    @property
    def began(self) -> float | None:
        """When its first step began on the communication worker (on a busy machine,
        later than ``issued``)."""
        return min((start for start, _ in self.steps), default=None)


class _Probe:
    """Wraps ``ok.ring_all_reduce`` (over the traffic recorder) to time each call and
    its handle's ``wait()``."""

    def __init__(self, grad=None):
        self.calls: list[_Call] = []
        self.grad = grad  # the exercise's tensor: the AllReduce that overlaps must be its own

    def wrap(self, original):
        from .. import ordering

        probe = self

        @functools.wraps(original)
        def ring_all_reduce(tensor, *args, **kwargs):
            # positional order: tensor, op, group, async_op, check, timeline
            async_op = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
            call = _Call(async_op)
            call.on_grad = _same_tensor(tensor, probe.grad)
            probe.calls.append(call)
            if len(args) < 5:
                theirs = kwargs.get("timeline")
                recorder = _Recorder(call, theirs)
                kwargs["timeline"] = recorder
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            before = ordering.issued(group).collectives
            result = original(tensor, *args, **kwargs)
            call.issued_op = ordering.issued(group).collectives - before
            call.returned = _now()  # on a loaded machine, well after the issue began
            if result is not None:
                call.handle = result
                _watch_wait(result, call)
            return result

        return ring_all_reduce

    def in_flight(self):
        """The futures of the learner's async AllReduces that have not ended yet."""
        futures = (getattr(c.handle, "_future", None) for c in self.calls)
        return [f for f in futures if f is not None and not f.done()]

    @contextlib.contextmanager
    def installed(self):
        import overlapkit

        from .. import collectives

        patched = []
        wrapped = self.wrap(collectives.ring_all_reduce)
        for module in (collectives, overlapkit):
            patched.append((module, module.ring_all_reduce))
            module.ring_all_reduce = wrapped
        try:
            yield self
        finally:
            for module, original in reversed(patched):
                module.ring_all_reduce = original


def _same_tensor(tensor, grad) -> bool:
    """``tensor`` is ``grad`` itself or a view of all of it (not a copy, not a part)."""
    return (
        isinstance(tensor, torch.Tensor) and isinstance(grad, torch.Tensor)
        and tensor.data_ptr() == grad.data_ptr() and tensor.numel() == grad.numel()
    )  # fmt: skip


class _Recorder:
    """Passed as ``timeline=`` to the kit's ring: it only calls ``.span(name, lane)``."""

    def __init__(self, call: _Call, forward):
        self._call, self._forward = call, forward

    def span(self, name: str, lane: str = "comm"):
        return self._call.span(name, lane, self._forward)


def _watch_wait(handle, call: _Call) -> None:
    """Note when ``handle.wait()`` is called and returns (also through Timeline.track)."""

    def wait(inner, timeout=None):
        call.waits.append(_now())
        try:
            return inner(timeout)
        finally:
            call.waited.append(_now())

    # seen however the learner waits (handle.wait(), type(handle).wait(handle))
    handles.wrap_wait(handle, wait)
    polled = handle.is_completed

    @functools.wraps(polled)
    def is_completed():
        call.polls.append(_now())
        done = polled()
        if done and call.polled_done is None:
            call.polled_done = _now()
        return done

    handle.is_completed = is_completed


def _describe_returned(out, grad: torch.Tensor, compute: _Compute) -> str | None:
    """None if ``out`` is compute()'s result, else what it is instead."""
    if isinstance(out, torch.Tensor):
        if out.shape == compute.expected.shape and torch.allclose(out, compute.expected):
            return None
        if out is grad or (out.shape == grad.shape and torch.equal(out, grad)):
            return "grad"
        return f"a tensor of shape {tuple(out.shape)} that is not compute()'s result"
    if out is None:
        return "None"
    return f"a {type(out).__name__}"


def _grad_problem(grad: torch.Tensor, mine: torch.Tensor, total: torch.Tensor, world: int):
    """(element, expected, got, what it is) where grad first differs from the sum, or None."""
    bad = grad != total
    if not bad.any():
        return None
    i = int(bad.nonzero()[0])
    if torch.equal(grad, mine):
        kind = "own"
    elif torch.equal(grad, total * world):
        kind = "twice"
    elif torch.allclose(grad, total / world):
        kind = "avg"
    else:
        kind = ""
    return i, total[i].item(), grad[i].item(), kind


def _spans_of(timeline, t0: float):
    spans = getattr(timeline, "spans", None)
    if not isinstance(spans, list):
        return None
    return [(s.name, s.lane, s.start - t0, s.end - t0) for s in spans]


def _calls_seen(probe: _Probe, rel) -> list[dict]:
    """Each of the learner's calls as plain data, its times made relative by ``rel``."""
    # a loop on is_completed() until True waits as wait() does: its first poll counts as the wait
    return [
        {
            "async": c.async_op,
            "issued": rel(c.issued),
            "returned": rel(c.returned),
            "waits": sorted(rel(t) for t in c.waits + c.polls[:1] * (c.polled_done is not None)),
            "waited": sorted(
                rel(t) for t in c.waited + [c.polled_done] * (c.polled_done is not None)
            ),
            # the first thing that waited for the op was a loop on is_completed()
            "polled": bool(c.polls) and (not c.waits or c.polls[0] < c.waits[0]),
            "handle": c.handle is not None,
            "on_grad": c.on_grad,
            "site": getattr(c.handle, "site", "?"),
            "running_at_return": c.handle is not None and not type(c.handle).is_completed(c.handle),
        }
        for c in probe.calls
    ]


def _settle(probe: _Probe, calls: list[dict], rel) -> None:
    """Wait for the ops never waited, then add when each began and ended to ``calls``."""
    for c in probe.calls:  # settle what was never waited, so that grad is read after it
        if c.handle is not None and not c.waits:
            with contextlib.suppress(Exception):
                c.handle.wait(timeout=TIMEOUT_S / 2)
    for c, seen in zip(probe.calls, calls, strict=True):
        seen["done"], seen["began"] = rel(c.done), rel(c.began)
        # the checks' read guard copies the tensor at issue and back at the end: time that
        # belongs to the guard, allowed for when the learner's spans are compared
        guard = getattr(c.handle, "_guard", None)
        seen["guard_s"] = (getattr(guard, "copy_s", 0.0), getattr(guard, "copy_back_s", 0.0))


def _run(fn_bytes: bytes, timed: bool, compute_s: float, hold_s: float):
    """One step of the learner's function on this rank; what was seen, as plain data."""
    import overlapkit as ok

    from .. import handles

    me, world = ok.rank(), ok.world_size()
    # the communication worker starts with the first async op (a few ms): not in the step
    ok.collectives.ring_all_reduce(torch.zeros(world), async_op=True).wait()
    grad = _gradient(me)
    probe = _Probe(grad)
    mine = grad.clone()
    total = sum(_gradient(r) for r in range(world))
    compute = _Compute(me, compute_s, in_flight=probe.in_flight, hold_s=hold_s)
    timeline = ok.Timeline() if timed else None
    align = ok.collectives.ring_all_reduce  # not the learner's: taken before the probe
    with probe.installed():
        # loaded here, so that even `from torch.distributed import all_reduce` is seen
        fn = cloudpickle.loads(fn_bytes)
        # the ranks start the step together (a late peer would stretch the AllReduce)
        align(torch.zeros(world))
        # every kit op on the world's group is issued through its executor: ops the probe
        # did not see ran under another name (an alias, another module's import)
        issued = ok.ordering.issued().collectives
        t0 = _now()
        out = fn(grad, compute, timeline) if timed else fn(grad, compute)
        returned = _now()
        unprobed = ok.ordering.issued().collectives - issued - sum(c.issued_op for c in probe.calls)

    def rel(t):
        return None if t is None else t - t0

    # as the step left them, before the check waits for what it did not
    calls = _calls_seen(probe, rel)
    _settle(probe, calls, rel)
    unwaited = handles.take_unwaited()  # reported by the check, not as a warning

    return {
        "calls": calls,
        "compute": [(rel(a), rel(b)) for a, b in compute.runs],
        "held": [rel(t) for t in compute.held],
        "returned_at": rel(returned),
        "returned": _describe_returned(out, grad, compute),
        "grad": _grad_problem(grad, mine, total, world),
        "unwaited": unwaited,
        "unprobed": unprobed,
        "spans": _spans_of(timeline, t0) if timed else None,
    }
