"""Which process group carries a point-to-point message through a backend, and a record
of what each rank posted there.

**Why NCCL needs a route of its own.** NCCL runs a communicator's point-to-point calls
between two ranks on one CUDA stream, in the order they were posted, and a send or a
receive there holds the stream until the peer posts its match (beyond what NCCL buffers,
which a large message exceeds)::

    stage 0's stream:  send a0 ─► recv g0 ─► send a1        recv g0 waits for g0,
    stage 1's stream:  recv a0 ─► recv a1 ─► send g0        queued behind recv a1,
                                                            which waits for send a1:
                                                            a cycle, the GPU hangs

Gloo and the kit's shared memory have no such stream: any number of messages may be in
flight each way. So on NCCL every message from rank ``a`` to rank ``b`` travels on a
communicator that carries nothing else — that direction of that pair, in one namespace
(the user's messages or the kit's, per group)::

    a ══ a→b communicator ══► b      (its stream holds a's sends to b, in order; b posts
    a ◄═ b→a communicator ═══ b       its receives from a in the same order: they match)

Each such stream is first-in first-out in one direction, so a message can wait only for
the messages sent before it the same way, never for one going the other way: no order of
posting that works with unlimited buffering can hang. (Batching a step's sends and
receives, ``batch_isend_irecv``, fixes one ring step; it does not fix a pipeline that
posts a receive early, nor a ring whose receives are all posted up front.)

**The record.** :func:`recording` collects, per rank, every message posted through a
process group, with the communicator NCCL would use for it (:func:`nccl_route`): the
order of posts as data, which ``tests/nccl_order.py`` replays against NCCL's rule.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist

from . import runtime

_directed: dict = {}
_directed_lock = threading.Lock()


def nccl_route(namespace: str, group_name: str, src: int, dst: int) -> tuple:
    """The communicator of a message from global rank ``src`` to ``dst`` on NCCL."""
    return (namespace, group_name, src, dst)


def directed_group(namespace: str, group_name: str, src: int, dst: int):
    """(NCCL process group of the two ranks, the peer's rank in it): ``src`` is rank 0 and
    ``dst`` rank 1. Made from the default store on first use by each of the two ranks, so
    no other rank takes part; NCCL connects it at its first message."""
    key = nccl_route(namespace, group_name, src, dst)
    with _directed_lock:
        made = _directed.get(key)
        if made is None:
            import torch.distributed.distributed_c10d as c10d  # noqa: PLC0415

            me = dist.get_rank()
            if me not in (src, dst):
                raise RuntimeError(f"rank {me} is neither end of the route {src} -> {dst}")
            store = dist.PrefixStore(
                f"overlapkit/nccl/{namespace}/{group_name}/{src}->{dst}",
                c10d._get_default_store(),
            )
            made = _directed[key] = dist.ProcessGroupNCCL(store, int(me == dst), 2)
    return made, 1 - int(dist.get_rank() == dst)


def forget() -> None:
    """Drop the directed communicators (before the default group is destroyed)."""
    with _directed_lock:
        _directed.clear()


# --------------------------------------------------------------------------- the record

_record: list | None = None


@contextlib.contextmanager
def recording():
    """Collect every message this process posts through a process group while the block
    runs: a list of ``(thread, kind, route, peer, nbytes, dtype)`` with ``kind`` "send" or
    "recv" and ``route`` the NCCL communicator (:func:`nccl_route`)."""
    global _record
    previous, _record = _record, []
    try:
        yield _record
    finally:
        _record = previous


def recorded() -> bool:
    """Whether a record is being made (the message path asks before it gathers a note)."""
    return _record is not None


def note(kind: str, namespace: str, group_name: str, me: int, peer: int, tensor) -> None:
    """Add one posted message to the record (:func:`recording` is open)."""
    src, dst = (me, peer) if kind == "send" else (peer, me)
    nbytes = tensor.numel() * tensor.element_size()
    _record.append(
        (
            threading.current_thread().name,
            kind,
            nccl_route(namespace, group_name, src, dst),
            peer,
            nbytes,
            str(tensor.dtype).removeprefix("torch."),
        )
    )


def carries_cuda(group=None) -> bool:
    """Whether ``group``'s backend moves CUDA tensors point to point (NCCL does; gloo
    does not, so the kit stages them through the host)."""
    return runtime.backends(group).get("cuda") == "nccl"


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor``, for a backend that moves CPU tensors only."""
    return tensor.detach().to("cpu")
