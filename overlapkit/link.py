"""The emulated link: its α-β cost model, each rank's reservation of its outgoing and
incoming sides, and the pacing that makes a message's wait last what the link says.

A message of S bytes completes no earlier than α + S/B after it starts; messages leaving
one rank queue on its outgoing side, messages arriving at a rank on its incoming side
(see :mod:`overlapkit.p2p`). Waiting sleeps, so computation runs meanwhile, but for
the last few tens of µs, where the waiting thread yields in a loop.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """An emulated network link: latency in µs, bandwidth in GB/s (10⁹ bytes/s, as busbw)."""

    latency_us: float
    bandwidth_gbps: float
    #: a send is done only once the receiver has taken the message (as gloo's and MPI's
    #: large messages): two ranks that both send before receiving then deadlock, as they
    #: would on a real transport. False: sends are buffered (eager), as NCCL's are.
    rendezvous: bool = False

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
        mode = ", rendezvous" if self.rendezvous else ""
        return f"Link({self.latency_us:g} µs, {self.bandwidth_gbps:g} GB/s{mode})"


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


#: the path of messages that cost nothing on the emulated link (the kit's announcements)
_FREE = _LinkState(Link(0, 1e9))


def pace_precisely() -> None:
    """Make this process's waits on the link precise (called whenever a link is set):
    sleeps that end near their deadline, and how late they wake measured once."""
    global _wake_up_late
    _precise_sleeps()
    if not _wake_up_late:
        _wake_up_late = _measure_wake_up()


def _precise_sleeps() -> None:
    """Let this process's sleeps end within ~1 µs of their deadline instead of ~50 µs
    (Linux's default timer slack), so an emulated 50 µs latency is not 100 µs."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, in ns
        except (OSError, AttributeError):
            pass  # slower sleeps are a precision loss, not an error


#: how late this machine's sleeps wake up (measured by pace_precisely); waits sleep until that
#: long before their deadline, then yield until it, so an emulated α is not late by it
_wake_up_late = 0.0


def _measure_wake_up() -> float:
    late = []
    for _ in range(15):
        start = time.perf_counter()
        time.sleep(50e-6)
        late.append(time.perf_counter() - start - 50e-6)
    return min(sorted(late)[len(late) // 2] + 5e-6, 200e-6)


def _sleep_until(deadline: float, timeout_at: float | None = None) -> None:
    """Wait until ``deadline``: asleep (the cores stay free for compute) but for the
    last few tens of µs, where the thread yields in a loop (the GIL stays free)."""
    end = deadline if timeout_at is None else min(deadline, timeout_at)
    delay = end - time.perf_counter()
    if delay > _wake_up_late:
        time.sleep(delay - _wake_up_late)
    while time.perf_counter() < end:
        time.sleep(0)
