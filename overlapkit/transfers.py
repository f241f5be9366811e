"""The handle of one message in transit: what ``wait(timeout=)`` and ``is_completed()``
do for each way a message travels (through a process group as is, staged through the
host, or over the emulated link, where it is done when the link says).

Every handle is honest: ``wait(timeout=)`` honours its timeout (TimeoutError), a failure
is raised by ``wait()``, and a handle never waited is reported (:mod:`overlapkit.handles`).
"""

from __future__ import annotations

import time

import torch

from . import handles
from .kitops import current_op
from .link import _sleep_until


class _Message(handles.Tracked):
    """A handle of one message. ``wait(timeout=)`` raises TimeoutError after
    ``timeout`` seconds; a failure is raised by ``wait()``."""

    def __init__(self, what):
        self._op = current_op()
        super().__init__(what, kit=self._op is not None)

    def _settle(self, timeout_at: float | None) -> None:
        """Block until the message is through (or raise TimeoutError at ``timeout_at``)."""
        raise NotImplementedError

    def _finished(self) -> bool:
        raise NotImplementedError

    def _wait(self, timeout_at):
        if self._op is not None and self._op.announcements:
            self._op.check_announcements()  # before any of the op's data is trusted
        self._settle(timeout_at)

    def is_completed(self) -> bool:
        return self._finished()


def _poll_until(done, timeout_at: float | None, handle) -> None:
    """Wait for ``done()`` by polling (sleeps up to 1 ms), or raise TimeoutError."""
    pause = 20e-6
    while not done():
        if timeout_at is not None and time.perf_counter() >= timeout_at:
            raise TimeoutError(f"{handle.what}: not complete when wait(timeout=) ran out")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def _wait_works(works, timeout_at: float | None, handle) -> None:
    if timeout_at is None:
        for w in works:
            w.wait()
    else:
        _poll_until(lambda: all(w.is_completed() for w in works), timeout_at, handle)


class _Plain(_Message):
    """A message through a process group without a link; a non-contiguous receive
    lands in a contiguous buffer first (``finish`` copies it into place)."""

    def __init__(self, works, describe, finish=None):
        super().__init__(describe)
        self._works, self._finish = works, finish

    def _settle(self, timeout_at):
        _wait_works(self._works, timeout_at, self)
        if self._finish is not None:
            self._finish()
            self._finish = None

    def _finished(self) -> bool:
        return all(w.is_completed() for w in self._works)


class _Landed(_Message):
    """A receive of a CUDA tensor through a backend that moves CPU tensors only: the
    message lands in ``host`` (through ``inner``), then is copied into ``tensor``."""

    def __init__(self, inner: _Message, host: torch.Tensor, tensor: torch.Tensor):
        super().__init__(inner._what)
        inner._mark_waited()  # waited through this handle
        self._inner, self._host, self._tensor = inner, host, tensor

    def _wait(self, timeout_at):
        self._inner._wait(timeout_at)
        if self._host is not None:
            self._tensor.copy_(self._host)
            self._host = None

    def _finished(self) -> bool:
        return self._inner.is_completed()


class _OnTheLink(_Message):
    """A message over the emulated link: once its done time is known, ``wait()``
    sleeps until then; ``is_completed()`` polls the same without blocking."""

    _done_at = 0.0

    def _through(self, timeout_at) -> None:
        raise NotImplementedError

    def _through_yet(self) -> bool:
        raise NotImplementedError

    def _settle(self, timeout_at):
        self._through(timeout_at)
        _sleep_until(self._done_at, timeout_at)
        if time.perf_counter() < self._done_at:
            raise TimeoutError(f"{self.what}: still on the link when wait(timeout=) ran out")

    def _finished(self) -> bool:
        return self._through_yet() and time.perf_counter() >= self._done_at


class _Send(_OnTheLink):
    """A message being sent: done once its bytes are placed and its last byte left
    the outgoing link."""

    def __init__(self, describe, done_at: float, works=(), placed=None):
        super().__init__(describe)
        self._works, self._done_at = list(works), done_at
        self.placed = placed  # set when the bytes are all in shared memory
        #: under a rendezvous link: (channel, id of the message's last segment)
        self.taken: tuple | None = None

    def _through(self, timeout_at):
        if self.placed is not None:
            remaining = None if timeout_at is None else timeout_at - time.perf_counter()
            if not self.placed.wait(remaining):
                raise TimeoutError(f"{self.what}: the receiver has not made room for it yet")
        if self.taken is not None:
            _poll_until(self._taken, timeout_at, self)
        _wait_works(self._works, timeout_at, self)

    def _taken(self) -> bool:
        out, last = self.taken
        return last is not None and out.taken_up_to() >= last

    def _through_yet(self) -> bool:
        placed = self.placed is None or self.placed.is_set()
        taken = self.taken is None or self._taken()
        return placed and taken and all(w.is_completed() for w in self._works)


def _describe(kind: str, tensor: torch.Tensor, peer_word: str, peer: int):
    """The text that names a message in errors, made only when one is needed."""
    op, shape, dtype = current_op(), tensor.shape, tensor.dtype

    def text():
        where = f" in {op.description.split(',')[0]}" if op is not None else ""
        kind_of = f"{kind} of {tuple(shape)} {str(dtype).removeprefix('torch.')}"
        return f"{kind_of} {peer_word} rank {peer}{where}"

    return text
