"""bench compression: synchronous training with each compressor of ``ok.compression``
against the plain ring AllReduce, over a link slow enough that communication dominates.

One launch on ``world`` ranks. The task is ``ok.training.Task`` with a wider student
(``hidden``): its gradients are n×m matrices PowerSGD can compress. Each rank first times
a step's forward and backward alone; unless ``--link`` names one, the emulated link is
then sized so that one plain ring AllReduce of every gradient takes ``--comm-share``
(default 16, about 8 × forward and backward) × that backward: communication dominates the
step, as where compression is used. Then each configuration trains ``steps`` synchronous
steps from the same start on the same batches (``ok.training.train``, the whole gradient one
bucket, averaged after backward):

* ``none``: the ring AllReduce; ``fp16``/``bf16``: ``Half``;
* ``topk 1%`` with and without error feedback: ``TopK(0.01)``;
* ``powersgd r4`` with and without error feedback: ``PowerSGD(rank=4)`` (2 plain steps
  first, warm start).

Columns: early_loss (the averaged model's evaluation loss a tenth of the way in: where
dropped gradients show first) and loss (after the last step), each also ÷ none's
(x_early, x_loss), step_ms (median of the run's steps, slowest rank) and x_step, kib_sent (what a
rank sent per step once compressing: the compressor's own count) and x_bytes,
compress_ms (compressing and decompressing per step, on the communication worker),
predicted_ms (``ok.costmodel.compressed_all_reduce`` on the link plus the compute timed
alone and the measured compress time) and its error, pays_below_gbps (the link bandwidth
below which this compressor beats none: ``ok.costmodel.compression_pays_below``).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .. import costmodel, p2p, runtime
from ..compression import Half, PowerSGD, TopK
from ..training import Task, train
from .progress import launch_with_progress
from .table import format_table, write

CONFIGS = {
    "none": lambda: None,
    "fp16": lambda: Half(torch.float16),
    "bf16": lambda: Half(torch.bfloat16),
    "topk 1%": lambda: TopK(0.01),
    "topk 1% no EF": lambda: TopK(0.01, error_feedback=False),
    "powersgd r4": lambda: PowerSGD(rank=4),
    "powersgd r4 no EF": lambda: PowerSGD(rank=4, error_feedback=False),
}
KIND = {"none": "none", "fp16": "half", "bf16": "half", "topk 1%": "topk",
        "topk 1% no EF": "topk", "powersgd r4": "powersgd",
        "powersgd r4 no EF": "powersgd"}  # fmt: skip
SETTINGS = {"topk": {"fraction": 0.01}, "powersgd": {"rank": 4}}
ALPHA = 100e-6  # the link's latency when the bench sizes it
#: lab 13's task: a teacher of 16 outputs gives high-rank gradients, so that what a
#: compressor drops shows in the loss (with one output, every compressor learns alike)
TASK = {"outputs": 16, "teacher_hidden": 64}


def _time_compute(task: Task, reps: int = 9) -> tuple[float, float]:
    """Median forward and backward seconds of one step of ``task``'s model, alone."""
    model = task.model()
    x, y = task.batch_of(task.batch, torch.Generator().manual_seed(0))
    fs, bs = [], []
    for i in range(reps + 2):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if i >= 2:
            fs.append(t1 - t0)
            bs.append(t2 - t1)
    return statistics.median(fs), statistics.median(bs)


def _size_link(backward: float, nbytes: int, world: int, share: float) -> p2p.Link:
    """A link on which a ring AllReduce of ``nbytes`` takes ``share`` × ``backward``:
    2(N−1)·α + 2(N−1)/N·S·β = share·backward."""
    total = share * backward
    alpha = min(ALPHA, total / (8 * (world - 1)))
    beta = (total - 2 * (world - 1) * alpha) / (2 * (world - 1) / world * nbytes)
    return p2p.Link(alpha * 1e6, 1 / beta / 1e9)


def _rank_bench(configs, steps, hidden, batch, share, lr, progress):
    world = runtime.world_size()
    task = Task(hidden=hidden, batch=batch, **TASK)
    shapes = [tuple(p.shape) for p in task.model().parameters()]
    nbytes = sum(torch.Size(s).numel() for s in shapes) * 4
    timed = [None] * world
    dist.all_gather_object(timed, _time_compute(task))
    forward, backward = (max(t[i] for t in timed) for i in range(2))
    link = p2p.current_link()
    if link is None:
        link = _size_link(backward, nbytes, world, share)
        p2p.set_link(link)
    out = {}
    for name in configs:
        compressor = CONFIGS[name]()
        history = train(task, steps=steps, lr=lr, mode="sync", eval_every=max(1, steps // 10),
                        all_reduce=compressor or "ring")  # fmt: skip
        step = torch.tensor([statistics.median(history.step_time)], dtype=torch.float64)
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        last = compressor.last if compressor is not None else None
        out[name] = {
            "loss": history.loss[-1],
            "step": step.item(),
            "sent": last["bytes_sent"]
            if last
            else costmodel.compressed_all_reduce("none", shapes, world, 0, 0)["bytes"],  # fmt: skip
            "compress": compressor.stats["compute_s"] / steps if compressor else 0.0,
            "early_loss": history.loss[1],
        }
        progress.tick()
    p2p.set_link(None)
    if runtime.rank() != 0:
        return None
    return {"out": out, "shapes": shapes, "link": link, "compute": (forward, backward)}


def run(steps: int = 200, hidden: int = 512, batch: int = 64, world: int = 2, link=None,
        comm_share: float = 16.0, lr: float = 0.05, configs=tuple(CONFIGS), csv_path=None,
        json_path=None) -> list[dict]:  # fmt: skip
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; choose from {', '.join(CONFIGS)}")
    if world < 2:
        raise ValueError(f"bench compression needs at least 2 ranks; got {world}")
    result = launch_with_progress(
        _rank_bench, list(configs), steps, hidden, batch, comm_share, lr,
        total=len(configs), desc="bench compression", world_size=world, link=link,
        quiet=True, timeout=3600,
    )[0]  # fmt: skip
    link, shapes, (forward, backward) = result["link"], result["shapes"], result["compute"]
    out = result["out"]
    plain = costmodel.compressed_all_reduce("none", shapes, world, link.alpha, link.beta)
    mib = sum(torch.Size(s).numel() for s in shapes) * 4 / 2**20
    print(
        f"model: Task(hidden={hidden}, outputs={TASK['outputs']}) MLP, {mib:.2f} MiB of "
        f"gradients, batch {batch} per rank, {world} ranks, {steps} steps; {link}: one "
        f"plain AllReduce {plain['time'] * 1e3:.1f} ms, forward {forward * 1e3:.1f} ms, "
        f"backward {backward * 1e3:.1f} ms"
    )
    base = out.get("none")
    rows = []
    for name in configs:
        r = out[name]
        kind = KIND[name]
        settings = SETTINGS.get(kind, {})
        model = costmodel.compressed_all_reduce(kind, shapes, world, link.alpha, link.beta,
                                                r["compress"], **settings)  # fmt: skip
        predicted = forward + backward + model["time"]
        rows.append({
            "config": name,
            "early_loss": r["early_loss"],
            "x_early": r["early_loss"] / base["early_loss"] if base else float("nan"),
            "loss": r["loss"],
            "x_loss": r["loss"] / base["loss"] if base else float("nan"),
            "step_ms": r["step"] * 1e3,
            "x_step": r["step"] / base["step"] if base else float("nan"),
            "kib_sent": r["sent"] / 1024,
            "x_bytes": r["sent"] / base["sent"] if base else float("nan"),
            "compress_ms": r["compress"] * 1e3,
            "predicted_ms": predicted * 1e3,
            "pred_err": (predicted - r["step"]) / r["step"],
            "pays_below_gbps": float("nan") if kind == "none" else (
                costmodel.compression_pays_below(kind, shapes, world, link.alpha,
                                                 r["compress"], **settings)),  # fmt: skip
        })  # fmt: skip
    print(format_table(rows))
    meta = {"bench": "compression", "steps": steps, "hidden": hidden, "batch": batch,
            "world": world, "link": str(link), "lr": lr}  # fmt: skip
    write(rows, csv_path, json_path, meta=meta)
    return rows
