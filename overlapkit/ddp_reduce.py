"""How a bucket of gradients is averaged: the collective a data-parallel wrapper calls.

The kit's wrappers (``ok.NaiveDDP``, ``ok.OverlapDDP``, ``ok.BucketedDDP``) take
``all_reduce=`` as the built-in (on a process group of the kit's own, made once per default
group and shared with ``ok.FullyShardedDP``), the kit's ring, a compressor of
``ok.compression`` or a learner's function; :func:`ddp_comm_hook` puts the same
collectives under PyTorch's own ``DistributedDataParallel``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .builtin import builtin_all_reduce
from .collectives import ring_all_reduce
from .compression import Compressor

# --------------------------------------------------------------------------- the reduction


def _resolve_all_reduce(all_reduce, group):
    """(``flat -> handle``, its group, whether it averages): the built-in (on ``group`` as
    PyTorch's DDP does with ``process_group``; without one, on a process group of the kit's
    own, so that a learner's ``dist.all_reduce`` on the default group never pairs with it),
    the kit's ring (``"ring"`` or ``ok.ring_all_reduce``: async, so an emulated link
    applies), a compressor of ``ok.compression`` (it averages, from fewer bytes), or any
    ``fn(tensor, async_op=True)`` that sums in place."""
    if all_reduce is None or all_reduce == "builtin":
        own = _own_group() if group is None else group
        return lambda flat: builtin_all_reduce(flat, group=own, async_op=True), own, False
    if isinstance(all_reduce, Compressor):  # averages; wants each bucket's key and shapes
        return all_reduce, group, True
    if all_reduce == "ring" or all_reduce is ring_all_reduce:
        # the ring averages as it goes (each rank divides its reduced chunk): no pass after
        reduce = lambda flat: ring_all_reduce(flat, op="avg", group=group, async_op=True)  # noqa: E731
        return reduce, group, True
    if callable(all_reduce):
        return lambda flat: all_reduce(flat, async_op=True), group, False
    raise ValueError(
        f"all_reduce must be None (the built-in), 'ring', a compressor of ok.compression, "
        f"or a function "
        f"fn(tensor, async_op=True) that sums in place; got {all_reduce!r}"
    )


_own: list = []  # [the default group they were made in, the kit's own groups of all ranks...]


def _own_group(which: int = 0):
    """Process groups of every rank for the wrappers' built-in collectives, made once per
    default group (a new group per wrapper piled up connections in a bucket-size sweep);
    ``which`` picks one of several (FSDP gathers on one and reduces on another, so the two
    never queue behind each other). Every rank makes them at its first wrapper, so at the
    same point of the program: a new group is a collective call of every rank. A subgroup
    is never made here: ranks outside it would have to join the call, which a wrapper built
    on {0, 2} alone cannot ask of 1 and 3."""
    world = dist.distributed_c10d._get_default_group()
    if not _own or _own[0] is not world:
        _own[:] = [world]
    while len(_own) <= which + 1:
        _own.append(dist.new_group())
    return _own[which + 1]


# --------------------------------------------------------------------------- PyTorch DDP


def ddp_comm_hook(all_reduce=None, timeline=None, compress=None):
    """A comm hook for ``DistributedDataParallel.register_comm_hook(state, hook)`` that
    averages each of PyTorch's gradient buckets with a kit collective (default: the
    kit's ring, async, so PyTorch's own reducer runs over an emulated link too).

    ``state`` is the process group (or ``None`` for the default one). ``all_reduce``
    is called as ``all_reduce(tensor, group=state, async_op=True)`` and must sum in
    place and return a handle with ``get_future()``. ``timeline`` records each
    bucket's AllReduce on the comm lane. ``compress``: a compressor of ``ok.compression``
    instead (``ok.compression.PowerSGD(rank=4)``, one per model: it keeps each bucket's
    residual and memory under the bucket's index), which averages from fewer bytes.
    """
    if compress is not None:
        if all_reduce is not None:
            raise ValueError("ddp_comm_hook: give all_reduce= or compress=, not both")
        if not isinstance(compress, Compressor):
            raise TypeError(f"ddp_comm_hook: compress must be a compressor of ok.compression "
                            f"(Half, TopK, PowerSGD); got {compress!r}")  # fmt: skip
        return _compressed_hook(compress, timeline)
    all_reduce = all_reduce or ring_all_reduce

    def kit_all_reduce_hook(state, bucket):
        buf = bucket.buffer()
        world = dist.get_world_size(state)
        handle = all_reduce(buf, group=state, async_op=True)
        if timeline is not None:
            timeline.track(f"torch bucket {bucket.index()}", handle, "comm", device=buf.device)
        # value() first: a callback that ignores it turns a failed reduction into a result
        return handle.get_future().then(lambda done: (done.value(), buf.div_(world))[1])

    # DDP checks the annotation itself (a string here, under postponed annotations)
    kit_all_reduce_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
    return kit_all_reduce_hook


def _compressed_hook(compress, timeline):
    def kit_compressed_hook(state, bucket):
        buf = bucket.buffer()
        shapes = [g.shape for g in bucket.gradients()]
        handle = compress(buf, group=state, key=bucket.index(), shapes=shapes)
        if timeline is not None:
            timeline.track(f"torch bucket {bucket.index()}", handle, "comm", device=buf.device)
        return handle.get_future().then(lambda done: (done.value(), buf)[1])

    kit_compressed_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
    return kit_compressed_hook
