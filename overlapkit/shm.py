"""Shared-memory channels: the data path of the emulated link between ranks on one machine.

The emulated link (:mod:`overlapkit.p2p`) must never be slower than the link
it pretends to be. Gloo's loopback sockets are: on a 2-core laptop two ranks
swapping 4 MiB both ways get about 0.8 GB/s each way, less than a 1 GB/s link,
and a small message takes 150–300 µs, more than a 50 µs latency. Ranks started
by ``ok.launch`` share one machine, so each direction between two ranks gets

* a ring buffer in a file under ``/dev/shm`` for the bytes (memcpy speed), and
* a named pipe for the headers (wakes the receiver in a few µs)::

    sender ──copy──► [ ....|msg 3|msg 4|.......... ] ──copy──► receiver
                            ▲head        ▲tail
                      (receiver moves)  (sender moves)
    sender ──header (departure time, size, where)──► pipe ──► receiver

* the sender appends a message at ``tail`` and then writes its header; the
  receiver reads the header (so the bytes are already there), copies the
  message out and advances ``head``, which lives in the shared file;
* a message that does not fit the free space is not waited for (a sender that
  blocks until its receiver drains could deadlock two ranks sending to each
  other): the caller sends it through the process group instead;
* when the ring is empty the sender starts again at offset 0, so the pages
  touched are only as many as the bytes ever in flight at once.

The receiver unlinks both files once it has read a first header (both ends
have them open by then); the launcher removes the directory in any case.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading

import torch

#: bytes of a channel's ring (virtual: tmpfs only keeps the pages ever touched)
CAPACITY = 256 << 20
_CONTROL = 64  # the first bytes of the ring file: head counter (int64), then padding
#: a header: departure time, message bytes, offset in the ring (−1: not in the ring), end counter
HEADER = struct.Struct("<dqqq")


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype, 0-d included)."""
    return tensor.reshape(-1).view(torch.uint8)


def _open_pipe(path: str) -> int:
    try:
        os.mkfifo(path, 0o600)
    except FileExistsError:  # the other end made it first
        pass
    # read-write: opening never blocks for the other end (Linux), and a reader never sees EOF
    fd = os.open(path, os.O_RDWR)
    try:  # room for many headers in flight before a sender would block
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except OSError:
        pass
    return fd


class _Ring:
    """The mapped ring file: ``head`` (shared counter) and ``data``."""

    def __init__(self, path: str, create: bool):
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, _CONTROL + CAPACITY)
            self._map = mmap.mmap(fd, _CONTROL + CAPACITY)
        finally:
            os.close(fd)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        self.head = whole[:8].view(torch.int64)  # written by the receiver only
        self.data = whole[_CONTROL:]

    def span(self, offset: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ring's n bytes from ``offset``, as two views: up to the end, then from 0."""
        first = min(n, CAPACITY - offset)
        return self.data[offset : offset + first], self.data[: n - first]


class Outgoing:
    """The sending end of one direction. Counters are absolute byte counts: ``tail``
    (private) ends everything sent, ``head`` (shared) everything copied out."""

    def __init__(self, path: str):
        self._ring = _Ring(path, create=True)
        self._pipe = _open_pipe(path + ".pipe")
        self._tail = 0
        self._write_at = 0
        #: held from placing the bytes to writing the header: headers go in placement order
        self.lock = threading.Lock()

    def put(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """Copy ``tensor``'s bytes in: (offset, end counter), or None when there is no room."""
        src = byte_view(tensor.contiguous())
        n = src.numel()
        in_flight = self._tail - int(self._ring.head.item())
        if in_flight == 0:
            self._write_at = 0  # drained: reuse the pages already touched
        if n > CAPACITY - in_flight:
            return None
        offset = self._write_at
        head, tail = self._ring.span(offset, n)  # the message may wrap around the end
        head.copy_(src[: head.numel()])
        tail.copy_(src[head.numel() :])
        self._write_at = (offset + n) % CAPACITY
        self._tail += n
        return offset, self._tail

    def post(self, departed: float, nbytes: int, offset: int, end: int) -> None:
        """Write a header (atomic: far below PIPE_BUF)."""
        os.write(self._pipe, HEADER.pack(departed, nbytes, offset, end))


class Incoming:
    """The receiving end of one direction; read by one thread, in order."""

    def __init__(self, path: str):
        self._path = path
        self._pipe = _open_pipe(path + ".pipe")
        self._ring: _Ring | None = None

    def read_header(self) -> tuple[float, int, int, int]:
        """Block (GIL released) until the next header is in: departed, nbytes, offset, end."""
        raw = b""
        while len(raw) < HEADER.size:
            raw += os.read(self._pipe, HEADER.size - len(raw))
        if self._ring is None:  # the sender made both files before its first header
            self._ring = _Ring(self._path, create=False)
            for path in (self._path, self._path + ".pipe"):
                os.unlink(path)  # both ends hold them open: nothing left behind on a crash
        return HEADER.unpack(raw)

    def get(self, into: torch.Tensor, offset: int, end: int) -> None:
        """Copy a message out into ``into`` and free its space."""
        contiguous = into.is_contiguous()
        target = into if contiguous else torch.empty(into.shape, dtype=into.dtype)
        dst = byte_view(target)
        head, tail = self._ring.span(offset, dst.numel())
        dst[: head.numel()].copy_(head)
        dst[head.numel() :].copy_(tail)
        if not contiguous:
            into.copy_(target)
        self._ring.head.fill_(end)  # one aligned 8-byte store: the sender sees old or new


class Channels:
    """This rank's channels by (process group, peer), made on first use."""

    def __init__(self, directory: str, rank: int):
        self._dir = directory
        self._rank = rank
        self._made: dict = {}
        self._lock = threading.Lock()

    def _get(self, cls, group_name: str, src: int, dst: int):
        key = (cls, group_name, src, dst)
        with self._lock:
            if key not in self._made:
                self._made[key] = cls(os.path.join(self._dir, f"g{group_name}-{src}-{dst}"))
            return self._made[key]

    def outgoing(self, group_name: str, dst: int) -> Outgoing:
        return self._get(Outgoing, group_name, self._rank, dst)

    def incoming(self, group_name: str, src: int) -> Incoming:
        return self._get(Incoming, group_name, src, self._rank)
