"""The emulated link's bytes through shared memory: when the ranks share a machine
(``ok.launch``), a message's bytes and header go through :mod:`overlapkit.shm`'s
channels (loopback sockets would be slower than the link being emulated), and a
message that finds no room is pushed in segment by segment as the receiver frees
space, so that ``isend`` never blocks. Receiving is :mod:`overlapkit.inbox`'s.
"""

from __future__ import annotations

import collections
import threading
import time

import torch
import torch.distributed as dist

from . import shm
from .groups import KIT, USER, _group_name
from .kitops import Op, current_op
from .link import _LinkState
from .transfers import _describe, _Send

_channels: shm.Channels | None = None


def use_shared_memory(directory: str | None) -> None:
    """Move emulated messages' bytes through shared memory in ``directory`` (set by
    ``ok.launch``, whose ranks share one machine); None: through the process group."""
    global _channels
    _channels = shm.Channels(directory, dist.get_rank()) if directory else None


def linger(returned, limit_s: float) -> None:
    """Before this rank's process ends: wait until every rank it sent messages to through
    shared memory has read one (so holds the headers' pipe open), or has returned itself
    (``returned(rank)``; it will read nothing more), or ``limit_s`` passes. A real
    transport delivers what a finished sender sent; a pipe forgets it when its last open
    end closes."""
    end = time.monotonic() + limit_s
    while _channels is not None and time.monotonic() < end:
        if all(returned(peer) for peer in _channels.unread()):
            return
        time.sleep(0.002)


def shared_memory_usage() -> dict | None:
    """This rank's /dev/shm use by the emulated link (None without shared memory)."""
    return _channels.usage() if _channels is not None else None


def _shared_memory(tensor: torch.Tensor) -> bool:
    """Whether a message's bytes and header go through shared memory (else the group)."""
    return _channels is not None and tensor.device.type == "cpu"


class _Pusher:
    """Moves into a channel the messages that found no room, in order, segment by
    segment as the receiver frees space — so ``isend`` never blocks, whatever is
    in flight (a NIC's queue of pending work)."""

    SEGMENT = 4 << 20

    def __init__(self, out: shm.Outgoing):
        self.out = out
        self.queue: collections.deque = collections.deque()
        self.running = False

    def add(self, job) -> None:  # call with out.lock held
        self.queue.append(job)
        if not self.running:
            self.running = True
            threading.Thread(target=self._run, name="overlapkit-pusher", daemon=True).start()

    def _run(self) -> None:
        out = self.out
        pause = 20e-6
        while True:
            with out.lock:
                if not self.queue:
                    self.running = False
                    return
                (data, address, total), sent, header, handle = self.queue[0]
                n = min(total - sent, self.SEGMENT)
                placed = out.put(address + sent, n)
                if placed is None and n > 65536:
                    n = 65536  # little room: smaller steps
                    placed = out.put(address + sent, n)
                if placed is not None:
                    out.post(header(placed, sent, n))
                    sent += n
                    if sent == total:
                        self.queue.popleft()
                        if handle.taken is not None:
                            handle.taken = (out, placed[1])
                        handle.placed.set()
                    else:
                        self.queue[0] = ((data, address, total), sent, header, handle)
                    pause = 20e-6
                    continue
            time.sleep(pause)  # wait for the receiver to free space
            pause = min(pause * 2, 1e-3)


_pushers: dict = {}


_ends: dict = {}  # (stream, group, peer) -> channel end: a hot lookup


def _outgoing(op: Op | None, group, dst: int) -> shm.Outgoing:
    key = (op is None, group, dst)
    out = _ends.get(key)
    if out is None:
        out = _ends[key] = _channels.outgoing(f"{KIT if op else USER}-{_group_name(group)}", dst)
    return out


def _send_shared(tensor: torch.Tensor, dst: int, group, state: _LinkState) -> _Send:
    op = current_op()
    out = _outgoing(op, group, dst)
    data = tensor.contiguous()  # kept alive by the pusher while it is pending
    address, nbytes = shm.address_of(data)
    seq, signature = (op.seq, op.signature) if op else (0, 0)
    text = op.introduce_to(dst) if op else b""

    def header(placed, first, length):
        offset, msg_id = placed
        intro = text if first == 0 else b""
        return shm.pack_header(
            departed, nbytes, offset, msg_id, seq, signature, first, length, intro
        )

    with out.lock:  # headers leave in the order their bytes were placed
        departed, last_byte = state.depart(nbytes)
        handle = _Send(_describe("send", tensor, "to", dst), last_byte)
        pusher = _pushers.get(id(out))
        placed = None if pusher is not None and pusher.queue else out.put(address, nbytes)
        if state.link.rendezvous:
            handle.taken = (out, placed[1] if placed is not None else None)
        if placed is not None:
            out.post(header(placed, 0, nbytes))
        else:  # no room now: queued behind what is pending, pushed as space frees
            handle.placed = threading.Event()
            _pushers.setdefault(id(out), _Pusher(out)).add(
                ((data, address, nbytes), 0, header, handle)
            )
    return handle
