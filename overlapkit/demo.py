"""python -m overlapkit demo: a one-minute tour.

1. start 4 ranks from Python and hear from each;
2. ping-pong between 2 ranks, 8 B to 8 MB, and fit α and β;
3. one training-like step twice — AllReduce after the compute, then AllReduce
   *during* the compute — on a timeline picture, with the overlap ratio.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from . import costmodel, pingpong, runtime
from .bench.table import format_table
from .launcher import launch
from .timeline import COMM, Timeline


def _hello():
    return {
        "rank": runtime.rank(),
        "pid": os.getpid(),
        "backend": runtime.backend(),
        "device": str(runtime.device()),
        "threads": torch.get_num_threads(),
    }


def _sweep(sizes):
    return pingpong.sweep(sizes, iters=8, warmup=2)


def _step(overlap: bool, steps: int = 3, grad_mb: float = 16.0, work: int = 12):
    """A stand-in for backward (matmuls) and a gradient AllReduce, serial or overlapped."""
    tl = Timeline()
    x = torch.randn(320, 320, device=runtime.device())
    grad = torch.ones(int(grad_mb * 2**20 / 4), device=runtime.device())
    dist.barrier()
    for i in range(steps):
        if overlap:  # start the AllReduce, compute while it runs, then wait for it
            handle = tl.track(f"allreduce {i}", dist.all_reduce(grad, async_op=True), COMM)
        with tl.span(f"compute {i}"):
            for _ in range(work):
                x = torch.tanh(x @ x)
        if not overlap:
            handle = tl.track(f"allreduce {i}", dist.all_reduce(grad, async_op=True), COMM)
        handle.wait()
    return tl


def run(out: str = "overlapkit-demo.png", world: int = 4) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t_start = time.perf_counter()
    print(f"1. {world} ranks, started from this process")
    print(format_table(launch(_hello, world_size=world)))

    print("\n2. ping-pong between 2 ranks (one-way time, median of 8)")
    sizes = pingpong.default_sizes(8, 8 << 20)
    times = launch(_sweep, sizes, world_size=2)[0]
    alpha, beta = costmodel.fit_alpha_beta(sizes, times)
    rows = [
        {
            "bytes": n,
            "one_way_us": t * 1e6,
            "GB/s": n / t / 1e9,
            "model_us": costmodel.message_time(n, alpha, beta) * 1e6,
        }
        for n, t in zip(sizes, times, strict=True)
    ]
    print(format_table(rows))
    print(
        f"fit: α = {alpha * 1e6:.1f} µs, bandwidth 1/β = {costmodel.bandwidth_gbps(beta):.2f} GB/s"
    )

    print("\n3. the same step, AllReduce after the compute vs during it (2 ranks)")
    serial = Timeline.merge(launch(_step, False, world_size=2))
    overlapped = Timeline.merge(launch(_step, True, world_size=2))
    fig, axes = plt.subplots(2, 1, figsize=(10, 6.2), sharex=True)
    serial.plot(ax=axes[0], title=f"serial: step time {serial.wall() * 1e3:.0f} ms", legend=False)
    overlapped.plot(ax=axes[1], title=f"overlapped: step time {overlapped.wall() * 1e3:.0f} ms")
    axes[0].set_xlim(0, max(serial.wall(), overlapped.wall()) * 1e3 * 1.01)  # one scale for both
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    table = []
    for name, tl in (("serial", serial), ("overlapped", overlapped)):
        table.append(
            {
                "schedule": name,
                "wall_ms": tl.wall() * 1e3,
                "compute_ms": tl.busy("compute", 0) * 1e3,
                "comm_ms": tl.busy(COMM, 0) * 1e3,
                "overlap_ratio": tl.overlap_ratio(),
                "hidden": tl.hidden_fraction(),
            }
        )
    print(format_table(table))
    saved = 1 - overlapped.wall() / serial.wall()
    slowdown = overlapped.busy("compute", 0) / serial.busy("compute", 0)
    print(f"overlapping {'saved' if saved >= 0 else 'lost'} {abs(saved):.0%} of the step time;")
    print(
        f"the same compute took {slowdown:.2f}x as long while communication ran beside it.\n"
        "On a CPU, gloo moves bytes with the same cores that compute (contention), so overlap\n"
        "pays only as far as cores are free; on GPUs NCCL uses copy engines and a few SMs."
    )
    print(f"\ntimeline picture: {os.path.abspath(out)}")
    print(f"demo took {time.perf_counter() - t_start:.1f} s")
    return out
