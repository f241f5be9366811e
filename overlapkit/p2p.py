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
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import operator
import struct
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import handles, routes, shm

#: tags of the user stream's messages through a process group, apart from a learner's
#: own dist.send/recv (tag 0); the kit stream has process groups of its own
KIT_TAG = 7171
#: tag of message bodies that travel through the process group under a link
KIT_DATA_TAG = KIT_TAG + 1
_BEGIN_TAG = KIT_TAG + 2
USER, KIT = "user", "kit"


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


_link: _LinkState | None = None
#: the path of messages that cost nothing on the emulated link (the kit's announcements)
_FREE = _LinkState(Link(0, 1e9))
_channels: shm.Channels | None = None


def set_link(link: Link | None) -> None:
    """Use ``link`` for this rank's kit messages from now on (None: no emulation)."""
    global _link, _wake_up_late
    _link = _LinkState(link) if link is not None else None
    if link is not None:
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


def current_link() -> Link | None:
    return _link.link if _link is not None else None


#: how late this machine's sleeps wake up (measured by set_link); waits sleep until that
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


_world_name: str | None = None


def _group_name(group) -> str:
    global _world_name
    if group is not None:
        return group.group_name
    if _world_name is None:  # looked up once: it sits on every message's path
        _world_name = dist.group.WORLD.group_name
    return _world_name


# --------------------------------------------------------------------------- the kit stream


class Op:
    """A kit collective as its messages describe it: its number on its group and a
    signature of (collective, size, dtype, op, issuing thread), so that a peer
    running a different operation is told, not fed the wrong bytes."""

    def __init__(self, group, seq: int, signature: int, description: str):
        self.group, self.seq, self.signature = group, seq, signature
        self.description = description
        self.check = True
        self.described: set = set()  # peers whose first message carried the description
        self.announcements: list = []  # (peer, handle, buffer) of announcements not checked
        self.announcement_sends: list = []

    def finish(self) -> None:
        """At the op's end: announcements checked (also where no data was waited for)."""
        self.check_announcements()
        sends, self.announcement_sends = self.announcement_sends, []
        for handle in sends:
            handle.wait()

    def check_announcements(self) -> None:
        """Wait for the peers' announcements of their operation; raise if one differs."""
        pending, self.announcements = self.announcements, []
        for src, handle, box in pending:
            try:
                handle.wait()
            except CollectiveMismatchError:
                raise
            except RuntimeError as exc:  # data came where the announcement should be
                raise CollectiveMismatchError(
                    f"rank {dist.get_rank()} runs {self.description}, but rank {src} sent "
                    f"something else first ({exc})"
                ) from exc
            error = _mismatch(self, src, *_read_announcement(box)) if self.check else None
            if error is not None:
                raise error

    def introduce_to(self, peer: int) -> bytes:
        """The description for the first message to ``peer`` (b"" after that)."""
        if peer in self.described:
            return b""
        self.described.add(peer)
        return self.description.encode()


_local = threading.local()


def current_op() -> Op | None:
    """The kit collective running on this thread, if any: its messages go in the kit stream."""
    return getattr(_local, "op", None)


@contextlib.contextmanager
def running(op: Op | None):
    previous, _local.op = current_op(), op
    try:
        yield
    finally:
        _local.op = previous


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with tensors or ops that do not match."""


def _mismatch(op: Op, peer: int, seq: int, signature: int, description: str):
    me = dist.get_rank()
    if seq == op.seq and signature == op.signature:
        return None
    return CollectiveMismatchError(
        f"rank {me} and rank {peer} disagree on kit operation #{op.seq} of their group: "
        f"rank {me} runs {op.description}; rank {peer} runs "
        f"{description or 'something else'} (its operation #{seq}). Every rank must issue "
        "the same kit collectives, with the same size, dtype and op, in the same order "
        "(also when they are issued from several threads)."
    )


_private: dict = {}
_private_lock = threading.Lock()
_making: dict = {}


def _kit_group(group):
    """The kit's own gloo process group over ``group``'s ranks, for the kit stream's CPU
    bytes (CUDA tensors on NCCL take a directed route: :mod:`overlapkit.routes`).

    Made straight from the default store, outside torch's group registry, so
    making it needs no collective on the user's groups: each member makes it
    when it runs its first kit collective on ``group`` (which every member runs).
    """
    key = _group_name(group)
    pg = _private.get(key)
    if pg is not None:
        return pg
    with _private_lock:  # one maker per group: making one waits for the peers to make it,
        making = _making.setdefault(key, threading.Lock())  # so groups do not wait in line
    with making:
        if key not in _private:
            _private[key] = _make_kit_group(group, key)
    return _private[key]


def _make_kit_group(group, name: str):
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    store = dist.PrefixStore(f"overlapkit/cpu/{name}", c10d._get_default_store())
    me, size = dist.get_rank(group), dist.get_world_size(group)
    return dist.ProcessGroupGloo(store, me, size, timedelta(seconds=3600))


_forget_hooks: list = []


def on_forget(hook) -> None:
    """Call ``hook()`` from :func:`forget_private_groups` (caches of group facts)."""
    _forget_hooks.append(hook)


def forget_private_groups() -> None:
    """Drop the kit's process groups and what it remembers of the default group
    (before that group is destroyed)."""
    global _world_name, _world_size, _my_rank
    with _private_lock:
        _private.clear()
        _carries_cuda.clear()
    routes.forget()
    _world_name = _world_size = _my_rank = None
    _ends.clear()
    for hook in _forget_hooks:
        hook()


def _to_pg_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_group_rank(group, rank)


def _kit_tag(tag: int) -> int:
    """A kit op's messages carry its signature in their tag (announcements excepted):
    gloo matches by tag, so the data of two ranks that disagree never meets (gloo
    aborts the process on a size mismatch) and the announcements can tell them."""
    op = current_op()
    if tag == _BEGIN_TAG or op is None or not op.check:
        return tag
    return (tag & 0x7FF) << 20 | op.signature & 0xFFFFF  # below 2³¹: gloo takes int tags


_user_ops = [0]  # messages the kit sent or received on the user's own groups
_user_ops_lock = threading.Lock()


def user_stream_ops() -> int:
    """How many messages the kit has sent or received on torch's (the user's) process
    groups so far: each counts one in that group's sequence number, so a check that
    refuses built-in operations tells the kit's messages from the learner's own."""
    return _user_ops[0]


def _count_user_op() -> None:
    with _user_ops_lock:
        _user_ops[0] += 1


def _pg_send(tensor: torch.Tensor, dst: int, group, tag: int):
    """Start sending through the stream's process group; the user stream uses ``group``,
    CUDA tensors the directed NCCL route of their stream (:mod:`overlapkit.routes`)."""
    namespace = USER if current_op() is None else KIT
    if routes.recorded():
        routes.note("send", namespace, _group_name(group), dist.get_rank(), dst, tensor)
    if tensor.device.type == "cuda":
        pg, peer = routes.directed_group(namespace, _group_name(group), dist.get_rank(), dst)
        return pg.send([tensor], peer, 0)
    if namespace == USER:
        _count_user_op()
        return _pollable(dist.isend(tensor, dst, group=group, tag=tag), tensor)
    pg = _kit_group(group)
    return _pollable(pg.send([tensor], _to_pg_rank(group, dst), _kit_tag(tag)), tensor)


def _pg_recv(tensor: torch.Tensor, src: int, group, tag: int):
    namespace = USER if current_op() is None else KIT
    if routes.recorded():
        routes.note("recv", namespace, _group_name(group), dist.get_rank(), src, tensor)
    if tensor.device.type == "cuda":
        pg, peer = routes.directed_group(namespace, _group_name(group), src, dist.get_rank())
        return pg.recv([tensor], peer, 0)
    if namespace == USER:
        _count_user_op()
        return _pollable(dist.irecv(tensor, src, group=group, tag=tag), tensor)
    pg = _kit_group(group)
    return _pollable(pg.recv([tensor], _to_pg_rank(group, src), _kit_tag(tag)), tensor)


_carries_cuda: dict = {}


def _staged(tensor: torch.Tensor, group) -> bool:
    """Whether a CUDA tensor must travel through the host: its group's backend (gloo, as
    on a one-GPU box where the ranks share the GPU) moves CPU tensors only."""
    if tensor.device.type != "cuda":
        return False
    name = _group_name(group)
    known = _carries_cuda.get(name)
    if known is None:
        known = _carries_cuda[name] = routes.carries_cuda(group)
    return not known


def _pollable(work, tensor: torch.Tensor):
    """Gloo's (a CPU tensor's) work, made pollable (handles.Polled); NCCL's polls as is."""
    return handles.Polled(work) if tensor.device.type == "cpu" else work


_side_streams: dict = {}


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A small received tensor on the host, without synchronising the caller's CUDA stream."""
    if tensor.device.type != "cuda":
        return tensor
    side = _side_streams.get(tensor.device)
    if side is None:
        side = _side_streams[tensor.device] = torch.cuda.Stream(tensor.device)
    # the caller's stream, read before the switch: inside the block the current stream
    # is the side one, and a stream that waits for itself orders nothing
    side.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(side):
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        out.copy_(tensor, non_blocking=True)
    side.synchronize()  # this side stream only, not the device
    return out


# --------------------------------------------------------------------------- handles


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


# --------------------------------------------------------------------------- shared memory


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


_ends: dict = {}  # (stream, group, peer, shared?) -> channel end or inbox: a hot lookup


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


def _inbox(namespace: str, src: int, shared: bool) -> _Inbox | _SharedInbox:
    key = (namespace, src, shared)
    with _inboxes_lock:
        if key not in _inboxes:
            incoming = _channels.incoming(namespace, src) if shared else None
            _inboxes[key] = _SharedInbox(incoming) if shared else _Inbox()
        return _inboxes[key]


#: a header through a process group: departed, bytes, op number, op signature
_GROUP_HEADER = 4


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
        key = (self._op is None, group, src, _shared_memory(tensor))
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
            departed, nbytes, seq, signature = _host(self._header).tolist()
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


def _shared_memory(tensor: torch.Tensor) -> bool:
    """Whether a message's bytes and header go through shared memory (else the group)."""
    return _channels is not None and tensor.device.type == "cpu"


def through_shared_memory(tensor: torch.Tensor) -> bool:
    """Whether messages of ``tensor`` go through the kit's shared memory (an emulated
    link between ranks of one ``ok.launch``), rather than through a process group."""
    return _link is not None and _shared_memory(tensor)


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


def bytes_sent() -> int:
    """The bytes this process has sent through the kit so far (a check's byte budget)."""
    return _sent_bytes[0]


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
    header = torch.tensor([departed, nbytes, seq, signature], dtype=torch.float64)
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

#: an announcement: op number, signature, then the op's description in UTF-8
_ANNOUNCE = struct.Struct("<qqH")
_ANNOUNCE_BYTES = 512


def _announcement(op: Op, device) -> torch.Tensor:
    text = op.description.encode()[: _ANNOUNCE_BYTES - _ANNOUNCE.size]
    raw = _ANNOUNCE.pack(op.seq, op.signature, len(text)) + text
    buf = torch.zeros(_ANNOUNCE_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.to(device)


def _read_announcement(buf: torch.Tensor) -> tuple[int, int, str]:
    raw = bytes(_host(buf).tolist())
    seq, signature, n = _ANNOUNCE.unpack_from(raw)
    return seq, signature, raw[_ANNOUNCE.size : _ANNOUNCE.size + n].decode("utf-8", "replace")


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
    if data_follows and _link is not None and _channels is not None and device.type == "cpu":
        return
    # in the data's own order (so it is checked before any data lands), but over a
    # link that costs nothing: the α-β model has no term for it, and a NIC none
    free = _FREE if _link is not None else None
    sends = [_isend(_announcement(op, device), dst, group, free, _BEGIN_TAG) for dst in to]
    boxes = [torch.empty(_ANNOUNCE_BYTES, dtype=torch.uint8, device=device) for _ in frm]
    recvs = [_irecv(box, src, group, free, _BEGIN_TAG) for box, src in zip(boxes, frm, strict=True)]
    op.announcements = list(zip(frm, recvs, boxes, strict=True))
    op.announcement_sends = sends  # kept alive until the op ends (gloo sends by reference)
