"""Tensor parallelism: one linear layer's weight split across ranks (Megatron style).

A column-parallel layer splits the weight's *output* features: rank r computes
columns r of ``y = x Wᵀ`` from the whole input. A row-parallel layer splits the
*input* features: rank r multiplies its slice of the input by its slice of the
weight, and the partial outputs are summed. Put one after the other (an MLP) and
the pair needs one AllReduce in forward and one in backward::

    x ─► f ─► column-parallel ─► act ─► row-parallel ─► g ─► y
         │    (W₁ split by rows)        (W₂ split by columns) │
         f: identity forward, AllReduce backward    g: AllReduce forward, identity backward

Sequence parallelism replaces f and g by an AllGather before (ReduceScatter in
backward) and a ReduceScatter after (AllGather in backward): the same bytes, but the
activations outside the pair are split along the sequence, not replicated.

Every communication is a kit collective (over ``ok.Link`` when one is set), wrapped
in an autograd function so that backward communicates too. Results equal the
single-device layer, forward and gradients (tests on 2 and 3 ranks).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import p2p
from .collectives import chunk_bounds, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from .ordering import _ring

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "copy_to_parallel",
    "reduce_from_parallel",
    "gather_sequence",
    "scatter_sequence",
    "all_gather_matmul",
    "matmul_reduce_scatter",
]


# --------------------------------------------------------------------------- the four conjugates


class _CopyToParallel(torch.autograd.Function):
    """f: identity forward, AllReduce backward (each rank's input gradient is partial)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ring_all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """g: AllReduce forward (sum the partial outputs), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        ring_all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's rows, in rank order (AllGather along dim 0)."""
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    ring_all_gather(out, x.contiguous(), group=group)
    return out


def _scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's rows of the sum over ranks (ReduceScatter along dim 0)."""
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(
            f"rank {dist.get_rank()}: {x.shape[0]} rows do not split into {world} sequence shards"
        )
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    ring_reduce_scatter(out, x.contiguous(), group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    """AllGather along dim 0 forward, ReduceScatter backward (sequence parallelism)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_rows(grad, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    """ReduceScatter along dim 0 forward, AllGather backward (sequence parallelism)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _scatter_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.group), None


def copy_to_parallel(x, group=None):
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel(x, group=None):
    return _ReduceFromParallel.apply(x, group)


def gather_sequence(x, group=None):
    return _GatherSequence.apply(x, group)


def scatter_sequence(x, group=None):
    return _ScatterSequence.apply(x, group)


# --------------------------------------------------------------------------- layers


def _shard(full: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim`` (slices differ by at most one)."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    lo, hi = chunk_bounds(full.shape[dim], world)[me]
    return full.narrow(dim, lo, hi - lo).clone()


class ColumnParallelLinear(torch.nn.Module):
    """``y = x Wᵀ + b`` with W's output features (rows) split across ranks: rank r holds
    rows r and returns its columns of y. ``sequence_parallel``: ``x`` arrives split along
    dim 0 and is all-gathered first (else it is replicated, and its gradient all-reduced).
    ``from_layer``: take the weights of a ``torch.nn.Linear`` (same on every rank)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 sequence_parallel: bool = False,
                 from_layer: torch.nn.Linear | None = None):  # fmt: skip
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        full = from_layer or torch.nn.Linear(in_features, out_features, bias=bias)
        self.weight = torch.nn.Parameter(_shard(full.weight.detach(), 0, group))
        self.bias = (torch.nn.Parameter(_shard(full.bias.detach(), 0, group))
                     if full.bias is not None else None)  # fmt: skip

    def forward(self, x):
        if self.sequence_parallel:
            x = gather_sequence(x, self.group)
        else:
            x = copy_to_parallel(x, self.group)
        return torch.nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(torch.nn.Module):
    """``y = x Wᵀ + b`` with W's input features (columns) split across ranks: rank r takes
    its slice of x's features (what a column-parallel layer returns) and the partial
    outputs are summed — all-reduced, or with ``sequence_parallel`` reduce-scattered along
    dim 0. The bias is added once, after the sum. It is replicated, so it must be the same
    on every rank: ``from_layer``'s, or else zeros (as Megatron initialises it; a bias drawn
    by each rank's own random numbers would differ from rank to rank)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 sequence_parallel: bool = False,
                 from_layer: torch.nn.Linear | None = None):  # fmt: skip
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        full = from_layer or torch.nn.Linear(in_features, out_features, bias=bias)
        self.weight = torch.nn.Parameter(_shard(full.weight.detach(), 1, group))
        if full.bias is None:
            self.bias = None
        elif from_layer is None:
            self.bias = torch.nn.Parameter(torch.zeros_like(full.bias))
        else:
            self.bias = torch.nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        partial = torch.nn.functional.linear(x, self.weight)
        if self.sequence_parallel:
            out = scatter_sequence(partial, self.group)
            # each rank adds the bias to its rows only, so its gradient is a partial sum:
            # identity forward, AllReduce backward makes it whole on every rank
            bias = copy_to_parallel(self.bias, self.group) if self.bias is not None else None
        else:
            out = reduce_from_parallel(partial, self.group)
            bias = self.bias
        return out + bias if bias is not None else out


# --------------------------------------------------------------------------- decomposed


def _row_ranges(rows: int, chunks: int, what: str) -> list[tuple[int, int]]:
    """Row ranges of the ``chunks`` pieces a shard travels in (sizes differ by ≤ 1)."""
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"rank {dist.get_rank()}: chunks must be an integer ≥ 1, got {chunks!r}")
    if chunks > rows:
        raise ValueError(
            f"rank {dist.get_rank()}: chunks={chunks} is more than the {rows} rows of its "
            f"{what}: every piece needs at least one row"
        )
    return chunk_bounds(rows, chunks)


def _check_same_shapes(x, weight, group, name: str) -> None:
    """Every rank must hold a shard of the same shape (else the ring's pieces would not
    line up): refuse, naming the ranks and shapes, before any data moves."""
    me, world, left, right = _ring(group)
    if world == 1:
        return
    mine = torch.tensor([*x.shape, *weight.shape], dtype=torch.int64)
    theirs = torch.empty_like(mine)
    p2p.wait_all([p2p.isend(mine, right), p2p.irecv(theirs, left)])
    if not torch.equal(mine, theirs):
        raise ValueError(
            f"{name}: rank {dist.get_rank()} has input {list(x.shape)} and weight "
            f"{list(weight.shape)}, but rank {left} has input {theirs[:2].tolist()} and "
            f"weight {theirs[2:].tolist()}: every rank needs a shard of the same shape"
        )


def _checked_ring(x, weight, group, check: bool, name: str):
    """The ring (me, world, left, right as global ranks) of a decomposed matmul, after
    refusing an input that is not 2-D and (``check``) shard shapes that differ by rank."""
    if x.dim() != 2:
        raise ValueError(f"rank {dist.get_rank()}: {name} takes a 2-D input, got {list(x.shape)}")
    if check:
        _check_same_shapes(x, weight, group, name)
    return _ring(group)


def _finish_sends(timeline, sends) -> None:
    """Wait for the ``(name, handle, start, ...)`` sends; record each as the link saw it
    (see ``p2p.completed_at``)."""
    for name, handle, start, *_ in sends:
        handle.wait()
        if timeline is not None:
            end = p2p.completed_at(handle) or timeline.now()
            timeline.add(name, start, max(start, end), "comm")


def _stamp(timeline, device):
    """Now, for a compute span: the host clock, or the GPU's moment on a CUDA device."""
    return time.perf_counter() if timeline is None else timeline.stamp(device)


def _computed(timeline, name: str, start, device) -> None:
    if timeline is not None:
        timeline.add(name, start, timeline.stamp(device), "compute")


class _AllGatherMatmul(torch.autograd.Function):
    """``AllGather(x) @ Wᵀ`` with each piece multiplied as it arrives round the ring."""

    @staticmethod
    def forward(ctx, x, weight, group, chunks, timeline, check):
        me, world, left, right = _checked_ring(x, weight, group, check, "all_gather_matmul")
        rows = x.shape[0]
        pieces = _row_ranges(rows, chunks, "input shard")
        now = time.perf_counter
        w = weight.detach().t()
        out = x.new_empty((world * rows, weight.shape[0]))
        gathered = x.new_empty((world * rows, x.shape[1]))
        gathered[me * rows : (me + 1) * rows] = x.detach()
        # every receive posted up front, straight into its place: they arrive in the
        # order the left neighbour sends them (step by step, piece by piece)
        recvs = {}
        for k in range(1, world):
            src = (me - k) % world
            for p, (lo, hi) in enumerate(pieces):
                recvs[k, p] = p2p.irecv(gathered[src * rows + lo : src * rows + hi], left)
        sends = []
        for k in range(world):
            src = (me - k) % world  # whose shard is in hand at step k
            for p, (lo, hi) in enumerate(pieces):
                a, b = src * rows + lo, src * rows + hi
                if k:
                    recvs[k, p].wait()
                if k < world - 1:  # pass it on while multiplying it
                    sends.append((f"send {src}.{p}", p2p.isend(gathered[a:b], right), now()))
                t0 = _stamp(timeline, x.device)
                out[a:b] = gathered[a:b] @ w
                _computed(timeline, f"matmul {src}.{p}", t0, x.device)
        _finish_sends(timeline, sends)
        ctx.save_for_backward(gathered, weight)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        gathered, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_weight = grad.t() @ gathered
        # every rank holds a share of every row's input gradient: sum, keep my rows
        return _scatter_rows(grad @ weight, ctx.group), grad_weight, None, None, None, None


def all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, group=None, chunks: int = 1,
                      timeline=None, check: bool = True) -> torch.Tensor:  # fmt: skip
    """``AllGather(x, dim 0) @ weightᵀ``, decomposed so that communication hides behind the
    multiplications ("collective matmul"): at ring step k a rank multiplies the shard it
    holds while passing it on and receiving the next::

        step 0:  y[me]   = x_me   · Wᵀ      send x_me → right,     receive x_(me−1)
        step 1:  y[me−1] = x_me−1 · Wᵀ      send x_(me−1) → right, receive x_(me−2)
        …        N steps, N−1 transfers, each hidden under a multiplication

    ``chunks`` cuts every shard into that many row pieces that travel one after another,
    so that a piece is multiplied as soon as *it* arrives: with two ranks, only the own
    shard's product can hide the one transfer, unless it travels in pieces. More pieces
    hide more, and each pays the link's latency once more (``costmodel.collective_matmul``).

    Same result and gradients as ``ColumnParallelLinear`` with ``sequence_parallel`` (bias
    aside). Its messages are ``ok.p2p`` messages, over the link when one is set;
    ``timeline`` gets a compute span per piece multiplied and a comm span per piece sent.
    ``check``: first compare shard shapes with the left neighbour (one tiny message)."""
    return _AllGatherMatmul.apply(x, weight, group, chunks, timeline, check)


class _MatmulReduceScatter(torch.autograd.Function):
    """``ReduceScatter(x @ Wᵀ)`` with each piece's partial sum sent on as the next computes."""

    @staticmethod
    def forward(ctx, x, weight, group, chunks, timeline, check):
        me, world, left, right = _checked_ring(x, weight, group, check, "matmul_reduce_scatter")
        if x.shape[0] % world:
            raise ValueError(
                f"rank {dist.get_rank()}: {x.shape[0]} rows do not split into {world} blocks"
            )
        rows = x.shape[0] // world
        pieces = _row_ranges(rows, chunks, "output block")
        now = time.perf_counter
        xd, w = x.detach(), weight.detach().t()
        out = x.new_empty((rows, weight.shape[0]))
        recvs = {}  # the running sums from the left, posted up front in arrival order
        for k in range(1, world):
            for p, (lo, hi) in enumerate(pieces):
                buf = x.new_empty((hi - lo, weight.shape[0]))
                recvs[k, p] = (buf, p2p.irecv(buf, left))
        sends = []
        for k in range(world):
            block = (me - k - 1) % world  # the block with the longest way to go first
            for p, (lo, hi) in enumerate(pieces):
                t0 = _stamp(timeline, x.device)
                acc = xd[block * rows + lo : block * rows + hi] @ w  # my share of it
                _computed(timeline, f"matmul {block}.{p}", t0, x.device)
                if k:  # add the sum of the ranks before me
                    buf, handle = recvs[k, p]
                    handle.wait()
                    acc += buf
                if k < world - 1:
                    sends.append((f"send {block}.{p}", p2p.isend(acc, right), now(), acc))
                else:  # block me, summed over every rank
                    out[lo:hi] = acc
        _finish_sends(timeline, sends)
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = _gather_rows(grad, ctx.group)  # every block's output gradient
        return full @ weight, full.t() @ x, None, None, None, None


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group=None, chunks: int = 1,
                          timeline=None, check: bool = True) -> torch.Tensor:  # fmt: skip
    """``ReduceScatter(x @ weightᵀ, dim 0)`` decomposed: the row-parallel layer's partial
    outputs are summed round the ring block by block, and each rank computes its share of
    the next block while the running sum of the previous one travels::

        step 0:  acc = x[me−1]·Wᵀ   send acc → right;  compute x[me−2]·Wᵀ;  acc = received + it
        …        after N−1 steps acc is block me, summed over every rank

    ``chunks`` cuts every block into row pieces: a piece's partial sum leaves as soon as it
    is computed, while the next piece computes. Same result and gradients as
    ``RowParallelLinear`` with ``sequence_parallel`` (bias aside); ``timeline`` and
    ``check`` as in :func:`all_gather_matmul`."""
    return _MatmulReduceScatter.apply(x, weight, group, chunks, timeline, check)
