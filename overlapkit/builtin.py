"""PyTorch's own tensor collectives under one name across the supported torch versions.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` (same arguments) and warns on
the old names; torch 2.4–2.12 only have the old ones. Labs and benchmarks call
these so that they run, without warnings, on every torch the kit supports.
"""

from __future__ import annotations

import torch.distributed as dist


def all_gather_tensor(output, input, group=None, async_op: bool = False):
    """``output`` = every rank's ``input`` concatenated in rank order (the built-in)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """``output`` on rank r = the reduction over ranks of chunk r of ``input`` (the built-in)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)
