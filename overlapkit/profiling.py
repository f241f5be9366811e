"""Each rank's ``torch.profiler`` trace of a launch, brought back to the caller.

    traces = ok.profiling.ProfileRanks("traces/")
    ok.launch(step, world_size=2, hook=traces)
    traces.paths                      # {0: "traces/rank0.json", 1: "traces/rank1.json"}
    traces.timelines()[0].hidden_fraction()

What ran on each rank, as the profiler saw it, beside the kit's own timelines: the
traces open in Perfetto or ``chrome://tracing``, and :meth:`Timeline.from_profiler`
reads them into compute and communication lanes. A rank sends its trace's file name to
the caller on its channel the moment the trace is written, so a rank that fails later
still leaves its trace. Built on :class:`overlapkit.RankHook`.
"""

from __future__ import annotations

import contextlib
import json
import os

from . import rankhook
from .timeline import Timeline


class ProfileRanks(rankhook.RankHook):
    """Profile ``fn`` on every rank of a launch; ``folder`` gets one trace per rank
    (``rank{r}.json``), ``cuda`` adds the GPU's kernels (default: where CUDA is available)."""

    def __init__(self, folder: str | os.PathLike, cuda: bool | None = None):
        self.folder = os.fspath(folder)
        self.cuda = cuda
        #: rank -> the path of its trace, once the launch has ended
        self.paths: dict[int, str] = {}

    def around(self) -> contextlib.AbstractContextManager:
        return self._profiled()

    @contextlib.contextmanager
    def _profiled(self):
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        cuda = torch.cuda.is_available() if self.cuda is None else self.cuda
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        rank = dist.get_rank() if dist.is_initialized() else 0
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"rank{rank}.json")
        with torch.profiler.profile(activities=activities) as prof:
            yield
        prof.export_chrome_trace(path)
        where = json.dumps({"rank": rank, "path": os.path.abspath(path)}).encode()
        conn = rankhook.channel()
        if conn is not None:
            conn.send_bytes(where)
        else:  # run in place (torchrun): this object is the caller's own
            self.paths[rank] = os.path.abspath(path)

    def heard(self, by_rank: dict[int, list[bytes]], garbled: set[int]) -> None:
        for messages in by_rank.values():
            for message in messages:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    sent = json.loads(message)
                    self.paths[int(sent["rank"])] = str(sent["path"])

    def timelines(self) -> dict[int, Timeline]:
        """Each rank's trace read as a :class:`Timeline` (``Timeline.from_profiler``)."""
        return {r: Timeline.from_profiler(p, rank=r) for r, p in sorted(self.paths.items())}
