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

import torch
import torch.distributed as dist

from .collectives import (
    _ring,
    chunk_bounds,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)

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
    dim 0. The bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 sequence_parallel: bool = False,
                 from_layer: torch.nn.Linear | None = None):  # fmt: skip
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        full = from_layer or torch.nn.Linear(in_features, out_features, bias=bias)
        self.weight = torch.nn.Parameter(_shard(full.weight.detach(), 1, group))
        self.bias = (torch.nn.Parameter(full.bias.detach().clone())
                     if full.bias is not None else None)  # fmt: skip

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


class _AllGatherMatmul(torch.autograd.Function):
    """``AllGather(x) @ Wᵀ`` with each shard multiplied as it arrives round the ring."""

    @staticmethod
    def forward(ctx, x, weight, group):
        from . import p2p  # noqa: PLC0415

        me, world, left, right = _ring(group)  # neighbours as global ranks
        rows = x.shape[0]
        out = x.new_empty((world * rows, weight.shape[0]))
        gathered = x.new_empty((world * rows, *x.shape[1:]))
        chunk = x.detach().contiguous()
        for k in range(world):
            src = (me - k) % world  # whose shard is in hand at step k
            handles = []
            if k < world - 1:  # pass it on, and take the next one, while computing
                nxt = torch.empty_like(chunk)
                handles = [p2p.isend(chunk, right), p2p.irecv(nxt, left)]
            out[src * rows : (src + 1) * rows] = chunk @ weight.detach().t()
            gathered[src * rows : (src + 1) * rows] = chunk
            p2p.wait_all(handles)
            if k < world - 1:
                chunk = nxt
        ctx.save_for_backward(gathered, weight)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        gathered, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_weight = grad.t() @ gathered
        # every rank holds a share of every row's input gradient: sum, keep my rows
        return _scatter_rows(grad @ weight, ctx.group), grad_weight, None


def all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """``AllGather(x, dim 0) @ weightᵀ``, decomposed so that communication hides behind the
    multiplications ("collective matmul"): at ring step k a rank multiplies the shard it
    holds while passing it on and receiving the next::

        step 0:  y[me]   = x_me   · Wᵀ      send x_me → right,     receive x_(me−1)
        step 1:  y[me−1] = x_me−1 · Wᵀ      send x_(me−1) → right, receive x_(me−2)
        …        N steps, N−1 transfers, each hidden under a multiplication

    Same result and gradients as ``ColumnParallelLinear`` with ``sequence_parallel`` (bias
    aside). Its messages are ``ok.p2p`` messages, over the link when one is set."""
    return _AllGatherMatmul.apply(x, weight, group)


class _MatmulReduceScatter(torch.autograd.Function):
    """``ReduceScatter(x @ Wᵀ)`` with each block's partial sum sent on as the next computes."""

    @staticmethod
    def forward(ctx, x, weight, group):
        from . import p2p  # noqa: PLC0415

        me, world, left, right = _ring(group)  # neighbours as global ranks
        if x.shape[0] % world:
            raise ValueError(
                f"rank {dist.get_rank()}: {x.shape[0]} rows do not split into {world} blocks"
            )
        rows = x.shape[0] // world
        w = weight.detach().t()

        def part(c):  # this rank's share of block c of the output
            return x.detach()[c * rows : (c + 1) * rows] @ w

        acc = part((me - 1) % world)  # the block with the longest way to go first
        for k in range(world - 1):
            buf = torch.empty_like(acc)
            handles = [p2p.isend(acc, right), p2p.irecv(buf, left)]
            mine = part((me - k - 2) % world)  # computed while the partial sums travel
            p2p.wait_all(handles)
            acc = buf + mine
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return acc

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = _gather_rows(grad, ctx.group)  # every block's output gradient
        return full @ weight, full.t() @ x, None


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """``ReduceScatter(x @ weightᵀ, dim 0)`` decomposed: the row-parallel layer's partial
    outputs are summed round the ring block by block, and each rank computes its share of
    the next block while the running sum of the previous one travels::

        step 0:  acc = x[me−1]·Wᵀ   send acc → right;  compute x[me−2]·Wᵀ;  acc = received + it
        …        after N−1 steps acc is block me, summed over every rank

    Same result and gradients as ``RowParallelLinear`` with ``sequence_parallel`` (bias
    aside). Its messages are ``ok.p2p`` messages, over the link when one is set."""
    return _MatmulReduceScatter.apply(x, weight, group)
