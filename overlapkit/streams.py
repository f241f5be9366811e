"""A GPU's streams, events and caching allocator, simulated on the CPU with CUDA's rules.

On a GPU the host only *queues* kernels. Each goes into a stream, a queue run in order;
kernels of two streams may run at once, and nothing orders them but events::

    host     queue: backward 4, pack 4, record e4, comm waits e4, all-reduce 4, …  (µs)
    compute  │ backward 4 │ pack 4 │ backward 3 │ pack 3 │ backward 2 │ …
                                 e4 ─┐                 e3 ─┐
    comm                             │ all-reduce 4 │ unpack 4 │ all-reduce 3 │ …

Two mistakes go unreported on a real GPU (wrong numbers, now and then):

* a **race**: kernels of two streams touch the same memory, one of them writes, and no
  event puts one after the other;
* a **reuse**: PyTorch's caching allocator hands a freed block to the next buffer of the
  stream it was allocated on, at once, for that stream's queue runs in order. A kernel of
  *another* stream queued before the free may still be reading the block.
  ``buffer.record_stream(other)`` tells the allocator to wait for ``other``'s work queued
  so far before it reuses the block.

:class:`Device` applies these rules to a step queued through an API shaped like
``torch.cuda``'s (``Stream``, ``Event``, ``stream(...)``, ``wait_event``, ``wait_stream``,
``record_stream``) and reports both mistakes, with each kernel's start and end on its
stream. Kernels take the milliseconds they are given; two streams' kernels do not slow
each other (on a GPU they share the SMs and memory bandwidth: a real step overlaps less),
except the kernels that use the network link (``run(..., link=True)``, an all-reduce):
there is one link, so those run one at a time, whichever stream queued them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

from .timeline import Timeline

#: the name of a device's first stream, current until another is made current
COMPUTE = "compute"


@dataclasses.dataclass(eq=False)
class Kernel:
    """One queued kernel: its stream, its times (ms) and the memory it touches."""

    name: str
    stream: Stream
    start: float
    end: float
    reads: tuple
    writes: tuple
    clock: dict  # stream number -> kernels of that stream ordered before this one (vector clock)

    def after(self, other: Kernel) -> bool:
        """Ordered after ``other`` (the same stream earlier, or reached by events)."""
        return other.clock[other.stream.number] <= self.clock.get(other.stream.number, 0)


class Stream:
    """A queue of kernels run in order (``torch.cuda.Stream``)."""

    def __init__(self, device: Device, number: int, name: str):
        self.device, self.number, self.name = device, number, name
        self.clock: dict[int, int] = {number: 0}  # what its next kernel will be ordered after
        self.ready = 0.0  # ms: when its next kernel may start

    def wait_event(self, event: Event) -> None:
        """Kernels queued on this stream from now on run after what ``event`` marks."""
        if not isinstance(event, Event):
            raise TypeError(f"wait_event() takes an event (gpu.Event()), got {event!r}; to "
                            "wait for all a stream has queued: wait_stream(stream)")  # fmt: skip
        if event.clock is None:  # as CUDA: an event never recorded is no wait
            return
        _merge(event.clock, into=self.clock)
        self.ready = max(self.ready, event.ms)

    def wait_stream(self, other: Stream) -> None:
        """Kernels queued on this stream from now on run after all queued on ``other``."""
        self.device._mine(other, "wait_stream()")
        event = self.device.Event()
        event.record(other)
        self.wait_event(event)

    def synchronize(self) -> None:
        """The host waits until this stream's queued kernels have run: whatever it queues
        next, on any stream, comes after them."""
        event = self.device.Event()
        event.record(self)
        event.synchronize()

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class Event:
    """A point in a stream's queue (``torch.cuda.Event``)."""

    def __init__(self, device: Device):
        self.device = device
        self.clock: dict | None = None
        self.ms = 0.0

    def record(self, stream: Stream | None = None) -> None:
        """Mark the end of what is queued on ``stream`` (the current stream) so far."""
        stream = self.device.current_stream() if stream is None else stream
        self.device._mine(stream, "Event.record()")
        self.clock, self.ms = dict(stream.clock), stream.ready

    def synchronize(self) -> None:
        """The host waits until the marked point has run: whatever it queues next, on any
        stream, comes after it."""
        if self.clock is None:
            return
        self.device.host = max(self.device.host, self.ms)
        self.device._seen_by_host(self.clock)


class Buffer:
    """Memory from the caching allocator, allocated on the stream that was current."""

    def __init__(self, device: Device, name: str, mib: float, block: int, stream: Stream):
        self.device, self.name, self.mib, self.block = device, name, mib, block
        self.stream = stream  # the stream it was allocated on
        self.recorded: list[Stream] = []  # streams given by record_stream
        self.freed = False

    def record_stream(self, stream: Stream) -> None:
        """Tell the allocator that ``stream`` uses this buffer: once freed, its block is
        not reused before ``stream``'s work queued until then has run."""
        self.device._alive(self, "record_stream")
        self.device._mine(stream, "record_stream()")
        self.recorded.append(stream)

    def free(self) -> None:
        """Back to the allocator (in PyTorch: when its last reference goes)."""
        self.device._alive(self, "free")
        self.freed = True
        self.device._free(self)

    def __repr__(self) -> str:
        return f"<buffer {self.name}, {self.mib:g} MiB>"


class Device:
    """A simulated GPU: one stream at first (``compute``), more made by :meth:`Stream`."""

    def __init__(self):
        self.streams: list[Stream] = []
        self.kernels: list[Kernel] = []
        self.host = 0.0  # ms: the host's clock (queueing takes no time; synchronize waits)
        self.link = 0.0  # ms: when the network link is free for the next all-reduce
        self._current = self.Stream(COMPUTE)
        self._blocks = itertools.count(1)
        self._pool: dict = {}  # (stream, MiB) -> free blocks, the latest freed last
        self._held: list[tuple[Buffer, dict]] = []  # freed blocks waiting for their streams
        self._uses: dict[int, list[tuple[Kernel, Buffer, str]]] = {}  # block -> accesses
        self.buffers: list[Buffer] = []  # every buffer allocated, in order

    # ---- the torch.cuda-shaped API
    def Stream(self, name: str | None = None) -> Stream:  # noqa: N802 - torch.cuda's name
        stream = Stream(self, len(self.streams), name or f"stream {len(self.streams)}")
        self.streams.append(stream)
        return stream

    def Event(self) -> Event:  # noqa: N802 - torch.cuda's name
        return Event(self)

    def current_stream(self) -> Stream:
        return self._current

    @contextlib.contextmanager
    def stream(self, stream: Stream):
        """Kernels and buffers inside the block go to ``stream`` (``torch.cuda.stream``)."""
        self._mine(stream, "gpu.stream()")
        before, self._current = self._current, stream
        try:
            yield stream
        finally:
            self._current = before

    def synchronize(self) -> None:
        """The host waits until every stream's queued kernels have run."""
        for s in self.streams:
            s.synchronize()

    def empty(self, mib: float, name: str) -> Buffer:
        """A buffer of ``mib`` MiB from the caching allocator, on the current stream."""
        stream = self._current
        self._release_held()
        pool = self._pool.get((stream, mib), [])
        block = pool.pop() if pool else next(self._blocks)
        self.buffers.append(Buffer(self, name, mib, block, stream))
        return self.buffers[-1]

    def run(self, name: str, ms: float, reads=(), writes=(), link: bool = False) -> Kernel:
        """Queue a kernel of ``ms`` milliseconds on the current stream; ``link``: it moves
        bytes over the network link, which one kernel uses at a time."""
        for b in (*reads, *writes):
            self._alive(b, f"kernel {name!r}")
        s = self._current
        s.clock[s.number] += 1
        start = max(s.ready, self.host, self.link if link else 0.0)
        k = Kernel(name, s, start, start + ms, tuple(reads), tuple(writes), dict(s.clock))
        s.ready = k.end
        if link:
            self.link = k.end
        self.kernels.append(k)
        for mode, buffers in (("reads", reads), ("writes", writes)):
            for b in buffers:
                self._uses.setdefault(b.block, []).append((k, b, mode))
        return k

    # ---- what the step did
    def step_ms(self) -> float:
        return max((k.end for k in self.kernels), default=0.0)

    def hazards(self) -> list[str]:
        """Every pair of kernels of two streams that touch one block, one writing, with
        nothing ordering them: a race (one buffer) or a reuse (a freed one's block); in
        the order the later kernel of each pair was queued."""
        found = []
        order = {id(k): i for i, k in enumerate(self.kernels)}
        for uses in self._uses.values():
            for (k1, b1, m1), (k2, b2, m2) in itertools.combinations(uses, 2):
                if k1.stream is k2.stream or "writes" not in (m1, m2) or k2.after(k1):
                    continue
                if b1 is b2:
                    text = (f"race: {k2.name!r} on stream {k2.stream.name} {m2} {b2.name} "
                            f"while {k1.name!r} on stream {k1.stream.name} may still be "
                            f"running and {m1} it: no event orders them")  # fmt: skip
                else:
                    text = (f"reuse: {b2.name} got the memory of {b1.name}, freed while "
                            f"{k1.name!r} on stream {k1.stream.name} may still be running "
                            f"and {m1} it; {k2.name!r} on stream {k2.stream.name} "
                            f"{m2} it")  # fmt: skip
                found.append((order[id(k2)], order[id(k1)], text))
        return [text for *_, text in sorted(found)]  # by the kernel that went wrong first

    def timeline(self) -> Timeline:
        """The kernels as spans, one lane per stream (seconds, as a Timeline's)."""
        tl = Timeline()
        for k in self.kernels:
            tl.add(k.name, k.start / 1e3, k.end / 1e3, lane=k.stream.name)
        return tl

    # ---- the caching allocator, and what the API is given
    def _mine(self, stream, what: str) -> None:
        if not isinstance(stream, Stream):
            raise TypeError(f"{what} takes a stream (gpu.Stream() or gpu.current_stream()), "
                            f"got {stream!r}")  # fmt: skip
        if stream.device is not self:
            raise TypeError(f"{what}: {stream!r} is a stream of another device")

    def _seen_by_host(self, clock: dict) -> None:
        """The host saw the work ``clock`` marks done: whatever it queues next, on any
        stream, comes after that work."""
        for other in self.streams:
            _merge(clock, into=other.clock)

    def _alive(self, buffer, what: str) -> None:
        if isinstance(buffer, Buffer) and buffer.device is not self:
            raise TypeError(f"{what}: {buffer!r} is a buffer of another device")
        if not isinstance(buffer, Buffer):
            raise TypeError(f"{what}: {buffer!r} is not a buffer (gpu.empty)")
        if buffer.freed:
            raise RuntimeError(f"{what}: {buffer.name} was freed already")

    def _free(self, buffer: Buffer) -> None:
        others = [s for s in buffer.recorded if s is not buffer.stream]
        if others:  # PyTorch records an event on each such stream, now
            self._held.append((buffer, {s: s.clock[s.number] for s in others}))
        else:  # reusable at once by its own stream, whose queue runs in order
            self._pool.setdefault((buffer.stream, buffer.mib), []).append(buffer.block)

    def _release_held(self) -> None:
        """Blocks whose streams have run, by the host's clock, what was queued at the free
        (the allocator asks the events when it looks for memory)."""
        still = []
        for buffer, marks in self._held:
            done = all(self._ran_by_host(s, n) for s, n in marks.items())
            if done:  # the allocator saw the events complete: what comes next is after them
                self._seen_by_host({s.number: n for s, n in marks.items()})
                self._pool.setdefault((buffer.stream, buffer.mib), []).append(buffer.block)
            else:
                still.append((buffer, marks))
        self._held = still

    def _ran_by_host(self, stream: Stream, count: int) -> bool:
        ends = [k.end for k in self.kernels if k.stream is stream]
        return count == 0 or (len(ends) >= count and ends[count - 1] <= self.host)


def _merge(clock: dict, into: dict) -> None:
    """``into`` (a stream's vector clock) now also knows all that ``clock`` marks."""
    for s, n in clock.items():
        into[s] = max(into.get(s, 0), n)


#: the pack (fp32 gradient to the fp16 copy that travels) and the unpack, in ms
PACK_MS = 0.2


@dataclasses.dataclass(frozen=True)
class Layer:
    """A layer of a data-parallel backward: its backward's and its gradient's all-reduce's
    milliseconds, the gradient's MiB; and the kernels that make its step, each queued on
    the current stream."""

    name: str
    backward_ms: float
    all_reduce_ms: float
    mib: float

    def backward(self, gpu: Device) -> Buffer:
        """The layer's gradient, computed (written) by its backward kernel."""
        grad = gpu.empty(self.mib, f"grad {self.name}")
        gpu.run(f"backward {self.name}", self.backward_ms, writes=[grad])
        return grad

    def pack(self, gpu: Device, grad: Buffer) -> Buffer:
        """The gradient's half-precision copy, the bytes that travel."""
        wire = gpu.empty(self.mib / 2, f"wire {self.name}")
        gpu.run(f"pack {self.name}", PACK_MS, reads=[grad], writes=[wire])
        return wire

    def all_reduce(self, gpu: Device, wire: Buffer, grad: Buffer) -> None:
        """The all-reduce of ``wire`` in place (NCCL's kernel), then its sum back in ``grad``."""
        gpu.run(
            f"all-reduce {self.name}", self.all_reduce_ms, reads=[wire], writes=[wire], link=True
        )
        gpu.run(f"unpack {self.name}", PACK_MS, reads=[wire], writes=[grad])
