"""The process groups a message travels through: the user's and the kit's streams, group
names, the kit's own gloo groups, and posting a message's send or receive on them.

The **user** stream (a learner's ``ok.p2p`` calls) goes through the user's own process
groups, under tags apart from the learner's own ``dist.send``; the **kit** stream (the
kit's collectives) through gloo groups of the kit's own, tagged with the operation's
signature; CUDA tensors on NCCL through the directed routes of :mod:`overlapkit.routes`.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from . import handles, routes
from .kitops import current_op

#: tags of the user stream's messages through a process group, apart from a learner's
#: own dist.send/recv (tag 0); the kit stream has process groups of its own
KIT_TAG = 7171
#: tag of message bodies that travel through the process group under a link
KIT_DATA_TAG = KIT_TAG + 1
_BEGIN_TAG = KIT_TAG + 2
USER, KIT = "user", "kit"


_world_name: str | None = None


def _group_name(group) -> str:
    global _world_name
    if group is not None:
        return group.group_name
    if _world_name is None:  # looked up once: it sits on every message's path
        _world_name = dist.group.WORLD.group_name
    return _world_name


_private: dict = {}
_private_lock = threading.Lock()
_making: dict = {}


def _kit_group(group):
    """The kit's own gloo process group over ``group``'s ranks, for the kit stream's CPU
    bytes (CUDA tensors on NCCL take a directed route: :mod:`overlapkit.routes`).

    Made straight from the default store, outside torch's group registry, so
    making it needs no collective on the user's groups: each member makes it
    when it runs its first kit collective on ``group`` (which every member runs).
    """
    key = _group_name(group)
    pg = _private.get(key)
    if pg is not None:
        return pg
    with _private_lock:  # one maker per group: making one waits for the peers to make it,
        making = _making.setdefault(key, threading.Lock())  # so groups do not wait in line
    with making:
        if key not in _private:
            _private[key] = _make_kit_group(group, key)
    return _private[key]


def _make_kit_group(group, name: str):
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    store = dist.PrefixStore(f"overlapkit/cpu/{name}", c10d._get_default_store())
    me, size = dist.get_rank(group), dist.get_world_size(group)
    return dist.ProcessGroupGloo(store, me, size, timedelta(seconds=3600))


def forget() -> None:
    """Drop the kit's process groups and what is known of the default group's name and of
    the groups' backends (before the default group is destroyed)."""
    global _world_name
    with _private_lock:
        _private.clear()
        _carries_cuda.clear()
    _world_name = None


def _to_pg_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_group_rank(group, rank)


def _kit_tag(tag: int) -> int:
    """A kit op's messages carry its signature in their tag (announcements excepted):
    gloo matches by tag, so the data of two ranks that disagree never meets (gloo
    aborts the process on a size mismatch) and the announcements can tell them."""
    op = current_op()
    if tag == _BEGIN_TAG or op is None or not op.check:
        return tag
    return (tag & 0x7FF) << 20 | op.signature & 0xFFFFF  # below 2³¹: gloo takes int tags


_user_ops = [0]  # messages the kit sent or received on the user's own groups
_user_ops_lock = threading.Lock()


def user_stream_ops() -> int:
    """How many messages the kit has sent or received on torch's (the user's) process
    groups so far: each counts one in that group's sequence number, so a check that
    refuses built-in operations tells the kit's messages from the learner's own."""
    return _user_ops[0]


def _count_user_op() -> None:
    with _user_ops_lock:
        _user_ops[0] += 1


def _pg_send(tensor: torch.Tensor, dst: int, group, tag: int):
    """Start sending through the stream's process group; the user stream uses ``group``,
    CUDA tensors the directed NCCL route of their stream (:mod:`overlapkit.routes`)."""
    namespace = USER if current_op() is None else KIT
    if routes.recorded():
        routes.note("send", namespace, _group_name(group), dist.get_rank(), dst, tensor)
    if tensor.device.type == "cuda":
        pg, peer = routes.directed_group(namespace, _group_name(group), dist.get_rank(), dst)
        return pg.send([tensor], peer, 0)
    if namespace == USER:
        _count_user_op()
        return _pollable(dist.isend(tensor, dst, group=group, tag=tag), tensor)
    pg = _kit_group(group)
    return _pollable(pg.send([tensor], _to_pg_rank(group, dst), _kit_tag(tag)), tensor)


def _pg_recv(tensor: torch.Tensor, src: int, group, tag: int):
    namespace = USER if current_op() is None else KIT
    if routes.recorded():
        routes.note("recv", namespace, _group_name(group), dist.get_rank(), src, tensor)
    if tensor.device.type == "cuda":
        pg, peer = routes.directed_group(namespace, _group_name(group), src, dist.get_rank())
        return pg.recv([tensor], peer, 0)
    if namespace == USER:
        _count_user_op()
        return _pollable(dist.irecv(tensor, src, group=group, tag=tag), tensor)
    pg = _kit_group(group)
    return _pollable(pg.recv([tensor], _to_pg_rank(group, src), _kit_tag(tag)), tensor)


_carries_cuda: dict = {}


def _staged(tensor: torch.Tensor, group) -> bool:
    """Whether a CUDA tensor must travel through the host: its group's backend (gloo, as
    on a one-GPU box where the ranks share the GPU) moves CPU tensors only."""
    if tensor.device.type != "cuda":
        return False
    name = _group_name(group)
    known = _carries_cuda.get(name)
    if known is None:
        known = _carries_cuda[name] = routes.carries_cuda(group)
    return not known


def _pollable(work, tensor: torch.Tensor):
    """Gloo's (a CPU tensor's) work, made pollable (handles.Polled); NCCL's polls as is."""
    return handles.Polled(work) if tensor.device.type == "cpu" else work
