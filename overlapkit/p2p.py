"""Point-to-point messages, optionally over an emulated link.

The kit's collectives are built from these four calls::

    send(tensor, dst)              recv(tensor, src)
    isend(tensor, dst) -> handle   irecv(tensor, src) -> handle

With a :class:`Link` — ``ok.launch(fn, world_size=4, link=ok.Link(50, 1))`` —
each message also pays the link's cost, modelled like a NIC::

    sender's outgoing link   |== S/B ==|== S/B ==|          messages leave one after another
    receiver's incoming link       |== S/B ==|== S/B ==|    and arrive one after another
    message done at                            ... + α      (α: latency)

* a message of S bytes completes no earlier than α + S/B after it starts;
* messages leaving one rank share its outgoing link, messages arriving at a
  rank share its incoming link (N−1 senders into one root take (N−1)·S/B,
  while a ring step, one in and one out per rank, is never contended);
* waiting sleeps, so computation really runs while a message is "on the wire"
  (all but the last few tens of µs, in which the waiting thread yields in a
  loop: a sleeping thread wakes ~35 µs late on a VM, which would add to α);
* the real bytes still move, concurrently with the emulated delay, so results
  stay real: through shared memory when the ranks share a machine (``ok.launch``;
  see :mod:`overlapkit.shm` — loopback sockets would be slower than the link
  being emulated), else through the process group.

**What matches what.** Messages travel in *streams*, and a receive only ever
matches a send of the same stream, group and pair of ranks, in the order they
were posted (as NCCL matches, and whatever tags say):

* the **user** stream: your own ``ok.p2p`` calls (a learner's ring, a
  pipeline's activations);
* the **kit** stream: the messages of the kit's collectives. They travel in
  process groups and shared-memory channels of the kit's own, so they never
  pair with your ``ok.p2p`` messages nor with your ``dist.all_reduce`` or
  ``dist.send`` calls, even while both are in flight on the same ranks.

Kit collectives run one at a time per rank, in the order they were issued
(see :mod:`overlapkit.ordering`); each one first tells its peers which
operation it is (number, op, size, dtype, issuing thread and line) and checks
what its peers announced, so ranks that disagree get a clear error naming
both calls instead of exchanging the wrong bytes.

Every handle is honest: ``wait(timeout=)`` honours its timeout, and a handle
never waited is reported when the launched function returns.

This module holds the calls; their parts live apart: the link's model and pacing
(:mod:`overlapkit.link`), the process groups and posting on them
(:mod:`overlapkit.groups`), the kit's operations and their mismatches
(:mod:`overlapkit.kitops`), headers and announcements (:mod:`overlapkit.messages`), a
message's handle (:mod:`overlapkit.transfers`), the bytes through shared memory
(:mod:`overlapkit.shmlink`) and the receive side (:mod:`overlapkit.inbox`).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.distributed as dist

# `name as name`: re-exported, for the kit's modules, checks and tests that use it from here
from . import groups, inbox, routes, shmlink
from .groups import _BEGIN_TAG, _kit_group, _pg_recv, _pg_send, _staged, user_stream_ops
from .groups import KIT as KIT
from .groups import KIT_DATA_TAG as KIT_DATA_TAG
from .groups import KIT_TAG as KIT_TAG
from .groups import USER as USER
from .groups import _group_name as _group_name
from .inbox import EAGER_BYTES as EAGER_BYTES
from .inbox import _Receive
from .inbox import _SharedInbox as _SharedInbox
from .inbox import mark_messages as mark_messages
from .kitops import CollectiveMismatchError as CollectiveMismatchError
from .kitops import Op as Op
from .kitops import current_op as current_op
from .kitops import running as running
from .link import _FREE, _LinkState, pace_precisely
from .link import Link as Link
from .messages import _ANNOUNCE_BYTES, _announcement, _group_header
from .shmlink import _send_shared, _shared_memory
from .shmlink import linger as linger
from .shmlink import shared_memory_usage as shared_memory_usage
from .shmlink import use_shared_memory as use_shared_memory
from .transfers import _describe, _Landed, _OnTheLink, _Plain, _Send

_link: _LinkState | None = None


def set_link(link: Link | None) -> None:
    """Use ``link`` for this rank's kit messages from now on (None: no emulation)."""
    global _link
    _link = _LinkState(link) if link is not None else None
    if link is not None:
        pace_precisely()


def current_link() -> Link | None:
    return _link.link if _link is not None else None


def through_shared_memory(tensor: torch.Tensor) -> bool:
    """Whether messages of ``tensor`` go through the kit's shared memory (an emulated
    link between ranks of one ``ok.launch``), rather than through a process group."""
    return _link is not None and _shared_memory(tensor)


_forget_hooks: list = []


def on_forget(hook) -> None:
    """Call ``hook()`` from :func:`forget_private_groups` (caches of group facts)."""
    _forget_hooks.append(hook)


def forget_private_groups() -> None:
    """Drop the kit's process groups and what it remembers of the default group
    (before that group is destroyed)."""
    global _world_size, _my_rank
    groups.forget()
    routes.forget()
    _world_size = _my_rank = None
    shmlink._ends.clear()
    inbox._ends.clear()
    for hook in _forget_hooks:
        hook()


# --------------------------------------------------------------------------- the four calls


_world_size: int | None = None
_my_rank: int | None = None


def _check_peer(call: str, peer, word: str) -> None:
    """A peer outside the world, or this rank itself, would hang in the transport: say
    so at once."""
    global _world_size, _my_rank
    if _world_size is None:  # looked up once: it sits on every message's path
        _world_size, _my_rank = dist.get_world_size(), dist.get_rank()
    world = _world_size
    try:
        ok = not isinstance(peer, bool) and 0 <= operator.index(peer) < world
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(
            f"ok.p2p.{call}: rank {dist.get_rank()} {word} rank {peer!r}, but the ranks are "
            f"0..{world - 1} (world size {world}). Neighbours wrap around: take them mod N, "
            "e.g. (me + 1) % world and (me - 1) % world."
        )
    if peer == _my_rank:
        raise ValueError(
            f"ok.p2p.{call}: rank {peer} {word} itself. A rank's own data needs no message "
            "(and a receive from yourself would wait forever): use or copy it directly, and "
            "exchange messages only with the other ranks (skip your own rank in the loop)."
        )


def isend(tensor: torch.Tensor, dst: int, group=None):
    """Start sending ``tensor`` to global rank ``dst``; returns a handle with ``wait()``."""
    _check_peer("isend", dst, "sends to")
    return _isend(tensor, dst, group, _link)


def irecv(tensor: torch.Tensor, src: int, group=None):
    """Start receiving into ``tensor`` from global rank ``src``; returns a handle."""
    _check_peer("irecv", src, "receives from")
    return _irecv(tensor, src, group, _link)


#: bytes this process has handed to :func:`_isend` (every message of the kit and of its
#: users, not the collectives' announcements), as stored: a tensor subclass cannot say
#: it is smaller
_sent_bytes = [0]


@dataclasses.dataclass(frozen=True)
class Stats:
    """What this process has sent through the kit so far (:func:`stats`)."""

    #: bytes of the kit's messages, as stored (the collectives' announcements aside)
    bytes_sent: int
    #: messages the kit sent or received on torch's own process groups (``ok.p2p`` calls
    #: without a link, on the CPU): each counts one in that group's sequence number, so
    #: they tell the kit's messages from ``torch.distributed``'s own calls there
    user_group_messages: int


def stats() -> Stats:
    """What this process has sent through the kit so far: take it before and after a piece
    of code for what that code sent."""
    return Stats(bytes_sent=_sent_bytes[0], user_group_messages=user_stream_ops())


def open_groups(group=None) -> None:
    """Make the kit's own process group over ``group``'s ranks now, on every rank of it
    (each makes it otherwise at its first kit collective there): a benchmark then times no
    connection set-up, and nothing later opens one."""
    _kit_group(group)


def _isend(tensor: torch.Tensor, dst: int, group, state: _LinkState | None, tag=KIT_TAG):
    if tag != _BEGIN_TAG:
        with torch._C.DisableTorchFunctionSubclass():
            _sent_bytes[0] += tensor.numel() * tensor.element_size()
    if _staged(tensor, group):  # the copy waits for the caller's stream: the bytes are final
        tensor = routes.to_host(tensor)
    if state is not None and _shared_memory(tensor):
        return _send_shared(tensor, dst, group, state)
    data = tensor.contiguous()
    describe = _describe("send", tensor, "to", dst)
    if state is None:
        return _Plain([_pg_send(data, dst, group, tag)], describe)
    nbytes = data.numel() * data.element_size()
    departed, last_byte = state.depart(nbytes)
    op = current_op()
    seq, signature = (op.seq, op.signature) if op else (0, 0)
    header = _group_header(departed, nbytes, seq, signature)
    works = [
        _pg_send(header.to(tensor.device), dst, group, KIT_TAG),
        _pg_send(data, dst, group, KIT_DATA_TAG),
    ]
    return _Send(describe, last_byte, works)


def _irecv(tensor: torch.Tensor, src: int, group, state: _LinkState | None, tag=KIT_TAG):
    if _staged(tensor, group):  # lands on the host, then is copied into place
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        return _Landed(_irecv(host, src, group, state, tag), host, tensor)
    if state is not None:
        return _Receive(tensor, src, group, state)
    describe = _describe("receive", tensor, "from", src)
    if tensor.is_contiguous():
        return _Plain([_pg_recv(tensor, src, group, tag)], describe)
    buf = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return _Plain([_pg_recv(buf, src, group, tag)], describe, lambda: tensor.copy_(buf))


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    isend(tensor, dst, group).wait()


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    irecv(tensor, src, group).wait()


def wait_all(handles) -> None:
    for h in handles:
        h.wait()


def completed_at(handle) -> float | None:
    """When a waited message left (send) or arrived (receive) over the emulated link,
    on the host clock of ``time.perf_counter()``; ``None`` without a link (then only
    the moment ``wait()`` returned is known). A span drawn from it shows the transfer
    as the link saw it, not as late as the code got round to waiting for it."""
    done = getattr(handle, "_done_at", None)
    return done if isinstance(handle, _OnTheLink) and done else None


# --------------------------------------------------------------------------- announcements


def announce_and_check(to: list[int], frm: list[int], group, device, data_follows: bool) -> None:
    """Tell the ranks in ``to`` which operation this is; check what the ranks in
    ``frm`` announced. Raises :class:`CollectiveMismatchError`.

    Through shared memory every header carries the op's number and signature,
    and an op's first message to a peer its description, so when data will
    flow to every peer in ``to`` (``data_follows``) that *is* the announcement,
    at no cost. Otherwise — an op with nothing to send to some peer, or a
    process group in between — it is a small message of its own, sent ahead of
    the data and checked when the op first waits for one of its messages (so
    the data is already on its way, and a mismatch is caught before any is used).
    """
    op = current_op()
    if (
        data_follows
        and _link is not None
        and shmlink._channels is not None
        and device.type == "cpu"
    ):
        return
    # in the data's own order (so it is checked before any data lands), but over a
    # link that costs nothing: the α-β model has no term for it, and a NIC none
    free = _FREE if _link is not None else None
    sends = [_isend(_announcement(op, device), dst, group, free, _BEGIN_TAG) for dst in to]
    boxes = [torch.empty(_ANNOUNCE_BYTES, dtype=torch.uint8, device=device) for _ in frm]
    recvs = [_irecv(box, src, group, free, _BEGIN_TAG) for box, src in zip(boxes, frm, strict=True)]
    op.announcements = list(zip(frm, recvs, boxes, strict=True))
    op.announcement_sends = sends  # kept alive until the op ends (gloo sends by reference)
