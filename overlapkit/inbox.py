"""The receive side of the emulated link: a receive matches the messages from its sender
in its stream and group in the order they were posted (as NCCL matches, and whatever
tags say), and lands each one, checked against what it expects, in that order, so the
incoming link is reserved in order.

Messages through shared memory land from a channel (:class:`_SharedInbox`, which moves
bytes while the rank computes, as a NIC does); messages through a process group (GPU
tensors, torchrun) from a pair of posted receives, the header's and the bytes'
(:class:`_Inbox`).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time

import torch
import torch.distributed as dist

from . import shm, shmlink
from .groups import KIT, KIT_DATA_TAG, KIT_TAG, USER, _group_name, _pg_recv
from .kitops import _mismatch, current_op, running
from .link import _LinkState
from .messages import _GROUP_HEADER, _read_group_header
from .transfers import _describe, _OnTheLink, _wait_works


class _Inbox:
    """Messages from one sender in one stream and group through a process group
    (GPU tensors, torchrun), landed in the order they were sent, by the thread
    that waits (so the incoming link is reserved in order)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pending: collections.deque = collections.deque()
        self.posted = self.mark = 0

    def post(self, receive: _Receive) -> None:
        with self.lock:  # header receives are matched in the order they are posted
            self.posted += 1
            receive.index = self.posted - self.mark
            receive.post_to_group()
            self.pending.append(receive)

    def finish(self, receive: _Receive, timeout_at: float | None) -> None:
        """Return once ``receive`` has landed."""
        with self.lock:
            while not receive.landed.is_set():
                head = self.pending[0]
                head.land_from_group(timeout_at)
                self.pending.popleft()

    def progress(self, receive: _Receive) -> None:
        if receive.landed.is_set() or not receive._header_work.is_completed():
            return
        with contextlib.suppress(TimeoutError):
            self.finish(receive, time.perf_counter() + 1e-3)


#: receives this large are landed by the inbox's thread as soon as they arrive, so that
#: the copy overlaps with the rank's compute; smaller ones land when waited (or polled)
EAGER_BYTES = 64 << 10


def _left(timeout_at: float) -> float:
    return max(0.0, timeout_at - time.perf_counter())


class _SharedInbox:
    """Messages from one sender in one stream and group through shared memory,
    landed segment by segment in the order they were sent (so the channel is
    freed in order, and the incoming link reserved in order).

    Like a NIC, the inbox moves bytes while the rank computes: its thread lands
    whatever has arrived for the receives posted, once one of them is large
    enough for the copy to matter (:data:`EAGER_BYTES`). But a thread that waits
    for a receive lands the messages itself as their headers come in — one
    wake-up per message on the critical path, not a hand-over between two
    threads (which costs more than copying a small message at ``wait()``).
    """

    def __init__(self, incoming: shm.Incoming):
        self.incoming = incoming
        self.lock = threading.Lock()  # held while landing: one lander at a time, in order
        self.cond = threading.Condition()  # guards pending and waiters
        self.pending: collections.deque = collections.deque()
        self.waiters = 0
        self.posted = self.mark = 0
        self.eager = 0  # pending receives of at least EAGER_BYTES
        threading.Thread(target=self._background, name="overlapkit-inbox", daemon=True).start()

    def post(self, receive: _Receive) -> None:
        with self.cond:
            self.posted += 1
            receive.index = self.posted - self.mark
            self.pending.append(receive)
            if receive.eager:
                self.eager += 1
                self.cond.notify()

    def _land_arrived(self) -> None:
        """Land what has arrived for the receives posted, in order (``lock`` held)."""
        while True:
            with self.cond:
                if not self.pending:
                    return
                head = self.pending[0]
            header = self.incoming.read_header()
            if header is None:
                return
            if head.land_segment(self.incoming, header):
                with self.cond:
                    self.pending.popleft()
                    self.eager -= head.eager

    def progress(self, receive: _Receive | None = None) -> None:
        """Land what has arrived, unless another thread is landing: never blocks."""
        if self.lock.acquire(blocking=False):
            try:
                self._land_arrived()
            finally:
                self.lock.release()

    def finish(self, receive: _Receive, timeout_at: float | None) -> None:
        """Return once ``receive`` has landed (landing it here when its header comes).

        The waiter holds ``lock`` while it sleeps on the pipe, so no other thread
        can take a header from under it (and leave it asleep with the pipe empty).
        """
        with self.cond:
            self.waiters += 1
        try:
            if not self.lock.acquire(timeout=-1 if timeout_at is None else _left(timeout_at)):
                raise TimeoutError(f"{receive.what}: nothing arrived before wait(timeout=) ran out")
            try:
                while True:
                    self._land_arrived()
                    if receive.landed.is_set():
                        return
                    remaining = None if timeout_at is None else _left(timeout_at)
                    if remaining == 0:
                        raise TimeoutError(
                            f"{receive.what}: nothing arrived before wait(timeout=) ran out"
                        )
                    self.incoming.poll(remaining)
            finally:
                self.lock.release()
        finally:
            with self.cond:
                self.waiters -= 1
                self.cond.notify()

    def _background(self) -> None:
        while True:
            with self.cond:  # idle unless a large receive is posted and nobody waits
                self.cond.wait_for(lambda: self.eager and self.waiters == 0)
            self.incoming.poll(0.05)  # bounded: a waiter that arrives meanwhile takes over
            self.progress()


_inboxes: dict = {}
_inboxes_lock = threading.Lock()
_ends: dict = {}  # (stream, group, peer, shared?) -> inbox: a hot lookup


def _inbox(namespace: str, src: int, shared: bool) -> _Inbox | _SharedInbox:
    key = (namespace, src, shared)
    with _inboxes_lock:
        if key not in _inboxes:
            incoming = shmlink._channels.incoming(namespace, src) if shared else None
            _inboxes[key] = _SharedInbox(incoming) if shared else _Inbox()
        return _inboxes[key]


_SINCE = ""  # ", since ..." once mark_messages() was called


def mark_messages(since: str) -> None:
    """Count received messages from here on (errors say "the 3rd message ... {since}")."""
    global _SINCE
    _SINCE = f" {since}"
    with _inboxes_lock:
        for inbox in _inboxes.values():
            inbox.mark = inbox.posted


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class _Receive(_OnTheLink):
    """A message being received: done α after its last byte came in on the incoming link."""

    def __init__(self, tensor: torch.Tensor, src: int, group, state: _LinkState):
        super().__init__(_describe("receive", tensor, "from", src))
        self._tensor, self._src, self._group, self._state = tensor, src, group, state
        self._op = current_op()
        self.landed = threading.Event()
        self._error: BaseException | None = None
        # under a rendezvous link a sender waits for its receiver to take the message, so
        # every posted receive must land on its own, as on a real transport
        self.eager = state.link.rendezvous or tensor.numel() * tensor.element_size() >= EAGER_BYTES
        key = (self._op is None, group, src, shmlink._shared_memory(tensor))
        inbox = _ends.get(key)
        if inbox is None:
            namespace = f"{KIT if self._op else USER}-{_group_name(group)}"
            inbox = _ends[key] = _inbox(namespace, src, key[-1])
        self._inbox = inbox
        inbox.post(self)

    def _expected(self) -> int:
        return self._tensor.numel() * self._tensor.element_size()

    def _check(self, nbytes: int, seq: int, signature: int, description: str = "") -> None:
        op = self._op
        if op is not None and op.check and (seq, signature) != (op.seq, op.signature):
            raise _mismatch(op, self._src, seq, signature, description)
        if nbytes != self._expected():
            t = self._tensor
            raise RuntimeError(
                f"rank {dist.get_rank()} posted a receive of {self._expected()} bytes "
                f"({tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}) from rank "
                f"{self._src} (the {_ordinal(self.index)} message it receives from rank "
                f"{self._src}{_SINCE}), but rank {self._src} sent {nbytes} bytes."
            )

    def land_segment(self, incoming: shm.Incoming, header: tuple) -> bool:
        """Copy one segment out and free it; True once the whole message has landed."""
        departed, nbytes, offset, msg_id, seq, signature, first, length, text = header
        try:
            if first == 0:
                self._check(nbytes, seq, signature, text)
                t = self._tensor  # a non-contiguous receive lands in a contiguous buffer
                self._buf = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype)
                self._got = 0
            incoming.copy_out(self._buf.data_ptr() + first, length, offset)
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
            self._error = exc
        finally:
            incoming.free(msg_id)
        if self._error is None:
            self._got += length
            if self._got < nbytes:
                return False
            if self._buf is not self._tensor:
                self._tensor.copy_(self._buf)
            self._done_at = self._state.arrive(departed, nbytes)
        self.landed.set()
        return True

    def post_to_group(self) -> None:
        """Post the header's and the bytes' receives together: NCCL matches messages
        between two ranks in order and ignores tags."""
        t = self._tensor
        self._buf = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
        self._header = torch.empty(_GROUP_HEADER, dtype=torch.float64, device=t.device)
        self._header_work = _pg_recv_as(self._op, self._header, self._src, self._group, KIT_TAG)
        self._data_work = _pg_recv_as(self._op, self._buf, self._src, self._group, KIT_DATA_TAG)

    def land_from_group(self, timeout_at) -> None:
        try:
            _wait_works([self._header_work], timeout_at, self)
            departed, nbytes, seq, signature = _read_group_header(self._header)
            self._check(int(nbytes), int(seq), int(signature))
            _wait_works([self._data_work], timeout_at, self)
            if self._buf is not self._tensor:
                self._tensor.copy_(self._buf)
            self._done_at = self._state.arrive(departed, int(nbytes))
        except TimeoutError:
            raise  # not landed: a later wait may still land it
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
            self._error = exc
        self.landed.set()

    def _through(self, timeout_at) -> None:
        self._inbox.finish(self, timeout_at)
        if self._error is not None:
            raise self._error

    def _through_yet(self) -> bool:
        if not self.landed.is_set():
            self._inbox.progress(self)
        return self.landed.is_set()


def _pg_recv_as(op, tensor, src, group, tag):
    with running(op):  # the inbox thread posts on behalf of the op's thread
        return _pg_recv(tensor, src, group, tag)
