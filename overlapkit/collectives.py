"""Collectives built from point-to-point messages (:mod:`overlapkit.p2p`).

Every function here is the reference for a lab exercise. They take the ops
``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"`` on any dtype the backend
moves, any shape, non-contiguous tensors, sizes not divisible by the world size
(or smaller than it) and empty tensors.

**Issue order.** Each rank runs its kit collectives one at a time, in the
order it issued them (from any thread), as a CUDA communication stream would;
``async_op=True`` runs one on the rank's communication worker while the caller
goes on. Ranks match the k-th kit collective of a group with each other's
k-th, as NCCL does. Each one first announces itself to the peers it talks to
(its number, collective, size, dtype, op and issuing thread — a few hundred
bytes riding ahead of the data), so ranks that disagree get a
:class:`CollectiveMismatchError` naming both calls, not a hang or garbage
(``check=False`` skips the announcement). A failed collective marks its group
broken: later ones on it fail at once, naming the first failure. The kit's
messages travel in streams of their own (see :mod:`overlapkit.p2p`): a
learner's ``dist.all_reduce`` or ``ok.p2p`` messages in between never pair
with them.

Why the rings cannot deadlock: at every step each rank *posts* its send and
its receive (isend + irecv) before waiting for either, so no rank blocks in a
send while its neighbour blocks in a send too, whatever the message size.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import itertools
import math
import queue
import re
import sys
import threading
import time

import torch
import torch.distributed as dist

from . import costmodel, handles, inflight, p2p
from .p2p import CollectiveMismatchError

OPS = ("sum", "avg", "max", "min", "product")
__all__ = ["CollectiveMismatchError"]  # re-exported: it is raised by the announcements in p2p


# --------------------------------------------------------------------------- helpers


def _check_op(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}: expected one of {', '.join(OPS)}")
    return op


def reduce_into(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    """acc ← acc ⊕ other, elementwise, for one of :data:`OPS` (avg sums; see :func:`finish`)."""
    if op in ("sum", "avg"):
        acc.add_(other)
    elif op == "max":
        torch.maximum(acc, other, out=acc)
    elif op == "min":
        torch.minimum(acc, other, out=acc)
    else:
        acc.mul_(other)


def finish(acc: torch.Tensor, op: str, world: int) -> None:
    """Turn a sum into an average (integer dtypes round toward zero, as NCCL does)."""
    if op != "avg" or world == 1:
        return
    if acc.is_floating_point():
        acc.div_(world)
    else:
        acc.copy_(torch.div(acc, world, rounding_mode="trunc"))


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``parts`` nearly equal [start, end) ranges.

    The first ``numel % parts`` chunks get one element more; chunks may be empty
    when there are fewer elements than parts.
    """
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        bounds.append((start, end))
        start = end
    return bounds


def _global_rank(group, r: int) -> int:
    """The global rank of position ``r`` in ``group`` (p2p calls address global ranks)."""
    return r if group is None else dist.get_global_rank(group, r)


_rings: dict = {}
p2p.on_forget(_rings.clear)  # a new default group may have other ranks


def _ring(group):
    """(my position, world, global rank of the left and right neighbours) in ``group``
    (looked up once per group: torch's lookups cost more than a small ring step)."""
    key = p2p._group_name(group)
    ring = _rings.get(key)
    if ring is None:
        me, world = dist.get_rank(group), dist.get_world_size(group)
        left, right = _global_rank(group, (me - 1) % world), _global_rank(group, (me + 1) % world)
        ring = _rings[key] = (me, world, left, right)
    return ring


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of ``tensor``, or a flat contiguous copy when it is not contiguous."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def _write_back(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    """Make an in-place result visible in ``tensor`` when ``flat`` had to be a copy."""
    if not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))


_calls: dict = {}


def _describe_call(name: str, tensor: torch.Tensor, op: str | None, extra: int, thread: str):
    """(signature, description) of a kit collective: what its peers must agree on, and
    how an error names it. Deterministic across processes (unlike ``hash``); remembered
    per call site, since a training loop issues the same calls again and again."""
    key = (name, tensor.numel(), tensor.dtype, op, extra, thread, handles._caller())
    known = _calls.get(key)
    if known is None:
        known = _calls[key] = _new_call(name, tensor, op, extra, thread, key[-1])
    return known


def _new_call(name, tensor, op, extra, thread, site):
    dtype = str(tensor.dtype).removeprefix("torch.")
    # a thread's own name tells which stream of work issued the op (a bucketer, a
    # pipeline stage); Python's automatic "Thread-N" follows creation order, which
    # may differ between correct ranks, so it does not count
    named = "" if re.match(r"Thread-\d+", thread) else thread
    key = f"{name}|{tensor.numel()}|{dtype}|{op}|{extra}|{named}".encode()
    signature = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest()) & ((1 << 52) - 1)
    description = (
        f"{name} of {tensor.numel()} × {dtype}"
        + (f", op {op!r}" if op else "")
        + (f", output of {extra}" if extra >= 0 else "")
        + f", issued at {handles._format_site(site)} in thread {thread!r}"
    )
    return signature, description


def _spans(timeline):
    """``timeline.span`` when a timeline is given, else a do-nothing context."""
    if timeline is None:
        return lambda name, lane: contextlib.nullcontext()
    return timeline.span


# --------------------------------------------------------------------------- issue order


class Handle(handles.Tracked):
    """An asynchronous kit operation: ``wait(timeout=None)`` blocks until done and
    raises its failure (TimeoutError when ``timeout`` seconds pass first);
    ``is_completed()`` polls. On CUDA, ``wait()`` makes the caller's current
    stream wait for the operation, as NCCL's ``Work.wait()`` does."""

    def __init__(self, future: concurrent.futures.Future, what: str, guard=None, device=None,
                 outputs=()):  # fmt: skip
        super().__init__(what)
        self._future = future
        self._guard = guard  # an inflight.Guard over the tensors the op reads and writes
        self._device = device if device is not None and device.type == "cuda" else None
        self._outputs = list(outputs)  # the caller's tensors the op writes

    def _wait(self, timeout_at: float | None) -> None:
        remaining = None if timeout_at is None else max(0.0, timeout_at - time.perf_counter())
        try:
            done_event = self._future.result(remaining)[1]
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"{self.what} (started at {self.site}) had not finished when "
                f"wait(timeout={remaining:.3g}) ran out"
            ) from None
        except BaseException:
            if self._guard is not None:
                self._guard.abandon()
            raise
        if done_event is not None:
            torch.cuda.current_stream(done_event.device).wait_event(done_event)
        if self._guard is not None:
            self._guard.settle()  # the result reaches the caller's tensor, or a RaceError

    def is_completed(self) -> bool:
        done = self._future.done()
        if done and self._future.exception() is None:
            end = self._future.result()[1]
            if end is not None and not end.query():  # the host is done, the GPU not yet
                return False
        if done and self._guard is not None and self._future.exception() is None:
            # a polling loop may read the tensor once this says True, as with NCCL's
            # is_completed(): the result is written back now; a race is raised by wait()
            with contextlib.suppress(inflight.RaceError):
                self._guard.settle()
        return done

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` completed (on the communication worker) when the
        operation ends, as ``torch.distributed``'s ``Work.get_future()``: what a DDP
        comm hook returns, and how a timeline learns the true end of an op. Waiting on
        it counts as waiting on the handle. On CUDA it is a CUDA-aware future, as NCCL's:
        its value is the op's output tensors, set on a stream that waited for the op's end
        event, so the future records its events after the op's GPU work and its callbacks
        (``then()``, DDP's division and copy back into ``.grad``) are ordered after it, not
        only after the host saw it end."""
        cuda = self._device
        future = (
            torch.futures.Future(devices=[cuda]) if cuda is not None else torch.futures.Future()
        )

        def settle(done: concurrent.futures.Future) -> None:
            self._mark_waited()  # whoever holds the torch future waits through it
            exc = done.exception()
            end = None if exc is not None else done.result()[1]
            with contextlib.ExitStack() as on_stream:
                if cuda is not None and end is not None:
                    # this thread's stream on the op's device waits for the op's end before
                    # anything reads its result: the guard's write-back, the callbacks
                    stream = torch.cuda.current_stream(cuda)
                    stream.wait_event(end)
                    on_stream.enter_context(torch.cuda.device(cuda))
                    on_stream.enter_context(torch.cuda.stream(stream))
                if self._guard is not None:
                    try:
                        self._guard.abandon() if exc is not None else self._guard.settle()
                    except inflight.RaceError as race:
                        exc = race
                if exc is not None:
                    future.set_exception(exc)
                else:  # CUDA tensors in the value: the future records its events after them
                    future.set_result(self._outputs if cuda is not None else None)

        self._future.add_done_callback(settle)
        return future


class _Executor:
    """Runs the kit operations of one group on this rank one at a time, in issue order.

    The CPU counterpart of a CUDA communication stream (one per communicator,
    as NCCL has): ops of different groups run independently, so two threads
    that each drive a group of their own never wait for each other. A
    synchronous op runs on the caller's thread once every op issued before it
    on its group has finished; an async one on the group's communication
    worker thread. A kit op issued from inside a running one of the same group
    (on the worker: a callback, a bucketer given to :func:`run_async`) runs at
    once, as part of that one — waiting for its turn there would wait for
    itself. Each op gets the next number of its group, which its messages
    carry and its peers check.
    """

    def __init__(self, name: str):
        self.name = name
        self._cond = threading.Condition()
        self._issued = 0
        self.collectives_issued = 0  # of them, collectives (not run_async's functions)
        self._done = 0
        self._seq = 0
        self._broken: str | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._turn = threading.local()

    def in_turn(self) -> bool:
        return getattr(self._turn, "active", False)

    def _new_op(self, call) -> p2p.Op | None:
        """The op of ``call`` = (group, signature, description, check), numbered in its group."""
        if call is None:
            return None
        group, signature, description, check = call
        self._seq += 1
        op = p2p.Op(group, self._seq, signature, description)
        op.check = check
        return op

    def issue(self, fn, call, device, async_op: bool, what: str, guard=None, outputs=()):
        if self.in_turn():  # nested in a running op: part of its turn
            result = self._execute(fn, call, device, None)
            if not async_op:
                if result[1] is not None:  # the caller's stream reads what the op wrote
                    torch.cuda.current_stream(result[1].device).wait_event(result[1])
                return result[0]
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(result)
            return Handle(future, what, device=device, outputs=outputs)
        with self._cond:
            ticket = self._issued
            self._issued += 1
            self.collectives_issued += call is not None
            if not async_op and self._done != ticket:  # wait for the ops issued before
                self._cond.wait_for(lambda: self._done == ticket)
        if not async_op:
            try:
                result, done = self._execute(fn, call, device, None)
            finally:
                self._advance()
            if done is not None:
                torch.cuda.current_stream(done.device).wait_event(done)
            return result
        ready = None
        if device is not None and device.type == "cuda":
            # ordered after the work queued on the caller's stream at issue, as NCCL is
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        future = concurrent.futures.Future()
        self._ensure_worker()
        self._queue.put((ticket, fn, call, device, ready, future, _profile_to_carry()))
        return Handle(future, what, guard, device, outputs)

    def _execute(self, fn, call, device, ready):
        """Run ``fn`` as the op of ``call``: (result, CUDA event marking its end on the comm
        stream). Ops are numbered here, in the order they run — the same on every rank,
        also for ops issued from inside a running one."""
        with self._cond:
            op = self._new_op(call)
        if self._broken is not None:
            what = op.description if op is not None else "this operation"
            raise RuntimeError(
                f"{what}: not run, because an earlier kit operation on this group "
                f"failed ({self._broken}); its messages may still be in flight, so "
                "nothing later on the group can be trusted"
            )
        was, self._turn.active = self.in_turn(), True
        try:
            with p2p.running(op):
                if device is not None and device.type == "cuda":
                    with _comm_stream(self.name, device, ready) as done:
                        result = _run_op(fn, op)
                    return result, done.event
                return _run_op(fn, op), None
        except BaseException as exc:
            if op is not None:
                self._broken = f"{op.description}: {type(exc).__name__}: {exc}"
            raise
        finally:
            self._turn.active = was

    def _advance(self) -> None:
        with self._cond:
            self._done += 1
            self._cond.notify_all()

    def _ensure_worker(self) -> None:
        with self._cond:
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._loop, name=f"overlapkit-comm-{self.name}", daemon=True
                )
                self._worker.start()

    def _loop(self) -> None:
        while True:
            ticket, fn, call, device, ready, future, profile = self._queue.get()
            with self._cond:
                self._cond.wait_for(lambda t=ticket: self._done == t)
            try:
                if future.set_running_or_notify_cancel():
                    self._turn.active = True
                    sys.setprofile(profile)
                    try:
                        # callbacks of the future run here: still within this op's turn
                        future.set_result(self._execute(fn, call, device, ready))
                    except BaseException as exc:  # noqa: BLE001 - delivered to wait()
                        future.set_exception(exc)
                    finally:
                        self._turn.active = False
                        sys.setprofile(None)
            finally:
                self._advance()


def _profile_to_carry():
    """The issuing thread's profile function, when it asks to be carried to the worker
    (``propagates``: a check's watch for the kit's own answers, ``grading.answers``):
    ``sys.setprofile`` is per thread, and an async op's task runs on the worker."""
    profile = sys.getprofile()
    return profile if getattr(profile, "propagates", False) else None


def _run_op(fn, op):
    # a collective writes its result in place outside autograd, as the built-ins do; and
    # the communication worker's thread does not share the caller's torch.no_grad()
    with torch.no_grad():
        result = fn()
    if op is not None:
        op.finish()  # its announcements checked, also where no data was waited for
    return result


class _StreamEnd:
    """Where an op's work on the communication stream ends: its CUDA event (None off CUDA)."""

    event = None


@contextlib.contextmanager
def _comm_stream(group_name: str, device, ready):
    """On CUDA, run on the kit's communication stream of the group on ``device``, after
    ``ready``; yields an object whose ``event`` marks the end of the op's work there."""
    done = _StreamEnd()
    stream = comm_stream(group_name, device)
    if ready is not None:
        stream.wait_event(ready)
    else:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield done
        done.event = torch.cuda.Event()
        done.event.record(stream)


_labels = threading.local()


@contextlib.contextmanager
def labelled(label: str):
    """Kit collectives issued inside carry ``label`` in what their peers check and in
    their errors: two ranks that issue same-sized operations in different orders (stage
    1's bucket 0 on one, bucket 1 on the other) are told which each ran, where the size
    alone would let their bytes mix."""
    previous, _labels.label = getattr(_labels, "label", None), label
    try:
        yield
    finally:
        _labels.label = previous


_cuda_streams: dict = {}


def comm_stream(group_name: str, device) -> torch.cuda.Stream:
    """The kit's communication stream of one group on one device, made once: as NCCL
    gives each communicator its own, so that two groups' operations (FSDP's AllGather and
    ReduceScatter, a hybrid's dp and pp) never queue behind each other in an order that
    differs between ranks."""
    key = (group_name, torch.device(device))
    stream = _cuda_streams.get(key)
    if stream is None:
        stream = _cuda_streams[key] = torch.cuda.Stream(key[1])
    return stream


_executors: dict = {}
_executors_lock = threading.Lock()


def _executor(group) -> _Executor:
    name = p2p._group_name(group)
    with _executors_lock:
        if name not in _executors:
            _executors[name] = _Executor(name)
        return _executors[name]


def _run(name: str, fn, tensor: torch.Tensor, group, async_op: bool, check: bool,
         op: str | None = None, extra: int = -1, operands=()):  # fmt: skip
    """Issue the kit collective ``fn(*operands' tensors)`` (whose body announces it to its
    peers). ``operands``: the caller's (tensor, written?) pairs; an async op guards them
    while in flight (:mod:`overlapkit.inflight`) and works on what the guard gives it."""
    thread = threading.current_thread().name
    label = getattr(_labels, "label", None)
    if label:
        name = f"{name} [{label}]"
    signature, description = _describe_call(name, tensor, op, extra, thread)
    call = (group, signature, description, check)
    what = description.split(",")[0]
    executor = _executor(group)
    tensors = [t for t, _ in operands]
    written = [t for t, w in operands if w]
    if not async_op or executor.in_turn() or not tensors:
        return executor.issue(lambda: fn(*tensors), call, tensor.device, async_op, what,
                              outputs=written)  # fmt: skip
    site = handles._format_site(handles._caller())
    guard = inflight.Guard(what, site, tensors, [w for _, w in operands])

    def guarded():
        guard.started()
        try:
            return fn(*guard.working)
        finally:
            guard.ended()

    return executor.issue(guarded, call, tensor.device, async_op, what, guard, written)


def run_async(fn, group=None, device=None, outputs=()) -> Handle:
    """Run ``fn()`` on ``group``'s communication worker, in issue order with the kit's
    collectives on that group.

    Kit collectives on ``group`` that ``fn`` calls (synchronously) run at once,
    within its turn: a bucketer that flattens, all-reduces and unflattens can
    be made asynchronous this way. ``wait()`` re-raises what ``fn`` raised. On a CUDA
    ``device``, ``fn`` runs on the group's communication stream after the work queued on
    the caller's stream, and ``wait()`` makes the caller's stream wait for it; ``outputs``
    (the tensors ``fn`` writes) are the value of the handle's future.
    """
    name = getattr(fn, "__name__", "function")
    device = None if device is None else torch.device(device)
    return _executor(group).issue(fn, None, device, True, name, outputs=outputs)


def _announce(group, to: list[int], frm: list[int], device, data_follows: bool) -> None:
    """The op's first messages: who it is, checked against what the peers announced
    (``data_follows``: every peer in ``to`` gets data from this op)."""
    op = p2p.current_op()
    if op.check and _ring(group)[1] > 1:
        p2p.announce_and_check(to, frm, group, device, data_follows)


def _announce_ring(group, device, numel: int) -> None:
    """A ring op talks to its two neighbours: announce to the right, check the left.
    With at least one element per chunk, every step sends to the right."""
    _, world, left, right = _ring(group)
    _announce(group, [right], [left], device, data_follows=numel >= world)


# --------------------------------------------------------------------------- naive


def naive_all_reduce(
    tensor: torch.Tensor, op: str = "sum", group=None, check: bool = True, timeline=None
) -> None:
    """Master–worker AllReduce, in place: everybody sends to rank 0, which reduces and sends back.

    ::

        rank 1 ──┐                         ┌──► rank 1
        rank 2 ──┼──► rank 0: x0+x1+x2+x3 ─┼──► rank 2
        rank 3 ──┘                         └──► rank 3

    Rank 0 receives N−1 messages and sends N−1: its link carries 2(N−1)·S bytes
    while the others carry 2·S. The root is the bottleneck, and it grows with N.
    ``timeline`` (an ``ok.Timeline``) records each phase as a span.
    """
    _check_op(op)
    return _run("naive_all_reduce", lambda: _naive(tensor, op, group, timeline), tensor, group,
                async_op=False, check=check, op=op)  # fmt: skip


def _naive(tensor: torch.Tensor, op: str, group, timeline) -> None:
    span = _spans(timeline)
    me, world = _ring(group)[:2]
    if world == 1:
        finish(tensor, op, 1)
        return
    flat = _flat(tensor)
    root = _global_rank(group, 0)
    others = [_global_rank(group, r) for r in range(1, world)]
    peers = others if me == 0 else [root]
    _announce(group, peers, peers, tensor.device, data_follows=True)
    if me == 0:
        bufs = [torch.empty_like(flat) for _ in others]
        with span("gather from all", "comm"):
            p2p.wait_all([p2p.irecv(b, src, group) for b, src in zip(bufs, others, strict=True)])
        with span("reduce", "compute"):
            for b in bufs:
                reduce_into(flat, b, op)
            finish(flat, op, world)
        with span("send to all", "comm"):
            p2p.wait_all([p2p.isend(flat, dst, group) for dst in others])
    else:
        with span("send to root", "comm"):
            p2p.send(flat, root, group)
        with span("wait for result", "comm"):
            p2p.recv(flat, root, group)
    _write_back(tensor, flat)


# --------------------------------------------------------------------------- ring


#: a ring step moves its chunk in pieces of this size, so that reducing piece j
#: overlaps with receiving piece j+1 (the pipelining that pays for large chunks)
PIECE_BYTES = 1 << 19
#: ... and of this size where the pieces go through a process group (no link, or
#: torchrun): each message costs gloo ~0.1 ms there, so fewer, larger pieces win
#: (2 ranks, no link, measured here: 16 MB 0.92× the built-in with 2 MiB pieces,
#: 0.68× with 512 KiB)
GROUP_PIECE_BYTES = 2 << 20

_scratch = threading.local()  # per thread: ops running on two threads never share one


def _scratch_buffer(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A reusable receive buffer: a fresh one per call would page-fault on every byte."""
    key = (like.dtype, like.device)
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def _pieces(lo: int, hi: int, element_size: int, piece_bytes: int) -> list[tuple[int, int]]:
    n = max(1, (hi - lo) * element_size // piece_bytes)
    return [(lo + a, lo + b) for a, b in chunk_bounds(hi - lo, n) if b > a]


def _ring_reduce_scatter_flat(acc: torch.Tensor, bounds, op: str, group, span=None) -> None:
    """Reduce ``acc`` around the ring so that chunk ``me`` ends fully reduced on rank ``me``.

    Step k, rank r: send chunk (r−k−1), receive chunk (r−k−2) and reduce it in.
    Chunk c starts at rank c+1 and gathers one contribution per hop; after
    N−1 hops it reaches rank c with all N. Each rank sends (N−1)/N·S bytes.
    ::

        step 0:  r0 ─c3─► r1 ─c0─► r2 ─c1─► r3 ─c2─► r0

    Within a step the chunk travels in pieces, all posted at once; each piece
    is reduced as soon as it is in, while the next ones are still arriving.
    """
    me, world, left, right = _ring(group)
    tmp = _scratch_buffer(max(e - s for s, e in bounds), acc)
    size = acc.element_size()
    piece = PIECE_BYTES if p2p.through_shared_memory(acc) else GROUP_PIECE_BYTES
    span = span or _spans(None)
    for k in range(world - 1):
        s_lo, s_hi = bounds[(me - k - 1) % world]
        r_lo, r_hi = bounds[(me - k - 2) % world]
        with span(f"RS step {k}", "comm"):
            # both ends know the bounds, so both skip an empty chunk
            sends = [p2p.isend(acc[a:b], right, group) for a, b in _pieces(s_lo, s_hi, size, piece)]
            recvs = [
                (a, b, p2p.irecv(tmp[a - r_lo : b - r_lo], left, group))
                for a, b in _pieces(r_lo, r_hi, size, piece)
            ]
            for a, b, handle in recvs:
                handle.wait()
                reduce_into(acc[a:b], tmp[a - r_lo : b - r_lo], op)
            p2p.wait_all(sends)


def _ring_all_gather_flat(buf: torch.Tensor, bounds, group, span=None) -> None:
    """Pass chunks around the ring until every rank holds all of them.

    Step k, rank r: send chunk (r−k), receive chunk (r−k−1) straight into place.
    Each rank receives (N−1)/N·S bytes in N−1 steps.
    """
    me, world, left, right = _ring(group)
    span = span or _spans(None)
    for k in range(world - 1):
        s_lo, s_hi = bounds[(me - k) % world]
        r_lo, r_hi = bounds[(me - k - 1) % world]
        with span(f"AG step {k}", "comm"):
            handles = []
            if s_hi > s_lo:
                handles.append(p2p.isend(buf[s_lo:s_hi], right, group))
            if r_hi > r_lo:
                handles.append(p2p.irecv(buf[r_lo:r_hi], left, group))
            p2p.wait_all(handles)


def _check_sharded_pair(name: str, full, shard, world: int) -> None:
    """The full tensor must hold world × the shard's elements, in the same dtype."""
    (full_name, full_t), (shard_name, shard_t) = full, shard
    if full_t.numel() != world * shard_t.numel():
        raise ValueError(
            f"{name} on rank {dist.get_rank()}: {full_name} has {full_t.numel()} elements, "
            f"expected world_size × {shard_name} = {world} × {shard_t.numel()} = "
            f"{world * shard_t.numel()}"
        )
    if full_t.dtype != shard_t.dtype:
        raise TypeError(
            f"{name}: {full_name} is {full_t.dtype} but {shard_name} is {shard_t.dtype}"
        )


def ring_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str = "sum", group=None, async_op: bool = False,
    check: bool = True,
):  # fmt: skip
    """Ring ReduceScatter: ``output`` on rank r = op over ranks of chunk r of ``input``.

    Shapes as ``torch.distributed.reduce_scatter_tensor``: ``input`` has
    world_size × ``output.numel()`` elements.
    ::

        before:  r0 [a0 b0 c0 d0]  r1 [a1 b1 c1 d1]  r2 [a2 b2 c2 d2]  r3 [a3 b3 c3 d3]
        after:   r0 [Σa]           r1 [Σb]           r2 [Σc]           r3 [Σd]
    """
    _check_op(op)
    world = _ring(group)[1]
    _check_sharded_pair("ring_reduce_scatter", ("input", input), ("output", output), world)

    def run(output, input):
        _announce_ring(group, input.device, input.numel())
        acc = input.reshape(-1).clone()  # never modify the caller's input
        bounds = chunk_bounds(acc.numel(), world)
        _ring_reduce_scatter_flat(acc, bounds, op, group)
        lo, hi = bounds[_ring(group)[0]]
        mine = acc[lo:hi]
        finish(mine, op, world)
        output.copy_(mine.view_as(output))

    return _run("ring_reduce_scatter", run, input, group, async_op, check, op, output.numel(),
                operands=((output, True), (input, False)))  # fmt: skip


def ring_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    async_op: bool = False,
    check: bool = True,
):
    """Ring AllGather: ``output`` = every rank's ``input`` concatenated in rank order.

    Shapes as ``torch.distributed.all_gather_into_tensor``.
    ::

        before:  r0 [a]        r1 [b]        r2 [c]        r3 [d]
        after:   r0 [a b c d]  r1 [a b c d]  r2 [a b c d]  r3 [a b c d]
    """
    world = _ring(group)[1]
    _check_sharded_pair("ring_all_gather", ("output", output), ("input", input), world)

    def run(output, input):
        _announce_ring(group, input.device, output.numel())
        contiguous = output.is_contiguous()
        buf = (
            output.view(-1)
            if contiguous
            else torch.empty(output.numel(), dtype=output.dtype, device=output.device)
        )
        bounds = chunk_bounds(buf.numel(), world)
        lo, hi = bounds[_ring(group)[0]]
        buf[lo:hi].copy_(input.reshape(-1))
        _ring_all_gather_flat(buf, bounds, group)
        if not contiguous:
            output.copy_(buf.view_as(output))

    return _run("ring_all_gather", run, input, group, async_op, check, extra=output.numel(),
                operands=((output, True), (input, False)))  # fmt: skip


def ring_all_reduce(
    tensor: torch.Tensor,
    op: str = "sum",
    group=None,
    async_op: bool = False,
    check: bool = True,
    timeline=None,
):
    """Ring AllReduce, in place: ring ReduceScatter, then ring AllGather.

    ::

        ReduceScatter (N−1 steps)          AllGather (N−1 steps)
        r0 [a0 b0 c0 d0]   →  r0 [Σa . . .]  →  r0 [Σa Σb Σc Σd]
        r1 [a1 b1 c1 d1]   →  r1 [. Σb . .]  →  r1 [Σa Σb Σc Σd]   ...

    Each rank sends and receives 2(N−1)/N·S bytes — bounded as N grows, but
    never zero — in 2(N−1) steps, each paying a latency α. Sizes need not
    divide by N: chunks differ by at most one element, and may be empty.
    ``timeline`` (an ``ok.Timeline``) records each step as a span.
    """
    _check_op(op)

    def run(tensor):
        world = _ring(group)[1]
        _announce_ring(group, tensor.device, tensor.numel())
        flat = _flat(tensor)
        bounds = chunk_bounds(flat.numel(), world)
        span = _spans(timeline)
        _ring_reduce_scatter_flat(flat, bounds, op, group, span)
        lo, hi = bounds[_ring(group)[0]]
        finish(flat[lo:hi], op, world)
        _ring_all_gather_flat(flat, bounds, group, span)
        _write_back(tensor, flat)

    return _run("ring_all_reduce", run, tensor, group, async_op, check, op,
                operands=((tensor, True),))  # fmt: skip


# --------------------------------------------------------------------------- all-to-all


def _split_sizes(sizes, rows: int, world: int, rank: int, what: str) -> list[int]:
    """Rows per peer along dim 0 (``None``: equal blocks), checked against ``rows``."""
    if sizes is None:
        if rows % world:
            raise ValueError(
                f"rank {rank}: all_to_all {what} has {rows} rows, which do not split into "
                f"{world} equal blocks: give {what}_split_sizes"
            )
        return [rows // world] * world
    sizes = [int(n) for n in sizes]
    if len(sizes) != world or any(n < 0 for n in sizes) or sum(sizes) != rows:
        raise ValueError(
            f"rank {rank}: all_to_all {what}_split_sizes {sizes} must be {world} counts "
            f"≥ 0 that add up to the {what}'s {rows} rows"
        )
    return sizes


def _agree_on_sizes(send: list[int], expect: list[int], group, device) -> None:
    """Each rank tells every peer how many rows it will send it, and checks what it is
    told against what it expects: a disagreement is an error naming both ranks, not a
    receive that waits forever for rows that never come."""
    me, world = _ring(group)[:2]
    peers = [_global_rank(group, r) for r in range(world)]
    told = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    counts = [torch.tensor([n], device=device) for n in send]
    sends = [p2p.isend(counts[r], peers[r], group) for r in range(world) if r != me]
    recvs = [(r, p2p.irecv(told[r], peers[r], group)) for r in range(world) if r != me]
    for r, handle in recvs:
        handle.wait()
        if told[r].item() != expect[r]:
            raise ValueError(
                f"all_to_all: rank {r} sends {told[r].item()} rows to rank {me}, but rank "
                f"{me}'s output_split_sizes expects {expect[r]} from rank {r}"
            )
    p2p.wait_all(sends)


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
               input_split_sizes=None, group=None, async_op: bool = False,
               check: bool = True):  # fmt: skip
    """All-to-all from point-to-point messages; shapes as
    ``torch.distributed.all_to_all_single``: block j of ``input`` (along dim 0) goes to
    rank j, and ``output`` holds, in rank order, the block each rank sent here.
    ::

        r0 [a0 a1 a2]        r0 [a0 b0 c0]
        r1 [b0 b1 b2]   →    r1 [a1 b1 c1]
        r2 [c0 c1 c2]        r2 [a2 b2 c2]

    Pairwise exchange: at step i (1 … N−1) rank r sends to r+i and receives from r−i,
    both posted before either is waited, so no rank waits in a cycle; its own block is
    a local copy. Each rank sends (N−1)/N of its input, in N−1 steps each paying α.
    Uneven blocks: ``input_split_sizes[j]`` rows go to rank j, ``output_split_sizes[j]``
    come from rank j (then the ranks first tell each other the counts and check them,
    unless ``check=False``: a caller that exchanged the counts itself, as an MoE layer
    does once for all its chunks, saves that round of messages).
    """
    me, world = _ring(group)[:2]
    if input.dim() == 0 or output.dim() == 0:
        raise ValueError(f"rank {me}: all_to_all splits tensors along dim 0: give ≥ 1-D tensors")
    if output.shape[1:] != input.shape[1:] or output.dtype != input.dtype:
        raise ValueError(
            f"rank {me}: all_to_all output {list(output.shape)} {output.dtype} must have the "
            f"input's row shape and dtype ({list(input.shape)} {input.dtype})"
        )
    send = _split_sizes(input_split_sizes, input.shape[0], world, me, "input")
    expect = _split_sizes(output_split_sizes, output.shape[0], world, me, "output")
    uneven = input_split_sizes is not None or output_split_sizes is not None
    width = math.prod(input.shape[1:])  # elements per row (rows may be zero)
    send_at = [sum(send[:j]) for j in range(world)]
    recv_at = [sum(expect[:j]) for j in range(world)]

    def run(output, input):
        src = input.reshape(len(input), width)
        # received rows land in place when ``output`` is contiguous, else in a copy written back
        dst = (output.view(len(output), width) if output.is_contiguous()
               else output.new_empty(len(output), width))  # fmt: skip
        if uneven and check and world > 1:
            _agree_on_sizes(send, expect, group, input.device)
        elif check and world > 1:
            peers = [_global_rank(group, r) for r in range(world) if r != me]
            _announce(group, peers, peers, input.device, data_follows=min(send) > 0)
        dst[recv_at[me] : recv_at[me] + expect[me]] = src[send_at[me] : send_at[me] + send[me]]
        for i in range(1, world):
            to, frm = (me + i) % world, (me - i) % world
            handles = []
            if send[to]:
                block = src[send_at[to] : send_at[to] + send[to]]
                handles.append(p2p.isend(block, _global_rank(group, to), group))
            if expect[frm]:
                block = dst[recv_at[frm] : recv_at[frm] + expect[frm]]
                handles.append(p2p.irecv(block, _global_rank(group, frm), group))
            p2p.wait_all(handles)
        if not output.is_contiguous():
            output.copy_(dst.view_as(output))

    # the peers agree on the row shape and dtype (the row counts are checked above)
    row = torch.empty(input.shape[1:], dtype=input.dtype, device="meta")
    return _run("all_to_all", run, row, group, async_op, check and not uneven,
                operands=((output, True), (input, False)))  # fmt: skip


# --------------------------------------------------------------------------- buckets


def buckets_by_size(tensors, bucket_mb: float) -> list[list[int]]:
    """Group tensor indices, in order, into buckets of at most ``bucket_mb`` MiB each.

    A bucket holds one dtype on one device; a tensor larger than a bucket gets
    a bucket of its own. Within a run of one dtype and device the rule is
    ``costmodel.ddp_buckets``'s, so the model predicts the wrappers' own buckets.
    """
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb!r}")
    buckets: list[list[int]] = []
    runs = itertools.groupby(
        range(len(tensors)), key=lambda i: (tensors[i].dtype, tensors[i].device)
    )
    for _, run in runs:
        idx = list(run)
        sizes = [tensors[i].numel() * tensors[i].element_size() for i in idx]
        buckets += [[idx[j] for j in b] for b in costmodel.ddp_buckets(sizes, bucket_mb)]
    return buckets


def bucketed_all_reduce(tensors, bucket_mb: float = 25, all_reduce=None, op: str = "sum") -> int:
    """AllReduce a list of tensors in place, fused into flat buckets: one AllReduce per bucket.

    ::

        tensors   [g0][g1 g1][g2][g3 g3 g3][g4]
        buckets   [g0 g1 g1 g2] [g3 g3 g3 g4]     ← each one AllReduce, paying α once

    ``all_reduce(flat)`` sums a flat tensor in place (default: the kit's
    ring). Returns the number of buckets.
    """
    _check_op(op)
    tensors = list(tensors)
    reduce = all_reduce or (lambda flat: ring_all_reduce(flat, op="sum" if op == "avg" else op))
    if all_reduce is not None and op not in ("sum", "avg"):
        raise ValueError("a custom all_reduce sums; op must be 'sum' or 'avg'")
    world = dist.get_world_size()
    groups = buckets_by_size(tensors, bucket_mb)
    for idx in groups:
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        reduce(flat)
        finish(flat, op, world)
        offset = 0
        for i in idx:
            n = tensors[i].numel()
            tensors[i].copy_(flat[offset : offset + n].view_as(tensors[i]))
            offset += n
    return len(groups)
