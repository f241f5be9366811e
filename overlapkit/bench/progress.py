"""A progress bar for benchmarks that run inside ``ok.launch``: rank 0 ticks a file, the
parent's bar follows it (rank output is shown only after a launch ends)."""

from __future__ import annotations

import os
import sys
import tempfile
import threading

from tqdm.auto import tqdm

from .. import runtime
from ..launcher import launch


class Progress:
    """Handed to the ranks: ``tick()`` on rank 0 advances the parent's bar by one."""

    def __init__(self, path: str | None):
        self.path = path

    def tick(self) -> None:
        if self.path and runtime.rank() == 0:
            with open(self.path, "a") as f:
                f.write(".")


def _follow(path: str, bar: tqdm, stop: threading.Event) -> None:
    seen, last = 0, False
    while not last:
        last = stop.wait(0.2)  # once stopped, one more read: the ticks of the last moments
        try:
            size = os.path.getsize(path)
        except OSError:
            continue
        if size > seen:
            bar.update(size - seen)
            seen = size


def launch_with_progress(fn, *args, total: int, desc: str, **launch_kwargs):
    """``ok.launch(fn, *args, Progress(...), **launch_kwargs)`` (the progress handle is
    the last positional argument) with a tqdm bar of ``total`` steps on stderr."""
    path = tempfile.NamedTemporaryFile(prefix="overlapkit-bench-", delete=False)
    path.close()
    stop = threading.Event()
    # under torchrun every process runs the bench: rank 0's bar is the one to show
    hidden = os.environ.get("RANK", "0") != "0"
    with tqdm(total=total, desc=desc, unit="step", file=sys.stderr, disable=hidden) as bar:
        follower = threading.Thread(target=_follow, args=(path.name, bar, stop), daemon=True)
        follower.start()
        try:
            return launch(fn, *args, Progress(path.name), **launch_kwargs)
        finally:
            stop.set()
            follower.join()
            os.unlink(path.name)


def slowest(start: float, end: float, device=None) -> float:
    """Seconds of one iteration across the ranks, from what each rank measured: the ranks of
    one ``ok.launch`` share the machine's monotonic clock, so it runs from the moment the
    last rank started to the moment the last rank ended; elsewhere (torchrun across
    machines) it is the slowest rank's own time. A collective on the default group."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    marks = torch.tensor([start, end] if "OVERLAPKIT_RANK" in os.environ else [0.0, end - start],
                         dtype=torch.float64, device=device)  # fmt: skip
    dist.all_reduce(marks, op=dist.ReduceOp.MAX)
    return (marks[1] - marks[0]).item()


def median_seconds(fn, reps: int = 5) -> float:
    """Median seconds of ``fn()`` on this rank, after one untimed call (GPU work finished
    before each reading of the clock)."""
    import statistics  # noqa: PLC0415
    import time  # noqa: PLC0415

    fn()
    times = []
    for _ in range(reps):
        runtime.synchronize()
        start = time.perf_counter()
        fn()
        runtime.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def slowest_value(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (a collective on the default group)."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    t = torch.tensor([seconds], dtype=torch.float64, device=runtime.device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
