"""Collectives built from point-to-point messages (:mod:`overlapkit.p2p`).

Every function here is the reference for a lab exercise. They take the ops
``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"`` on any dtype the backend
moves, any shape, non-contiguous tensors, sizes not divisible by the world size
(or smaller than it) and empty tensors. Before moving data they compare every
rank's tensor size, dtype and op (one small AllGather; ``check=False`` skips
it) so that a mismatch is a clear error, not a hang or garbage.

Why the rings cannot deadlock: at every step each rank *posts* its send and
its receive (isend + irecv) before waiting for either, so no rank blocks in a
send while its neighbour blocks in a send too, whatever the message size.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading

import torch
import torch.distributed as dist

from . import p2p

OPS = ("sum", "avg", "max", "min", "product")
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
]  # fmt: skip


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with tensors or ops that do not match."""


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


def _ring(group):
    """(my position, world, global rank of the left and right neighbours) in ``group``."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    return me, world, _global_rank(group, (me - 1) % world), _global_rank(group, (me + 1) % world)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of ``tensor``, or a flat contiguous copy when it is not contiguous."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def _write_back(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    """Make an in-place result visible in ``tensor`` when ``flat`` had to be a copy."""
    if not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))


def check_same_everywhere(
    name: str, tensor: torch.Tensor, op: str | None, group=None, extra: int = -1
):
    """Compare size, dtype and op across ranks; raise CollectiveMismatchError if they differ."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else 99
    mine = torch.tensor(
        [tensor.numel(), code, OPS.index(op) if op else -1, extra],
        dtype=torch.int64,
        device=tensor.device,
    )
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    rows = [t.tolist() for t in everyone]
    if all(r == rows[0] for r in rows):
        return

    def describe(r):
        numel, dt, o, _ = rows[r]
        dtype = str(_DTYPES[dt]).removeprefix("torch.") if dt < len(_DTYPES) else "?"
        return f"rank {r}: {numel} elements of {dtype}" + (f", op {OPS[o]!r}" if o >= 0 else "")

    raise CollectiveMismatchError(
        f"{name}: the ranks disagree — "
        + "; ".join(describe(r) for r in range(world))
        + ". Every rank must pass a tensor of the same size and dtype, and the same op."
    )


def _spans(timeline):
    """``timeline.span`` when a timeline is given, else a do-nothing context."""
    if timeline is None:
        return lambda name, lane: contextlib.nullcontext()
    return timeline.span


# --------------------------------------------------------------------------- async worker


class Handle:
    """An asynchronous kit collective: ``wait()`` blocks until done, ``is_completed()`` polls."""

    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def wait(self, timeout: float | None = None) -> bool:
        self._future.result(timeout)  # re-raises the collective's exception here
        return True

    def is_completed(self) -> bool:
        return self._future.done()


class _CommWorker:
    """One thread per rank that runs async collectives in issue order.

    The CPU counterpart of a CUDA communication stream: two operations in
    flight never interleave their messages, and the caller's thread is free
    to compute meanwhile.
    """

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._loop, name="overlapkit-comm", daemon=True).start()

    def _loop(self):
        while True:
            fn, future = self._queue.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - delivered to wait()
                    future.set_exception(exc)
            with self._lock:
                self._pending -= 1

    def submit(self, fn) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pending += 1
        self._queue.put((fn, future))
        return future

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._pending > 0


_worker: _CommWorker | None = None
_worker_lock = threading.Lock()


def _comm_worker() -> _CommWorker:
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = _CommWorker()
        return _worker


def _run(fn, async_op: bool):
    """Run a collective now, or on the communication worker (always there if it is busy)."""
    if async_op:
        return Handle(_comm_worker().submit(fn))
    if _worker is not None and _worker.busy:  # keep issue order with async ops in flight
        return _worker.submit(fn).result()
    return fn()


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
    span = _spans(timeline)
    _check_op(op)
    me, world = dist.get_rank(group), dist.get_world_size(group)
    if check:
        check_same_everywhere("naive_all_reduce", tensor, op, group)
    if world == 1:
        finish(tensor, op, 1)
        return
    flat = _flat(tensor)
    root = _global_rank(group, 0)
    if me == 0:
        others = [_global_rank(group, r) for r in range(1, world)]
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

_scratch: dict = {}


def _scratch_buffer(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A reusable receive buffer: a fresh one per call would page-fault on every byte."""
    key = (like.dtype, like.device)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < numel:
        buf = _scratch[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def _pieces(lo: int, hi: int, element_size: int) -> list[tuple[int, int]]:
    n = max(1, (hi - lo) * element_size // PIECE_BYTES)
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
    span = span or _spans(None)
    for k in range(world - 1):
        s_lo, s_hi = bounds[(me - k - 1) % world]
        r_lo, r_hi = bounds[(me - k - 2) % world]
        with span(f"RS step {k}", "comm"):
            # both ends know the bounds, so both skip an empty chunk
            sends = [p2p.isend(acc[a:b], right, group) for a, b in _pieces(s_lo, s_hi, size)]
            recvs = [
                (a, b, p2p.irecv(tmp[a - r_lo : b - r_lo], left, group))
                for a, b in _pieces(r_lo, r_hi, size)
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
    world = dist.get_world_size(group)
    _check_sharded_pair("ring_reduce_scatter", ("input", input), ("output", output), world)

    def run():
        if check:
            check_same_everywhere("ring_reduce_scatter", input, op, group, output.numel())
        acc = input.reshape(-1).clone()  # never modify the caller's input
        bounds = chunk_bounds(acc.numel(), world)
        _ring_reduce_scatter_flat(acc, bounds, op, group)
        lo, hi = bounds[dist.get_rank(group)]
        mine = acc[lo:hi]
        finish(mine, op, world)
        output.copy_(mine.view_as(output))

    return _run(run, async_op)


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
    world = dist.get_world_size(group)
    _check_sharded_pair("ring_all_gather", ("output", output), ("input", input), world)

    def run():
        if check:
            check_same_everywhere("ring_all_gather", input, None, group, output.numel())
        contiguous = output.is_contiguous()
        buf = (
            output.view(-1)
            if contiguous
            else torch.empty(output.numel(), dtype=output.dtype, device=output.device)
        )
        bounds = chunk_bounds(buf.numel(), world)
        lo, hi = bounds[dist.get_rank(group)]
        buf[lo:hi].copy_(input.reshape(-1))
        _ring_all_gather_flat(buf, bounds, group)
        if not contiguous:
            output.copy_(buf.view_as(output))

    return _run(run, async_op)


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

    def run():
        world = dist.get_world_size(group)
        if check:
            check_same_everywhere("ring_all_reduce", tensor, op, group)
        flat = _flat(tensor)
        bounds = chunk_bounds(flat.numel(), world)
        span = _spans(timeline)
        _ring_reduce_scatter_flat(flat, bounds, op, group, span)
        lo, hi = bounds[dist.get_rank(group)]
        finish(flat[lo:hi], op, world)
        _ring_all_gather_flat(flat, bounds, group, span)
        _write_back(tensor, flat)

    return _run(run, async_op)


# --------------------------------------------------------------------------- buckets


def buckets_by_size(tensors, bucket_mb: float) -> list[list[int]]:
    """Group tensor indices, in order, into buckets of at most ``bucket_mb`` MiB each.

    A bucket holds one dtype on one device; a tensor larger than a bucket gets
    a bucket of its own.
    """
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb!r}")
    limit = bucket_mb * 2**20
    buckets: list[list[int]] = []
    size, key = 0.0, None
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        this_key = (t.dtype, t.device)
        if buckets and this_key == key and size + nbytes <= limit:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size, key = nbytes, this_key
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
