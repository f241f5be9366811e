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
* the real bytes still move through the process group, concurrently with the
  emulated delay, so results stay real.

To know when a message left, the receiver needs the sender's departure time:
a tiny header (one float64, on the shared monotonic clock of the machine)
travels before each message. Messages between a pair of ranks match in order.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: tag of the kit's messages, so they never match a learner's own dist.send/recv
KIT_TAG = 7171


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


def set_link(link: Link | None) -> None:
    """Use ``link`` for this rank's kit messages from now on (None: no emulation)."""
    global _link
    _link = _LinkState(link) if link is not None else None


def current_link() -> Link | None:
    return _link.link if _link is not None else None


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)  # sleeping, not spinning: the cores stay free for compute


def _header(device) -> torch.Tensor:
    return torch.empty(1, dtype=torch.float64, device=device)


class _Handle:
    """A message in flight over the emulated link: ``wait()`` and ``is_completed()``."""

    def __init__(self, works, ready):
        self._works = works
        self._ready = ready  # () -> the time the message completes, once known
        self._done = False

    def wait(self, timeout=None) -> bool:
        if not self._done:
            for w in self._works:
                w.wait()
            _sleep_until(self._ready())
            self._done = True
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if not all(w.is_completed() for w in self._works):
            return False
        return time.perf_counter() >= self._ready()


def isend(tensor: torch.Tensor, dst: int, group=None):
    """Start sending ``tensor`` to global rank ``dst``; returns a handle with ``wait()``."""
    state = _link
    if state is None:
        return dist.isend(tensor, dst, group=group, tag=KIT_TAG)
    nbytes = tensor.numel() * tensor.element_size()
    departed, last_byte = state.depart(nbytes)
    header = _header(tensor.device).fill_(departed)
    works = [
        dist.isend(header, dst, group=group, tag=KIT_TAG),
        dist.isend(tensor, dst, group=group, tag=KIT_TAG),
    ]
    return _Handle(works, lambda: last_byte)


def irecv(tensor: torch.Tensor, src: int, group=None):
    """Start receiving into ``tensor`` from global rank ``src``; returns a handle."""
    state = _link
    if state is None:
        return dist.irecv(tensor, src, group=group, tag=KIT_TAG)
    nbytes = tensor.numel() * tensor.element_size()
    header = _header(tensor.device)
    header_work = dist.irecv(header, src, group=group, tag=KIT_TAG)
    data_work = dist.irecv(tensor, src, group=group, tag=KIT_TAG)
    done_at = []

    def ready() -> float:
        # called only once both works are done (waiting twice on a gloo receive
        # blocks); reserves the incoming link once, from the sender's departure
        if not done_at:
            done_at.append(state.arrive(float(header.item()), nbytes))
        return done_at[0]

    return _Handle([header_work, data_work], ready)


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    isend(tensor, dst, group).wait()


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    irecv(tensor, src, group).wait()


def wait_all(handles) -> None:
    for h in handles:
        h.wait()
