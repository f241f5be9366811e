"""Timelines: what each rank computed and communicated, when, and how much of it overlapped.

A :class:`Timeline` records *spans* (name, start, end) on *lanes* ("compute",
"comm", ...) for a rank. Ranks return their timelines from ``ok.launch``;
:meth:`Timeline.merge` puts them on one clock (``time.perf_counter``, which is
CLOCK_MONOTONIC on Linux and therefore shared by all processes of a machine).

Two measures of overlap, for one rank::

    compute  |██████████████████|        |████████|
    comm            |░░░░░░░░░░░░░░░░░░░░░░░░░|
                    ^ hidden ^^^^^^ exposed ^^

    overlap ratio   = (T_comp + T_comm - T_wall) / T_comm     (the lecture notes' formula)
    hidden fraction = |comm ∩ compute| / |comm|               (exact, from the intervals)

They agree when the rank is never idle; idle time (waiting for a peer)
lowers the ratio, not the hidden fraction. Both are shown, because the gap
between them is itself a lesson.

On a GPU, a span means GPU time: :meth:`Timeline.cuda_span` and :meth:`Timeline.track`
of CUDA work time it with CUDA events, and :meth:`Timeline.from_profiler` takes the
kernels (and memcpy/memset) of a trace that holds them. The host only enqueues GPU work
and returns: a span measured on the host's clock around GPU work (``span()``,
``add(..., now())``, the moment a NCCL ``wait()`` returns) is a launch time, not an
execution time, and must not be read as one (an overlap seen there can be false).

This module holds the spans and their measures; :mod:`overlapkit.timeline_plot` draws a
timeline and :mod:`overlapkit.timeline_trace` writes and reads trace files (the
methods :meth:`Timeline.plot`, :meth:`Timeline.to_chrome_trace` and
:meth:`Timeline.from_profiler` call them).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable

import torch

from . import runtime
from .spans import (  # noqa: F401 - the spans and their algebra, used from here too
    COMM,
    COMPUTE,
    Span,
    intersect,
    is_comm,
    length,
    subtract,
    union,
)

# --------------------------------------------------------------------------- timeline


class Timeline:
    """Spans of one rank (while recording) or of many ranks (after :meth:`merge`)."""

    def __init__(self, rank: int | None = None, spans: Iterable[Span] = ()):
        self.rank = runtime.rank() if rank is None else rank
        self.spans: list[Span] = list(spans)
        self._cuda_pending: list = []  # (name, lane, start_event, end_event, device)

    # ---------------------------------------------------------------- recording
    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def stamp(self, device=None):
        """A moment for :meth:`add`: the host clock (:meth:`now`), or on a CUDA ``device``
        an event recorded on its current stream — the moment the GPU reaches the work
        queued so far, read when the timeline is read. What the kit's wrappers time their
        compute spans with: on a GPU, the host's clock would only say when work was
        launched."""
        if device is None or torch.device(device).type != "cuda":
            return self.now()
        cuda = _torch_cuda()
        event = cuda.Event(enable_timing=True)
        event.record(cuda.current_stream(device))
        return event

    def add(self, name: str, start, end, lane: str = COMPUTE, rank=None) -> Span | None:
        """Record a span measured elsewhere: times from :meth:`now`, or CUDA events from
        :meth:`stamp` (placed on the host clock when the timeline is read; None now)."""
        if not isinstance(start, (int, float)):
            self._cuda_pending.append((name, lane, start, end, getattr(start, "device", None)))
            return None
        if end < start:
            raise ValueError(f"span {name!r} ends ({end}) before it starts ({start})")
        span = Span(name, start, end, lane, self.rank if rank is None else rank)
        self.spans.append(span)
        return span

    @contextlib.contextmanager
    def span(self, name: str, lane: str = COMPUTE):
        """Time the body of a ``with`` block on the host clock."""
        start = self.now()
        try:
            yield
        finally:
            self.add(name, start, self.now(), lane)

    def track(self, name: str, work, lane: str = COMM, device=None):
        """Record an async operation from now until it completes; returns a handle whose
        ``wait()`` and ``is_completed()`` are the work's own.

        On the host (CPU tensors, gloo, the kit's own ops): the span starts now and ends
        when the work's future completes (the true completion time, seen from a
        communication thread); without a future, when ``wait()`` returns on the handle.

        CUDA work is timed on the GPU, with CUDA events, as :meth:`cuda_span` is: an event
        recorded now on the current stream (NCCL's stream waits for this one before the
        collective starts: the span includes queueing behind earlier collectives), and an
        event recorded on a stream that waits for the work — in the callback of the work's
        future, which PyTorch runs on a stream synchronised with the work's kernels (NCCL
        completes its future at launch, so this is at once); without a future, on the
        current stream just after ``wait()`` (NCCL's ``wait()`` makes that stream wait for
        the collective; work queued on it before ``wait()`` then delays this end). The span
        is put on the host clock when the timeline is read. The work is CUDA work when
        ``device`` (the device of its tensors, e.g. ``tensor.device``) is a CUDA device, or,
        ``device`` None, when its future is already complete with CUDA tensors (NCCL's);
        ``device="cpu"`` keeps the host clock. The handle's ``is_completed()`` is the
        work's (NCCL's: done on the GPU); the span's times are the GPU's, read later.
        """
        return _TrackedWork(self, name, lane, work, device)

    @contextlib.contextmanager
    def cuda_span(self, name: str, lane: str = COMPUTE, stream=None):
        """Time the GPU work enqueued in the block on ``stream`` with CUDA events.

        The host returns immediately; the span is placed on the host clock when
        the timeline is read (this synchronises the device once).
        """
        cuda = _torch_cuda()
        stream = stream or cuda.current_stream()
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        start.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            self._cuda_pending.append((name, lane, start, end, stream.device))

    def _resolve_cuda(self) -> None:
        """Put the pending CUDA spans on the host clock: per device, once everything
        pending there is done, an anchor event pairs the GPU's clock with the host's, and
        each event is placed by its time before the anchor."""
        if not self._cuda_pending:
            return
        pending = []  # a future's callback may add one from another thread meanwhile
        while self._cuda_pending:
            pending.append(self._cuda_pending.pop(0))
        cuda, anchors = _torch_cuda(), {}
        for name, lane, start, end, device in pending:
            end.synchronize()
            if str(device) not in anchors:
                cuda.synchronize(device)
                anchor = cuda.Event(enable_timing=True)
                anchor.record(cuda.current_stream(device))
                anchor.synchronize()
                anchors[str(device)] = (anchor, self.now())
            anchor, host = anchors[str(device)]
            s = host - start.elapsed_time(anchor) / 1e3
            e = host - end.elapsed_time(anchor) / 1e3
            self.add(name, s, max(s, e), lane)  # a tracked op's two events, on two streams

    def __getstate__(self):
        self._resolve_cuda()  # events do not travel between processes
        return {"rank": self.rank, "spans": self.spans}

    def __setstate__(self, state):
        self.__init__(state["rank"], state["spans"])

    # ---------------------------------------------------------------- combining
    @classmethod
    def merge(cls, timelines: Iterable[Timeline]) -> Timeline:
        """One timeline holding every rank's spans (e.g. the list ``ok.launch`` returned)."""
        merged = cls(rank=-1)
        for tl in timelines:
            if not isinstance(tl, Timeline):
                raise TypeError(f"merge() takes Timeline objects, got {type(tl).__name__}")
            tl._resolve_cuda()
            merged.spans.extend(tl.spans)
        merged.spans.sort(key=lambda s: (s.rank, s.start))
        return merged

    @property
    def ranks(self) -> list[int]:
        return sorted({s.rank for s in self._all()})

    @property
    def lanes(self) -> list[str]:
        seen = {s.lane for s in self._all()}
        known = [lane for lane in (COMPUTE, COMM) if lane in seen]
        return known + sorted(seen - set(known))

    def _all(self) -> list[Span]:
        self._resolve_cuda()
        return self.spans

    def select(self, rank: int | None = None, lane: str | None = None) -> list[Span]:
        return [
            s
            for s in self._all()
            if (rank is None or s.rank == rank) and (lane is None or s.lane == lane)
        ]

    def _comm(self, rank: int) -> list[tuple[float, float]]:
        """The rank's communication time, every comm lane together."""
        return union((s.start, s.end) for s in self.select(rank) if is_comm(s.lane))

    # ---------------------------------------------------------------- metrics
    def busy(self, lane: str, rank: int | None = None) -> float:
        """Seconds during which ``lane`` had at least one span (overlaps counted once)."""
        return length((s.start, s.end) for s in self.select(rank, lane))

    def wall(self, rank: int | None = None) -> float:
        """From the first span's start to the last span's end."""
        spans = self.select(rank)
        return max(s.end for s in spans) - min(s.start for s in spans) if spans else 0.0

    def _per_rank(self, metric, rank):
        if rank is not None:
            return metric(rank)
        values = [metric(r) for r in self.ranks]
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    def overlap_ratio(self, rank: int | None = None) -> float | None:
        """(T_comp + T_comm − T_wall) / T_comm for a rank, or the mean over ranks.

        None when the rank did not communicate.
        """

        def one(r):
            comm = length(self._comm(r))
            if comm == 0:
                return None
            return (self.busy(COMPUTE, r) + comm - self.wall(r)) / comm

        return self._per_rank(one, rank)

    def hidden_fraction(self, rank: int | None = None) -> float | None:
        """Exact share of communication time during which the rank was also computing."""

        def one(r):
            comm = self._comm(r)
            total = length(comm)
            if total == 0:
                return None
            comp = union((s.start, s.end) for s in self.select(r, COMPUTE))
            return length(intersect(comm, comp)) / total

        return self._per_rank(one, rank)

    def summary(self) -> list[dict]:
        """One row per rank: T_comp, T_comm, T_wall (seconds), overlap ratio, hidden fraction."""
        return [
            {
                "rank": r,
                "T_comp": self.busy(COMPUTE, r),
                "T_comm": length(self._comm(r)),
                "T_wall": self.wall(r),
                "overlap_ratio": self.overlap_ratio(r),
                "hidden_fraction": self.hidden_fraction(r),
            }
            for r in self.ranks
        ]

    def __repr__(self) -> str:
        return f"Timeline(ranks={self.ranks}, lanes={self.lanes}, spans={len(self.spans)})"

    # ---------------------------------------------------------------- pictures
    def plot(
        self,
        ax=None,
        title: str | None = None,
        labels: bool = True,
        t0: float | None = None,
        legend: bool = True,
        metrics: bool = True,
    ):
        """Draw one row per (rank, lane); communication hidden under compute is hatched.

        ``metrics=False`` leaves the overlap figures out of the title.
        Returns the matplotlib Figure. Times are milliseconds from ``t0``
        (default: the earliest span), so timelines drawn side by side share
        an origin when given the same ``t0``.
        """
        from .timeline_plot import plot

        return plot(self, ax, title, labels, t0, legend, metrics)

    def save(self, path: str, title: str | None = None, dpi: int = 110) -> str:
        """Plot to an image file and close the figure; returns the path."""
        import matplotlib.pyplot as plt

        fig = self.plot(title=title)
        fig.savefig(path, dpi=dpi, bbox_inches="tight")
        plt.close(fig)
        return path

    # ---------------------------------------------------------------- traces
    def to_chrome_trace(self, path: str | None = None) -> dict:
        """The timeline as Chrome trace-event JSON (open in Perfetto or chrome://tracing).

        One process per rank, one thread per lane, times in microseconds.
        Written to ``path`` when given.
        """
        from .timeline_trace import chrome_trace

        return chrome_trace(self, path)

    @classmethod
    def from_profiler(cls, source, rank: int = 0) -> Timeline:
        """A timeline from a ``torch.profiler`` trace: ``source`` is the path of a trace
        written by ``prof.export_chrome_trace(path)``, its JSON as a dict, or the
        ``torch.profiler.profile`` object itself.

        What ran, not what was launched. A trace of GPU work (``ProfilerActivity.CUDA``:
        it holds ``kernel``, ``gpu_memcpy`` or ``gpu_memset`` events) is read on the GPU:
        communication (lane ``comm``) is the NCCL kernels (``ncclDevKernel_*``,
        ``ncclKernel_*``), computation (lane ``compute``) every other kernel, memcpy and
        memset, whatever stream each ran on; the host's events (``cpu_op``,
        ``cuda_runtime``, ``cuda_driver``, ``python_function``, ``user_annotation``) only
        launched that work, and are not counted (an operator's host span is its launch: a
        host waiting in ``.item()`` would read as computing). gloo's ``gloo:*`` events stay
        communication, as its worker threads execute the collective. A trace of CPU work
        only: communication is gloo's ``gloo:*`` events on its worker threads, computation
        every other operator (``cpu_op``) of the threads that issue work, the collectives'
        brief ``c10d::*`` issue calls aside. Nested operators and kernels on several streams
        are merged by the overlap measures, which work on the union of intervals. Times
        start at 0 at the trace's first event. The kit's own ring runs in Python on the
        kit's communication thread, which the profiler does not trace: its spans come from
        the kit's timelines.
        """
        from .timeline_trace import from_profiler

        return from_profiler(cls, source, rank)


def _torch_cuda():
    """``torch.cuda``: where the timeline gets its events, streams and synchronisation
    (the one place a test replaces, to check the CUDA paths on a machine without one)."""
    return torch.cuda


def _cuda_device(device, future) -> torch.device | None:
    """The CUDA device whose clock times a tracked work, or None for the host's clock."""
    if device is not None:
        device = torch.device(device)
        return device if device.type == "cuda" else None
    value = None
    with contextlib.suppress(Exception):  # not done, or failed: the host's clock
        if future is not None and future.done():
            value = future.value()  # NCCL's: the collective's tensors, at launch
    for item in value if isinstance(value, (list, tuple)) else (value,):
        if getattr(item, "is_cuda", False) is True:
            return item.device
    return None


class _TrackedWork:
    """Handle returned by :meth:`Timeline.track`: wait() like the work it wraps.

    On CUDA the span's start is an event recorded at track() and its end an event
    recorded where a stream waits for the work (see :meth:`Timeline.track`), so the
    span is the GPU's; ``is_completed()`` is the work's own answer, never the span's.
    """

    def __init__(self, timeline: Timeline, name: str, lane: str, work, device=None):
        self._work = work
        self._timeline = timeline
        self._name, self._lane = name, lane
        self._start = timeline.now()
        self._recorded = False
        self._lock = threading.Lock()  # the future's callback runs on a backend thread
        future = None
        with contextlib.suppress(Exception):  # not every backend/op has a future
            future = work.get_future()
        self._device = _cuda_device(device, future)
        if self._device is not None:  # the GPU's clock: an event after what is queued now
            cuda = _torch_cuda()
            self._start = cuda.Event(enable_timing=True)
            self._start.record(cuda.current_stream(self._device))
        if future is not None:
            future.add_done_callback(lambda _: self._record())

    def _record(self) -> None:
        with self._lock:
            if self._recorded:
                return
            self._recorded = True
            if self._device is None:
                self._timeline.add(self._name, self._start, self._timeline.now(), self._lane)
                return
            # the current stream waits for the work here: in a future's callback, a stream
            # PyTorch synchronised with it; after wait(), the caller's, as NCCL's wait() does
            cuda = _torch_cuda()
            end = cuda.Event(enable_timing=True)
            end.record(cuda.current_stream(self._device))
            self._timeline._cuda_pending.append(
                (self._name, self._lane, self._start, end, self._device)
            )

    def wait(self, *args):
        result = self._work.wait(*args)
        self._record()
        return result

    def is_completed(self) -> bool:
        """The work's answer (NCCL's: finished on the GPU); the span is read later."""
        return self._work.is_completed()
