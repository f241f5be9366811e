"""Collectives built from point-to-point messages (:mod:`overlapkit.p2p`).

Every function here is the reference for a lab exercise. They take the ops
``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"`` on any dtype the backend
moves, any shape, non-contiguous tensors, sizes not divisible by the world size
(or smaller than it) and empty tensors.

Each one is issued in order with the kit's other operations on its group, announced
to its peers and checked against theirs (:mod:`overlapkit.ordering`, whose
``Handle``, ``run_async``, ``labelled`` and ``comm_stream`` are re-exported here):
ranks that disagree get a :class:`CollectiveMismatchError` naming both calls.

Why the rings cannot deadlock: at every step each rank *posts* its send and
its receive (isend + irecv) before waiting for either, so no rank blocks in a
send while its neighbour blocks in a send too, whatever the message size.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading

import torch
import torch.distributed as dist

from . import costmodel, p2p

# the algorithms below issue and announce themselves through these; Handle, _Executor,
# _executor, comm_stream, labelled and run_async are re-exported for callers that reach
# the issue order through this module (ok.collectives.run_async, the checks)
from .ordering import (  # noqa: F401
    Handle,
    _announce,
    _announce_ring,
    _Executor,
    _executor,
    _global_rank,
    _ring,
    _run,
    comm_stream,
    labelled,
    run_async,
)
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


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of ``tensor``, or a flat contiguous copy when it is not contiguous."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def _write_back(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    """Make an in-place result visible in ``tensor`` when ``flat`` had to be a copy."""
    if not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))


def _spans(timeline):
    """``timeline.span`` when a timeline is given, else a do-nothing context."""
    if timeline is None:
        return lambda name, lane: contextlib.nullcontext()
    return timeline.span


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
