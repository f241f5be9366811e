"""A :class:`~overlapkit.timeline.Timeline` to and from trace files: written as Chrome
trace-event JSON (Perfetto, chrome://tracing), read from a ``torch.profiler`` trace, what
ran on the GPU or the CPU sorted into the compute and comm lanes (the documentation of
:meth:`Timeline.from_profiler <overlapkit.timeline.Timeline.from_profiler>`)."""

from __future__ import annotations

import json

from .spans import COMM, COMPUTE


def chrome_trace(timeline, path: str | None = None) -> dict:
    """What :meth:`Timeline.to_chrome_trace <overlapkit.timeline.Timeline.to_chrome_trace>`
    returns (and writes to ``path``)."""
    spans = timeline._all()
    t0 = min((s.start for s in spans), default=0.0)
    lanes = {lane: i for i, lane in enumerate(timeline.lanes)}
    events = []
    for r in timeline.ranks:
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}}
        )
        for lane, tid in lanes.items():
            events.append(
                {"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": lane}}
            )
    for s in spans:
        events.append(
            {
                "name": s.name,
                "cat": s.lane,
                "ph": "X",
                "ts": round((s.start - t0) * 1e6, 3),
                "dur": round(s.duration * 1e6, 3),
                "pid": s.rank,
                "tid": lanes[s.lane],
            }
        )
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace


def from_profiler(cls, source, rank: int = 0):
    """What :meth:`Timeline.from_profiler <overlapkit.timeline.Timeline.from_profiler>`
    returns: a ``cls`` from the trace ``source``."""
    if hasattr(source, "export_chrome_trace"):
        import os  # noqa: PLC0415
        import tempfile  # noqa: PLC0415

        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            try:
                source.export_chrome_trace(path)
            except RuntimeError as exc:  # a profile exports its trace once
                raise ValueError(
                    f"this profile cannot be exported again ({exc}): pass the path of "
                    "the trace you exported it to"
                ) from None
            with open(path) as f:
                source = json.load(f)
        finally:
            os.unlink(path)
    elif isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        with open(source) as f:
            source = json.load(f)
    events = source.get("traceEvents", []) if isinstance(source, dict) else source
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    if not spans:
        raise ValueError("the trace holds no complete ('X') events: was anything profiled?")
    t0 = min(float(e["ts"]) for e in spans)
    on_gpu = any(str(e.get("cat", "")).lower() in _DEVICE_CATS for e in spans)
    timeline = cls(rank=rank)
    for e in spans:
        lane = _profiler_lane(e, on_gpu)
        if lane is None:
            continue
        start = (float(e["ts"]) - t0) / 1e6
        timeline.add(e.get("name", "?"), start, start + float(e["dur"]) / 1e6, lane)
    return timeline


_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # what a GPU executed (Kineto)


def _profiler_lane(event: dict, on_gpu: bool) -> str | None:
    """``comm``, ``compute`` or None (not counted) for one profiler trace event;
    ``on_gpu``: the trace holds GPU activity, which alone is then counted."""
    name, cat = str(event.get("name", "")), str(event.get("cat", "")).lower()
    lowered = name.lower()
    if cat in _DEVICE_CATS:
        return COMM if cat == "kernel" and "nccl" in lowered else COMPUTE
    if lowered.startswith("gloo:"):
        return COMM
    if on_gpu:
        return None  # the host's side of GPU work: launches, not execution
    if lowered.startswith(("c10d::", "record_param_comms", "nccl:")):
        return None  # issuing a collective: its execution is counted above
    if cat == "cpu_op":
        return COMPUTE
    return None
