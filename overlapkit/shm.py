"""Shared-memory channels: the data path of the emulated link between ranks on one machine.

The emulated link (:mod:`overlapkit.p2p`) must never be slower than the link
it pretends to be. Gloo's loopback sockets are: on a 2-core laptop two ranks
swapping 4 MiB both ways get about 0.8 GB/s each way, less than a 1 GB/s link,
and a small message takes 150–300 µs, more than a 50 µs latency. Ranks started
by ``ok.launch`` share one machine, so each direction between two ranks gets

* a file under ``/dev/shm`` for the bytes (memcpy speed), and
* a named pipe for the headers (wakes the receiver in a few µs)::

    sender ──copy──► [ msg 5 |....| msg 3 | msg 4 |....... ] ──copy──► receiver
    sender ──header (departure, size, where, op #, op signature)──► pipe ──► receiver

* the sender places a message in the lowest free space that holds it, copies
  it in, then writes its header; the receiver reads the header (so the bytes
  are already there), copies the message out and counts it as freed in the
  file's first word. Messages are freed in the order they were sent;
* lowest-free-space placement keeps the pages touched close to the bytes in
  flight; pages are reserved (``posix_fallocate``) before they are first
  written, so a full ``/dev/shm`` is a refusal, never a SIGBUS; a channel
  that has been drained and idle for a moment gives its pages back, so a
  small ``/dev/shm`` (64 MiB in many containers) is shared by whoever is
  sending now;
* nothing here ever blocks a sender: a message that finds no room is refused
  (the caller queues it, and :mod:`overlapkit.p2p` pushes it in segment by
  segment as the receiver frees space), and a header that finds the pipe full
  waits in a backlog that a helper thread writes out, in order, without
  holding the channel's lock.

The receiver unlinks both files once it has read a first header (both ends
have them open by then); the launcher removes the directory in any case.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import mmap
import os
import select
import struct
import threading
import time
import weakref

import torch

#: bytes a channel may span (virtual: tmpfs keeps only the pages reserved as used)
CAPACITY = 256 << 20
_CONTROL = 64  # the first bytes of the file: messages freed (int64), then padding
_WORD = struct.Struct("<q")
_RESERVE_STEP = 1 << 20  # pages are reserved in steps of this many bytes
#: a channel drained for this long gives back its pages beyond the first step
IDLE_RELEASE_S = 0.2
#: a header: departure time, message bytes, offset of this segment in the file, segment
#: id, op number, op signature, the segment's first byte in the message and its length,
#: then the length of the op's description that follows (on an op's first message only)
HEADER = struct.Struct("<dqqqqqqqI")
#: header + description stay within PIPE_BUF, so a header is one atomic write (a partial
#: one would tear the stream): 4096 bytes on Linux, only 512 on macOS
MAX_DESCRIPTION = min(1024, getattr(select, "PIPE_BUF", 512) - HEADER.size)


def address_of(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of a contiguous CPU tensor's data (any dtype, 0-d included)."""
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


#: sizes to ask for a header pipe, in order of preference (the system may refuse them all)
PIPE_SIZES = (1 << 20, 1 << 16)


def _open_pipe(path: str, nonblocking: bool) -> int:
    try:
        os.mkfifo(path, 0o600)
    except FileExistsError:  # the other end made it first
        pass
    # read-write: opening never blocks for the other end (Linux), and a reader never sees EOF
    fd = os.open(path, os.O_RDWR | (os.O_NONBLOCK if nonblocking else 0))
    for size in PIPE_SIZES:  # room for many headers; a refusal only means a backlog
        try:
            fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)
            break
        except OSError:
            continue
    return fd


class _File:
    """The mapped channel file: ``freed`` (shared counter of messages copied out) and ``data``."""

    def __init__(self, path: str, create: bool):
        self.fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        if create:
            os.ftruncate(self.fd, _CONTROL + CAPACITY)
            _reserve_first_page(self.fd, path)
        self._map = mmap.mmap(self.fd, _CONTROL + CAPACITY)
        # copies go by address (ctypes.memmove releases the GIL): a torch op per message
        # costs more than the copy of a small one
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.data = ctypes.addressof(self._anchor) + _CONTROL

    # the first word counts the segments copied out: written by the receiver only, in one
    # aligned 8-byte store, so the sender reads the old value or the new one
    def freed(self) -> int:
        return _WORD.unpack_from(self._map, 0)[0]

    def set_freed(self, msg_id: int) -> None:
        _WORD.pack_into(self._map, 0, msg_id)


def _allocate(fd: int, offset: int, length: int) -> None:
    """Back ``length`` bytes of the file at ``offset`` with pages now (OSError, ENOSPC, when
    the file system is full), so that a write through the mapping never meets a full one
    (SIGBUS). ``os.posix_fallocate`` where the system has it (Linux); macOS has none: write
    zeros there, as glibc's posix_fallocate does on a file system without fallocate (only
    bytes not yet written are ever reserved, so no message is overwritten)."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, offset, length)
        return
    end = offset + length
    zeros = bytes(min(length, _RESERVE_STEP))
    while offset < end:
        offset += os.pwrite(fd, zeros[: end - offset], offset)


def _reserve_first_page(fd: int, path: str, patience_s: float = 5.0) -> None:
    """Reserve the control block; on a full file system, wait a little for idle
    channels (of this rank or others) to give their pages back."""
    end = time.monotonic() + patience_s
    while True:
        try:
            _allocate(fd, 0, _CONTROL)
            return
        except OSError as exc:
            if time.monotonic() > end:
                raise OSError(
                    exc.errno,
                    f"no room left in {os.path.dirname(path)} for the emulated link's "
                    "channels; free some, or point OVERLAPKIT_SHM_DIR at a larger tmpfs",
                ) from exc
            time.sleep(0.05)


class _Placement:
    """Where messages in flight lie, as runs of address-contiguous messages in send order.

    Messages are freed oldest first, so the oldest run shrinks from its front;
    a new message extends the newest run when the space after it is the lowest
    that fits, else it starts a new run there. Placing at the lowest free
    address keeps the touched span near the bytes in flight.
    """

    def __init__(self):
        self.runs: collections.deque = collections.deque()  # [start, end, deque[(id, end)]]

    def free_up_to(self, freed_id: int) -> None:
        while self.runs:
            run = self.runs[0]
            while run[2] and run[2][0][0] <= freed_id:
                _, end = run[2].popleft()
                run[0] = end
            if run[2]:
                return
            self.runs.popleft()

    def place(self, n: int, capacity: int) -> int | None:
        """The lowest offset with ``n`` free bytes, or None."""
        at = 0
        for start, end, _ in sorted(self.runs, key=lambda r: r[0]):
            if start - at >= n:
                return at
            at = max(at, end)
        return at if capacity - at >= n else None

    def add(self, msg_id: int, offset: int, n: int) -> None:
        if self.runs and self.runs[-1][1] == offset:
            self.runs[-1][1] = offset + n
            self.runs[-1][2].append((msg_id, offset + n))
        else:
            self.runs.append([offset, offset + n, collections.deque([(msg_id, offset + n)])])

    @property
    def in_flight(self) -> int:
        return sum(end - start for start, end, _ in self.runs)


class Outgoing:
    """The sending end of one direction."""

    def __init__(self, path: str):
        self._file = _File(path, create=True)
        self.pipe_path = path + ".pipe"
        self._pipe = _open_pipe(self.pipe_path, nonblocking=True)
        self.posted = False  # a header went in (or waits in the backlog)
        self._placement = _Placement()
        self._sent = 0  # ids of messages placed in the file so far
        self.reserved = _CONTROL  # bytes of the file backed by reserved pages
        self.peak_in_flight = 0
        self._backlog: collections.deque = collections.deque()  # headers the pipe had no room for
        self._flushing = False
        self._last_put = time.monotonic()
        #: held from placing the bytes to posting the header: headers go in placement order
        self.lock = threading.Lock()
        _janitor.watch(self)

    def put(self, address: int, n: int) -> tuple[int, int] | None:
        """Copy ``n`` bytes from ``address`` in: (offset, segment id), or None when there
        is no room."""
        self._placement.free_up_to(self._file.freed())
        offset = self._placement.place(n, CAPACITY)
        if offset is None or not self._reserve(_CONTROL + offset + n):
            return None
        ctypes.memmove(self._file.data + offset, address, n)
        self._last_put = time.monotonic()
        self._sent += 1
        self._placement.add(self._sent, offset, n)
        self.peak_in_flight = max(self.peak_in_flight, self._placement.in_flight)
        return offset, self._sent

    def _reserve(self, upto: int) -> bool:
        """Back the file with pages up to ``upto`` bytes; False when the file system is full."""
        if upto <= self.reserved:
            return True
        target = min(_CONTROL + CAPACITY, -(-upto // _RESERVE_STEP) * _RESERVE_STEP)
        try:
            _allocate(self._file.fd, self.reserved, target - self.reserved)
        except OSError:  # ENOSPC on a small /dev/shm: refuse, the group carries it
            return False
        self.reserved = target
        return True

    def taken_up_to(self) -> int:
        """The id of the last segment the receiver has copied out."""
        return self._file.freed()

    def release_if_idle(self, now: float) -> None:
        """Give back the pages beyond the first step once drained and idle for a moment."""
        if self.reserved <= _RESERVE_STEP or now - self._last_put < IDLE_RELEASE_S:
            return
        with self.lock:
            if self._file.freed() != self._sent or self.reserved <= _RESERVE_STEP:
                return
            self._placement.free_up_to(self._sent)
            try:
                self._file._map.madvise(
                    mmap.MADV_REMOVE, _RESERVE_STEP, self.reserved - _RESERVE_STEP
                )
            except (OSError, AttributeError, ValueError):
                return  # not tmpfs, or no MADV_REMOVE here: keep the pages
            self.reserved = _RESERVE_STEP

    def post(self, header: bytes) -> None:
        """Queue a header behind the ones before it; never blocks (call with ``lock`` held)."""
        self.posted = True
        if not self._backlog:
            try:
                os.write(self._pipe, header)  # atomic: far below PIPE_BUF
                return
            except BlockingIOError:
                pass
        self._backlog.append(header)
        if not self._flushing:
            self._flushing = True
            threading.Thread(target=self._flush, name="overlapkit-headers", daemon=True).start()

    def _flush(self) -> None:
        """Write the backlog out in order, waiting for room without holding ``lock``."""
        poller = select.poll()
        poller.register(self._pipe, select.POLLOUT)
        while True:
            with self.lock:
                if not self._backlog:
                    self._flushing = False
                    return
                header = self._backlog[0]
            poller.poll(100)
            try:
                os.write(self._pipe, header)
            except BlockingIOError:
                continue
            with self.lock:
                self._backlog.popleft()


class _Janitor:
    """One thread per process that lets idle channels give their pages back."""

    def __init__(self):
        self._channels: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self._started = False

    def watch(self, channel: Outgoing) -> None:
        with self._lock:
            self._channels.add(channel)
            if not self._started:
                self._started = True
                threading.Thread(target=self._run, name="overlapkit-janitor", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(IDLE_RELEASE_S / 2)
            with self._lock:
                channels = list(self._channels)
            now = time.monotonic()
            for channel in channels:
                channel.release_if_idle(now)


_janitor = _Janitor()


def pack_header(departed, nbytes, offset, msg_id, seq, signature, first, length, text=b""):
    text = text[:MAX_DESCRIPTION]
    fields = (departed, nbytes, offset, msg_id, seq, signature, first, length, len(text))
    return HEADER.pack(*fields) + text


class Incoming:
    """The receiving end of one direction; read in order, by one thread at a time."""

    def __init__(self, path: str):
        self._path = path
        self._pipe = _open_pipe(path + ".pipe", nonblocking=True)
        self._file: _File | None = None

    def poll(self, timeout_s: float | None) -> None:
        """Sleep (GIL released) until a header may be in, or ``timeout_s`` passes."""
        poller = select.poll()  # one per call: two threads may wait on one channel
        poller.register(self._pipe, select.POLLIN)
        poller.poll(None if timeout_s is None else max(0, int(timeout_s * 1000) + 1))

    def read_header(self) -> tuple | None:
        """The next header, or None when none is in yet: (departed, nbytes, offset,
        segment id, op number, op signature, first byte, length, description)."""
        try:
            raw = os.read(self._pipe, HEADER.size)
        except BlockingIOError:
            return None
        # a header and its description were written at once (below PIPE_BUF): all here
        *fields, n = HEADER.unpack(raw)
        fields.append(os.read(self._pipe, n).decode("utf-8", "replace") if n else "")
        if self._file is None:  # the sender made both files before its first header
            self._file = _File(self._path, create=False)
            for path in (self._path, self._path + ".pipe"):
                os.unlink(path)  # both ends hold them open: nothing left behind on a crash
        return fields

    def copy_out(self, address: int, n: int, offset: int) -> None:
        """Copy a segment's ``n`` bytes out to ``address``."""
        ctypes.memmove(address, self._file.data + offset, n)

    def free(self, msg_id: int) -> None:
        """Count segments up to ``msg_id`` as copied out (one aligned 8-byte store)."""
        self._file.set_freed(msg_id)


class Channels:
    """This rank's channels by (namespace, peer), made on first use."""

    def __init__(self, directory: str, rank: int):
        self._dir = directory
        self._rank = rank
        self._made: dict = {}
        self._lock = threading.Lock()

    def _get(self, cls, namespace: str, src: int, dst: int):
        key = (cls, namespace, src, dst)
        with self._lock:
            if key not in self._made:
                self._made[key] = cls(os.path.join(self._dir, f"{namespace}-{src}-{dst}"))
            return self._made[key]

    def outgoing(self, namespace: str, dst: int) -> Outgoing:
        return self._get(Outgoing, namespace, self._rank, dst)

    def incoming(self, namespace: str, src: int) -> Incoming:
        return self._get(Incoming, namespace, src, self._rank)

    def unread(self) -> list[int]:
        """The peers this rank sent to that have not read a header yet. A pipe's contents
        live only while one of its ends is open: were this process to end before the
        receiver opened its end, the headers it wrote would be lost, and the receiver
        would wait for them forever (its first header read, the receiver unlinks the pipe,
        and keeps its end open)."""
        with self._lock:
            outs = [(k[3], c) for k, c in self._made.items() if k[0] is Outgoing]
        return sorted({dst for dst, c in outs
                       if c.posted and (c._backlog or os.path.exists(c.pipe_path))})  # fmt: skip

    def usage(self) -> dict:
        """This rank's sending side: bytes of /dev/shm reserved and the peak bytes in flight."""
        with self._lock:
            outs = [c for (cls, *_), c in self._made.items() if cls is Outgoing]
        return {
            "channels": len(outs),
            "reserved_bytes": sum(o.reserved for o in outs),
            "peak_in_flight_bytes": sum(o.peak_in_flight for o in outs),
        }
