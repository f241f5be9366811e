"""PyTorch's own tensor collectives under one name across the supported torch versions.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` (same arguments) and warns on
the old names; torch 2.4–2.12 only have the old ones. Labs and benchmarks call
these so that they run, without warnings, on every torch the kit supports.
:func:`builtin_all_reduce` is the one adapter of the built-in AllReduce to the kit's
signature (the wrappers' and ``ok.train``'s ``all_reduce="builtin"``).
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


class _Averaged:
    """The handle of a built-in async AllReduce whose wait() also divides (op avg)."""

    def __init__(self, work, tensor, world):
        self.work, self.tensor, self.world = work, tensor, world
        self._divided = False

    def wait(self):
        self.work.wait()
        if not self._divided:  # a second wait() must not divide again
            self._divided = True
            self.tensor /= self.world
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


def builtin_all_reduce(tensor, op="sum", group=None, async_op=False):
    """PyTorch's own AllReduce (gloo/NCCL) with the kit's signature (``op="avg"`` too, which
    gloo lacks): the yardstick, and the fast path when the link is not the lesson.
    Async: a handle whose ``wait()`` also divides for ``"avg"``, else torch's own ``Work``."""
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
           "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}  # fmt: skip
    if op not in ops:
        raise ValueError(f"op must be one of {', '.join(ops)}; got {op!r}")
    work = dist.all_reduce(tensor, op=ops[op], group=group, async_op=async_op)
    world = dist.get_world_size(group)
    if async_op:
        return _Averaged(work, tensor, world) if op == "avg" else work
    if op == "avg":
        tensor /= world
    return None
