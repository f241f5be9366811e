"""Each lab's core as a script: ``python -m overlapkit lab NN`` (and under torchrun).

What a lab measures, run from the library with ``ok.launch`` — which under ``torchrun``
runs in place on torchrun's ranks, on any number of nodes — and printed as a short
table. The labs themselves stay the place to learn; this is the place to rerun their
measurements at scale::

    python -m overlapkit lab 03                                   # 2 local ranks
    torchrun --standalone --nproc-per-node 8 -m overlapkit lab 07 # 8 ranks, NCCL on GPUs
"""

from __future__ import annotations

import statistics

import torch

from . import costmodel, pingpong, runtime
from .bench.progress import median_seconds
from .bench.table import format_table
from .launcher import launch


def _lab00(world):
    sizes = [8, 1 << 10, 64 << 10, 1 << 20, 8 << 20]
    times = launch(pingpong.sweep, sizes, world_size=world)[0]
    alpha, beta = costmodel.fit_alpha_beta(sizes, times)
    rows = [{"bytes": n, "one_way_us": t * 1e6, "model_us": (alpha + n * beta) * 1e6}
            for n, t in zip(sizes, times, strict=True)]  # fmt: skip
    return rows, f"fit: α = {alpha * 1e6:.1f} µs, β → {costmodel.bandwidth_gbps(beta):.2f} GB/s"


def _collectives(nbytes):
    from . import collectives  # noqa: PLC0415

    world, device = runtime.world_size(), runtime.device()
    x = torch.ones(nbytes // 4, device=device)
    out = torch.empty(world * len(x), device=device)
    shard = torch.empty(len(x) // world or 1, device=device)
    return {
        "naive_all_reduce": median_seconds(lambda: collectives.naive_all_reduce(x.clone())),
        "ring_all_reduce": median_seconds(lambda: collectives.ring_all_reduce(x.clone())),
        "ring_all_gather": median_seconds(lambda: collectives.ring_all_gather(out, x)),
        "ring_reduce_scatter": median_seconds(
            lambda: collectives.ring_reduce_scatter(shard, x[: len(shard) * world])
        ),
    }


def _lab01_03(world):
    nbytes = 4 << 20
    times = launch(_collectives, nbytes, world_size=world)[0]
    rows = []
    for name, t in times.items():
        kind = name.split("_", 1)[1] if not name.startswith("naive") else "all_reduce"
        full = nbytes * world if kind == "all_gather" else nbytes  # S: the unsharded size
        moved = costmodel.bytes_moved_per_rank(kind, full, world)
        rows.append({"collective": name, "ms": t * 1e3, "busbw_gbps": moved / t / 1e9 if t else 0})
    return rows, f"{world} ranks, {nbytes >> 20} MiB per rank"


def _zero1(steps=5):
    from .sharded import ShardedOptimizer  # noqa: PLC0415

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    model.to(runtime.device())
    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    x = torch.randn(64, 512, device=runtime.device())

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    t = median_seconds(step, steps)
    return {"step_ms": t * 1e3, "optimizer_state_mib": opt.state_bytes() / 2**20}


def _lab04(world):
    res = launch(_zero1, world_size=world)
    full = sum(p.numel() for p in torch.nn.Sequential(
        *[torch.nn.Linear(512, 512) for _ in range(4)]).parameters()) * 8 / 2**20  # fmt: skip
    rows = [{"rank": r, **v} for r, v in enumerate(res)]
    return rows, f"Adam's state unsharded: {full:.1f} MiB per rank"


def _lab05_07(world):
    from .ddp import measure_step  # noqa: PLC0415

    rows = []
    configs = [
        {"wrapper": "naive"},
        {"wrapper": "overlap"},
        {"wrapper": "bucketed", "bucket_mb": 1},
        {"wrapper": "bucketed", "bucket_mb": 25},
    ]
    for cfg in configs:
        r = launch(measure_step, **cfg, batch=256, world_size=world)[0]
        rows.append({"wrapper": cfg["wrapper"], "bucket_mb": cfg.get("bucket_mb", "-"), **r})
    return rows, f"{world} ranks, 8 × Linear(512, 512), batch 256 per rank"


def _lab08(world):
    from .bench.pipeline import run  # noqa: PLC0415

    run(micro=(1, 4), schedules=("gpipe", "1f1b"), reps=3, torch_compare=False)
    return None, None


def _lab09(world):
    from .training import Task, train  # noqa: PLC0415

    def one(mode, **kw):
        h = train(Task(), steps=60, mode=mode, eval_every=60, **kw)
        return statistics.median(h.step_time), h.loss[-1]

    rows = []
    for mode, kw in (("sync", {}), ("stale", {"staleness": 1}), ("local", {"local_steps": 4})):
        step, loss = launch(one, mode, world_size=world, **kw)[0]
        setting = ", ".join(f"{k}={v}" for k, v in kw.items()) or "-"
        rows.append({"mode": mode, "setting": setting, "step_ms": step * 1e3, "loss": loss})
    return rows, "loss of the averaged model after 60 steps"


def _lab11(world):
    from .bench.moe import run as moe  # noqa: PLC0415
    from .bench.tp import run as tp  # noqa: PLC0415

    tp(chunks=(1, 4), reps=3, world=world)
    moe(chunks=(1, 4), reps=3, world=world)
    return None, None


def _lab12(world):
    from .bench.fsdp import run  # noqa: PLC0415

    run(units=4, width=512, batch=256, world=max(world, 2), reps=3, warmup=1)
    return None, None


def _lab13(world):
    from .bench.compression import run  # noqa: PLC0415

    run(steps=100, world=max(world, 2))
    return None, None


def _lab14(world):
    from .bench.hybrid import run  # noqa: PLC0415

    run(micro=(1, 2), reps=3, warmup=1)
    return None, None


LABS = {
    "00": ("ping-pong and the α-β fit", _lab00),
    "01": ("the kit's collectives: time and busbw", _lab01_03),
    "02": ("the kit's collectives: time and busbw", _lab01_03),
    "03": ("the kit's collectives: time and busbw", _lab01_03),
    "04": ("ZeRO-1: step time and optimizer state per rank", _lab04),
    "05": ("data-parallel steps: naive, overlapped, bucketed", _lab05_07),
    "06": ("data-parallel steps: naive, overlapped, bucketed", _lab05_07),
    "07": ("data-parallel steps: naive, overlapped, bucketed", _lab05_07),
    "08": ("pipeline schedules (2 stages)", _lab08),
    "09": ("synchronous, stale and local SGD", _lab09),
    "10": ("data-parallel steps to tune", _lab05_07),
    "11": ("decomposed tensor-parallel matmuls and the pipelined MoE", _lab11),
    "12": ("fully sharded steps: no, implicit and explicit prefetch, against DDP", _lab12),
    "13": ("compressed gradient averaging: fp16, top-k and PowerSGD, against plain", _lab13),
    "14": ("a 2 x 2 mesh: the stages' AllReduce after the flush, or in the cool-down", _lab14),
}


def run(lab: str, world: int = 2) -> list[dict] | None:
    key = f"{int(lab):02d}" if str(lab).isdigit() else str(lab)
    if key not in LABS:
        raise ValueError(f"no lab {lab!r}: choose one of {', '.join(LABS)}")
    title, core = LABS[key]
    print(f"lab {key}: {title}")
    rows, note = core(world)
    if rows is not None:
        print(format_table(rows))
    if note:
        print(note)
    return rows
