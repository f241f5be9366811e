"""Point-to-point messages, optionally over an emulated link.

The kit's collectives are built from these four calls::

    send(tensor, dst)              recv(tensor, src)
    isend(tensor, dst) -> handle   irecv(tensor, src) -> handle

With no link they are torch.distributed's own (a pass-through). With a
:class:`Link` — ``ok.launch(fn, world_size=4, link=ok.Link(50, 1))`` — each
message also pays the link's cost, modelled like a NIC::

    sender's outgoing link   |== S/B ==|== S/B ==|          messages leave one after another
    receiver's incoming link       |== S/B ==|== S/B ==|    and arrive one after another
    message done at                            ... + α      (α: latency)

* a message of S bytes completes no earlier than α + S/B after it starts;
* messages leaving one rank share its outgoing link, messages arriving at a
  rank share its incoming link (N−1 senders into one root take (N−1)·S/B,
  while a ring step, one in and one out per rank, is never contended);
* waiting sleeps, so computation really runs while a message is "on the wire";
* the real bytes still move, concurrently with the emulated delay, so results
  stay real: through shared memory when the ranks share a machine (``ok.launch``;
  see :mod:`overlapkit.shm` — loopback sockets would be slower than the link
  being emulated), else through the process group.

Each message comes with a small header — through a named pipe next to the
shared memory, or through the process group — holding the sender's departure
time (on the machine's shared monotonic clock: the receiver needs it to know
when the message arrives), its size, and where its bytes are. Messages
between a pair of ranks match in order.
"""

from __future__ import annotations

import collections
import ctypes
import queue
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import shm

#: tag of the kit's messages, so they never match a learner's own dist.send/recv
KIT_TAG = 7171
#: tag of message bodies that travel through the process group under a link
KIT_DATA_TAG = KIT_TAG + 1


@dataclass(frozen=True)
class Link:
    """An emulated network link: latency in µs, bandwidth in GB/s (10⁹ bytes/s, as busbw)."""

    latency_us: float
    bandwidth_gbps: float

    def __post_init__(self):
        if not self.latency_us >= 0:
            raise ValueError(f"latency_us must be >= 0, got {self.latency_us!r}")
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"bandwidth_gbps must be > 0, got {self.bandwidth_gbps!r}")

    @property
    def alpha(self) -> float:
        """Latency in seconds."""
        return self.latency_us * 1e-6

    @property
    def beta(self) -> float:
        """Seconds per byte (1 / bandwidth)."""
        return 1.0 / (self.bandwidth_gbps * 1e9)

    def message_time(self, nbytes: int) -> float:
        return self.alpha + self.beta * nbytes

    def __str__(self) -> str:
        return f"Link({self.latency_us:g} µs, {self.bandwidth_gbps:g} GB/s)"


class _LinkState:
    """This rank's view of its link: when its outgoing and incoming sides are free."""

    def __init__(self, link: Link):
        self.link = link
        self.tx_free = 0.0
        self.rx_free = 0.0
        self.lock = threading.Lock()

    def depart(self, nbytes: int) -> tuple[float, float]:
        """Reserve the outgoing link: (departure time, time the last byte left)."""
        with self.lock:
            start = max(time.perf_counter(), self.tx_free)
            self.tx_free = start + nbytes * self.link.beta
            return start, self.tx_free

    def arrive(self, departed: float, nbytes: int) -> float:
        """Reserve the incoming link for a message that departed at ``departed``; done time."""
        with self.lock:
            start = max(departed, self.rx_free)
            self.rx_free = start + nbytes * self.link.beta
            return self.rx_free + self.link.alpha


_link: _LinkState | None = None
_channels: shm.Channels | None = None


def set_link(link: Link | None) -> None:
    """Use ``link`` for this rank's kit messages from now on (None: no emulation)."""
    global _link
    _link = _LinkState(link) if link is not None else None
    if link is not None:
        _precise_sleeps()


def _precise_sleeps() -> None:
    """Let this process's sleeps end within ~1 µs of their deadline instead of ~50 µs
    (Linux's default timer slack), so an emulated 50 µs latency is not 100 µs."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, in ns
        except (OSError, AttributeError):
            pass  # slower sleeps are a precision loss, not an error


def use_shared_memory(directory: str | None) -> None:
    """Move emulated messages' bytes through shared memory in ``directory`` (set by
    ``ok.launch``, whose ranks share one machine); None: through the process group."""
    global _channels
    _channels = shm.Channels(directory, dist.get_rank()) if directory else None


def current_link() -> Link | None:
    return _link.link if _link is not None else None


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)  # sleeping, not spinning: the cores stay free for compute


def _group_name(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


class _OnTheLink:
    """A message over the emulated link: once its done time is known, ``wait()``
    sleeps until then; ``is_completed()`` polls the same without blocking.

    Subclasses say how the done time becomes known: :meth:`_settle` blocks
    until it is, :meth:`_settled` tells without blocking.
    """

    _done_at = 0.0
    _slept = False

    def _settle(self) -> None:
        raise NotImplementedError

    def _settled(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout=None) -> bool:
        if not self._slept:
            self._settle()
            _sleep_until(self._done_at)
            self._slept = True
        return True

    def is_completed(self) -> bool:
        return self._slept or (self._settled() and time.perf_counter() >= self._done_at)


class _Handle(_OnTheLink):
    """A message being sent: done once its last byte has left the outgoing link."""

    def __init__(self, works, done_at: float):
        self._works = works
        self._done_at = done_at

    def _settle(self) -> None:
        for w in self._works:
            w.wait()

    def _settled(self) -> bool:
        return all(w.is_completed() for w in self._works)


def _shared_memory(tensor: torch.Tensor) -> bool:
    """Whether a message's bytes and header go through shared memory (else the group)."""
    return _channels is not None and tensor.device.type == "cpu"


def isend(tensor: torch.Tensor, dst: int, group=None):
    """Start sending ``tensor`` to global rank ``dst``; returns a handle with ``wait()``."""
    state = _link
    if state is None:
        return dist.isend(tensor, dst, group=group, tag=KIT_TAG)
    nbytes = tensor.numel() * tensor.element_size()
    if _shared_memory(tensor):
        out = _channels.outgoing(_group_name(group), dst)
        with out.lock:  # headers leave in the order their bytes were placed
            departed, last_byte = state.depart(nbytes)
            placed = out.put(tensor)
            works = []
            if placed is None:  # no room in the ring: the process group moves this one
                works.append(dist.isend(tensor, dst, group=group, tag=KIT_DATA_TAG))
            out.post(departed, nbytes, *(placed or (-1, 0)))
        return _Handle(works, last_byte)
    departed, last_byte = state.depart(nbytes)
    header = torch.tensor([departed, nbytes, -1, 0], dtype=torch.float64)
    works = [
        dist.isend(header.to(tensor.device), dst, group=group, tag=KIT_TAG),
        dist.isend(tensor, dst, group=group, tag=KIT_DATA_TAG),
    ]
    return _Handle(works, last_byte)


class _Inbox:
    """Messages from one sender in one group, landed in the order they were sent (so the
    shared-memory ring is freed in order, and the incoming link reserved in order).

    Through shared memory, a thread of the inbox lands them as their headers
    come in — like a NIC, it moves the bytes while the rank computes or waits
    for something else, whatever order the handles are waited in. Through the
    process group (GPU tensors, torchrun), they land in the thread that waits.
    """

    def __init__(self, incoming: shm.Incoming | None):
        self.lock = threading.Lock()
        self.pending: collections.deque = collections.deque()
        self.queue: queue.SimpleQueue | None = None
        if incoming is not None:
            self.queue = queue.SimpleQueue()
            name = "overlapkit-inbox"
            threading.Thread(
                target=self._land_in_order, args=(incoming,), name=name, daemon=True
            ).start()

    def post(self, receive: _Receive) -> None:
        if self.queue is not None:
            self.queue.put(receive)
            return
        with self.lock:  # header receives are matched in the order they are posted
            receive.post_to_group()
            self.pending.append(receive)

    def _land_in_order(self, incoming: shm.Incoming) -> None:
        while True:
            receive = self.queue.get()
            receive.land(incoming.read_header, incoming)

    def finish(self, receive: _Receive) -> None:
        """Return once ``receive`` has landed."""
        if self.queue is None:
            with self.lock:
                while not receive.landed.is_set():
                    head = self.pending.popleft()
                    head.land(head.header_from_group, None)
        receive.landed.wait()


_inboxes: dict = {}
_inboxes_lock = threading.Lock()


def _inbox(group_name: str, src: int, shared: bool) -> _Inbox:
    key = (group_name, src, shared)
    with _inboxes_lock:
        if key not in _inboxes:
            _inboxes[key] = _Inbox(_channels.incoming(group_name, src) if shared else None)
        return _inboxes[key]


class _Receive(_OnTheLink):
    """A message being received: done α after its last byte came in on the incoming link."""

    def __init__(self, tensor: torch.Tensor, src: int, group, state: _LinkState):
        self._tensor, self._src, self._group, self._state = tensor, src, group, state
        self.landed = threading.Event()
        self._error: BaseException | None = None
        self._data_work = None
        self._inbox = _inbox(_group_name(group), src, _shared_memory(tensor))
        self._inbox.post(self)

    def post_to_group(self) -> None:
        """Post the header's and the bytes' receives together: NCCL matches messages
        between two ranks in order and ignores tags."""
        self._header = torch.empty(4, dtype=torch.float64, device=self._tensor.device)
        self._header_work = dist.irecv(self._header, self._src, group=self._group, tag=KIT_TAG)
        self._data_work = dist.irecv(self._tensor, self._src, group=self._group, tag=KIT_DATA_TAG)

    def header_from_group(self) -> tuple:
        self._header_work.wait()
        return self._header.tolist()

    def land(self, read_header, incoming: shm.Incoming | None) -> None:
        """Header in; copy the bytes out (or receive them); reserve the incoming link."""
        try:
            departed, nbytes, offset, end = read_header()
            expected = self._tensor.numel() * self._tensor.element_size()
            if int(nbytes) != expected:
                raise RuntimeError(
                    f"rank {dist.get_rank()} posted a receive of {expected} bytes "
                    f"({tuple(self._tensor.shape)} {self._tensor.dtype}) from rank {self._src}, "
                    f"but rank {self._src} sent {int(nbytes)} bytes"
                )
            if offset >= 0:
                incoming.get(self._tensor, int(offset), int(end))
            elif self._data_work is not None:
                self._data_work.wait()
            else:  # too big for the shared ring: the sender sent it through the group
                dist.irecv(self._tensor, self._src, group=self._group, tag=KIT_DATA_TAG).wait()
            self._done_at = self._state.arrive(departed, expected)
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
            self._error = exc
        finally:
            self.landed.set()

    def _settle(self) -> None:
        self._inbox.finish(self)
        if self._error is not None:
            raise self._error

    def _settled(self) -> bool:
        if self.landed.is_set():
            return True
        if self._inbox.queue is not None or not self._header_work.is_completed():
            return False
        self._inbox.finish(self)  # through the group: its header is in, land it here
        return True


def irecv(tensor: torch.Tensor, src: int, group=None):
    """Start receiving into ``tensor`` from global rank ``src``; returns a handle."""
    if _link is None:
        return dist.irecv(tensor, src, group=group, tag=KIT_TAG)
    return _Receive(tensor, src, group, _link)


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    isend(tensor, dst, group).wait()


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    irecv(tensor, src, group).wait()


def wait_all(handles) -> None:
    for h in handles:
        h.wait()
