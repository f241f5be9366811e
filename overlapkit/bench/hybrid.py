"""bench hybrid: a 2-D mesh (data parallel × pipeline) on 4 ranks, each stage's gradient
AllReduce started after the pipeline's flush, after the stage's own last backward, or
overlapped with the other stages' cool-down (``ok.hybrid``).

One launch on ``dp · pp`` ranks. Each stage is ``layers`` blocks of Linear(width, width) +
Tanh (one bucket each); each replica gets ``batch`` samples in ``micro`` micro-batches
(1F1B). First every rank times its stage's forward and backward of one micro-batch, one
stage at a time (as in the pipeline's warm-up and cool-down; the model slows them where
stages compute at once on too few cores: 4 ranks on 2); unless ``--link`` names one, the
emulated link is then sized so that one stage's AllReduce over its replicas takes
``--share`` (default 1.0) of the pipeline's cool-down: the first stage's last backward plus
the transfer of its input gradient, what a later stage's AllReduce can hide under. Then
every configuration runs, interleaved, ``reps`` rounds after ``warmup``:

* ``flush``: every stage waits for the whole pipeline (a barrier of its pp group), then
  reduces: the AllReduce is all exposed;
* ``after``: each stage reduces once its own last backward is done (none during it);
* ``overlap``: the first stage launches each bucket as its last backward fills it, the
  later ones as soon as that backward's gradient is on its way.

Columns: step_ms (median of the slowest rank), x_flush, dp_hidden (share of the data-
parallel AllReduce time during which some rank of the same pipeline computed),
dp_exposed_ms (step − the same step's pipeline end), pp_hidden (the pipeline transfers'
share under compute), predicted_ms (``ok.costmodel.hybrid_step`` from the stage timed
alone, the link's α-β, the bucket count and the cores shared) and its error, and
limit: "link" where the
AllReduce took at most 1.5× its α-β time, "machine" where the host's copies and threads
on shared cores made it slower. Below: the hot-spot table of the overlapped step (which
group's transfers are exposed on which rank).
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from .. import costmodel, hybrid, p2p, runtime
from ..pipeline import make_schedule
from ..timeline import COMPUTE, Timeline, intersect, length, union
from .pictures import median_steps
from .progress import launch_with_progress, slowest
from .table import format_table, write

CONFIGS = ("flush", "after", "overlap")
PICTURED = ("flush", "overlap")
ALPHA = 100e-6  # the link's latency when the bench sizes it


def make_stage(layers: int, width: int, seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)  # the same stage on every replica
    return torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
            for _ in range(layers)
        ]
    )


def _time_stage(stage: torch.nn.Module, micro: int, width: int, mesh, reps: int = 5):
    """(forward, backward) seconds of one micro-batch through this stage, medians, timed
    while only this stage's ranks compute (one stage after the other), as in the pipeline's
    warm-up and cool-down; ``costmodel.pipeline_on_cores`` slows them where stages compute
    at once on too few cores. (A first stage's input needs no gradient.)"""
    x = torch.randn(micro, width, requires_grad=mesh.stage > 0)
    fwd, bwd = [], []
    for _ in range(reps + 1):
        for turn in range(mesh.pp):
            dist.barrier()
            if turn != mesh.stage:
                continue
            t0 = time.perf_counter()
            y = stage(x)
            t1 = time.perf_counter()
            y.backward(torch.ones_like(y))
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)
    dist.barrier()
    stage.zero_grad(set_to_none=True)
    return statistics.median(fwd[1:]), statistics.median(bwd[1:])


def _size_link(backward: float, act_bytes: int, stage_bytes: int, dp: int, share: float):
    """A link on which a stage's ring AllReduce over ``dp`` replicas takes ``share`` × the
    cool-down (the first stage's last backward + one activation gradient's transfer):
    2(N−1)(α + S/N·β) = share·(backward + α + A·β)."""
    steps = 2 * (dp - 1)
    beta = (share * (backward + ALPHA) - steps * ALPHA) / (
        steps * stage_bytes / dp - share * act_bytes
    )
    if beta <= 0:
        raise ValueError("bench hybrid: no link makes the AllReduce that short; lower --share")
    return p2p.Link(ALPHA * 1e6, 1 / beta / 1e9)


def _rank_bench(dp, pp, layers, width, batch, micro, reps, warmup, share, progress):
    mesh = hybrid.make_mesh(dp, pp)
    stage = make_stage(layers, width, seed=mesh.stage)
    per_micro = -(-batch // micro)
    fwd, bwd = _time_stage(stage, per_micro, width, mesh)
    times = [None] * runtime.world_size()
    dist.all_gather_object(times, (mesh.stage, fwd, bwd))
    forward = [max(f for s, f, _ in times if s == k) for k in range(pp)]
    backward = [max(b for s, _, b in times if s == k) for k in range(pp)]
    stage_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    act_bytes = per_micro * width * 4
    link = p2p.current_link()
    if link is None:
        link = _size_link(backward[0], act_bytes, stage_bytes, dp, share)
        p2p.set_link(link)
    layer_mb = (width * width + width) * 4 / 2**20
    hs = hybrid.HybridStage(stage, mesh, bucket_mb=layer_mb * 1.001)
    opt = torch.optim.SGD(hs.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1000 + mesh.replica)
    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch, width, generator=g)
    loss = torch.nn.functional.mse_loss
    out: dict = {c: [] for c in CONFIGS}  # config -> [(step seconds, this rank's timeline)]
    for i in range(warmup + reps):
        for c in CONFIGS:
            tl = Timeline()
            dist.barrier()
            start = time.perf_counter()
            hs.step(x if mesh.stage == 0 else None, y if mesh.stage == pp - 1 else None,
                        loss, micro_batches=micro, dp_start=c, timeline=tl)  # fmt: skip
            end = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step = slowest(start, end)
            if i >= warmup:
                out[c].append((step, tl))
            progress.tick()
    p2p.set_link(None)
    everyone = [None] * runtime.world_size()
    dist.all_gather_object(everyone, (mesh.pp_ranks, out))
    if runtime.rank() != 0:
        return None
    pipelines = {r: ranks for ranks, _ in everyone for r in ranks}
    merged = {c: [Timeline.merge(o[c][i][1] for _, o in everyone) for i in range(reps)]
              for c in CONFIGS}  # fmt: skip
    return {"steps": {c: [s for s, _ in out[c]] for c in CONFIGS}, "merged": merged,
            "pipelines": pipelines, "forward": forward, "backward": backward,
            "stage_bytes": stage_bytes, "act_bytes": act_bytes, "link": link,
            "pictured": {c: [[o[c][i][1] for _, o in everyone] for i in range(reps)]
                         for c in PICTURED}}  # fmt: skip


def _pipe_end(tl: Timeline) -> float:
    """When the pipeline's last action ended (every rank's compute and pp transfers)."""
    return max(s.end for s in tl.spans if s.lane in (COMPUTE, hybrid.PP_LANE))


def _measured(tl: Timeline, pipelines: dict) -> dict:
    reduce = [s for s in tl.spans if s.lane == hybrid.DP_LANE]
    end = max(s.end for s in tl.spans)
    pp = union((s.start, s.end) for s in tl.spans if s.lane == hybrid.PP_LANE)
    work = union((s.start, s.end) for s in tl.spans if s.lane == COMPUTE)
    per_rank = {}
    for s in reduce:
        per_rank.setdefault(s.rank, []).append((s.start, s.end))
    return {
        "dp_hidden": hybrid.dp_hidden(tl, pipelines),
        "dp_exposed": max(0.0, end - _pipe_end(tl)),
        "pp_hidden": length(intersect(pp, work)) / length(pp) if pp else float("nan"),
        # the rank that joined its AllReduce last waited for nobody: its time is the transfer's
        "reduce_busy": min(length(union(v)) for v in per_rank.values()) if per_rank else 0.0,
    }


def run(dp: int = 2, pp: int = 2, layers: int = 8, width: int = 768, batch: int = 1024,
        micro=(1, 2), link=None, share: float = 1.0, reps: int = 5, warmup: int = 2,
        csv_path=None, json_path=None, png_path=None, trace_path=None) -> list[dict]:  # fmt: skip
    """One launch per micro-batch count in ``micro``; rows for each."""
    micros = [micro] if isinstance(micro, int) else list(micro)
    if dp < 2 or pp < 2:
        raise ValueError(f"bench hybrid needs dp ≥ 2 and pp ≥ 2 (two kinds of traffic); got "
                         f"dp={dp}, pp={pp}")  # fmt: skip
    if not micros or any(m < 1 or m > batch for m in micros):
        raise ValueError(f"--micro: counts between 1 and the batch ({batch}); got {micros}")
    rows: list[dict] = []
    for k, m in enumerate(micros):
        rows += _one(dp, pp, layers, width, batch, m, link, share, reps, warmup,
                     png_path if k == 0 else None, trace_path if k == 0 else None)  # fmt: skip
    if len(micros) > 1:
        print(format_table(rows))
    meta = {"bench": "hybrid", "dp": dp, "pp": pp, "layers": layers, "width": width,
            "batch": batch, "micro": micros}  # fmt: skip
    write(rows, csv_path, json_path, meta=meta)
    return rows


def _one(dp, pp, layers, width, batch, micro, link, share, reps, warmup, png_path,
         trace_path) -> list[dict]:  # fmt: skip
    result = launch_with_progress(
        _rank_bench, dp, pp, layers, width, batch, micro, reps, warmup, share,
        total=len(CONFIGS) * (warmup + reps), desc=f"bench hybrid, {micro} micro-batch(es)",
        world_size=dp * pp, link=link, quiet=True, timeout=1800,
    )[0]  # fmt: skip
    link, fwd, bwd = result["link"], result["forward"], result["backward"]
    nbytes, act = result["stage_bytes"], result["act_bytes"]
    transfer = link.message_time(act)
    reduce = costmodel.ring_all_reduce(nbytes, dp, link.alpha, link.beta)
    cool_down = bwd[0] + transfer
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        f"mesh {dp} × {pp} (dp × pp) on {dp * pp} ranks; each stage {layers} × Linear({width}, "
        f"{width}) + Tanh ({nbytes / 2**20:.1f} MiB, {layers} buckets); {batch} samples per "
        f"replica in {micro} micro-batches (1F1B); {link}"
    )
    print(
        "one micro-batch, timed with one stage computing at a time: forward "
        + ", ".join(f"stage {s} {f * 1e3:.1f} ms" for s, f in enumerate(fwd))
        + "; backward "
        + ", ".join(f"stage {s} {b * 1e3:.1f} ms" for s, b in enumerate(bwd))
        + f"; one activation's transfer {transfer * 1e3:.1f} ms; a stage's AllReduce "
        f"{reduce * 1e3:.1f} ms against a cool-down of {cool_down * 1e3:.1f} ms; the model "
        f"shares {cores} cores among the {dp * pp} ranks"
    )
    schedule = make_schedule("1f1b", pp, micro)
    rows = []
    base = statistics.median(result["steps"]["flush"])
    for c in CONFIGS:
        steps = result["steps"][c]
        step = statistics.median(steps)
        got = [_measured(tl, result["pipelines"]) for tl in result["merged"][c]]
        predicted = costmodel.hybrid_step(
            schedule, fwd, bwd, transfer, reduce, c, buckets=layers, replicas=dp, cores=cores
        )["step"]
        busy = statistics.median(g["reduce_busy"] for g in got)
        rows.append({
            "micro": micro,
            "config": c,
            "step_ms": step * 1e3,
            "min_max_ms": f"{min(steps) * 1e3:.0f}-{max(steps) * 1e3:.0f}",
            "x_flush": step / base,
            "dp_hidden": statistics.median(g["dp_hidden"] or 0.0 for g in got),
            "dp_exposed_ms": statistics.median(g["dp_exposed"] for g in got) * 1e3,
            "pp_hidden": statistics.median(g["pp_hidden"] for g in got),
            "predicted_ms": predicted * 1e3,
            "pred_err": (predicted - step) / step,
            "reduce_ms": busy * 1e3,
            "limit": "link" if busy <= 1.5 * reduce else "machine",
        })  # fmt: skip
    print(format_table(rows))
    over = rows[-1]
    print(
        f"{micro} micro-batch(es), overlapped: step {over['x_flush']:.2f}× flush-then-AllReduce, "
        f"{over['dp_hidden']:.0%} of the data-parallel AllReduce hidden under the pipeline, "
        f"prediction {over['pred_err']:+.0%}"
    )
    steps = result["steps"]["overlap"]
    typical = sorted(range(len(steps)), key=steps.__getitem__)[len(steps) // 2]
    tl = result["merged"]["overlap"][typical]
    print("hot spots of the median overlapped step (time on the rank's pipeline: "
          "hidden = some stage of it computing):")  # fmt: skip
    print(format_table(hybrid.hot_spots(tl, result["pipelines"])))
    if png_path:
        median_steps(result["steps"], result["pictured"], PICTURED, png_path)
        print(f"timelines of the median flush and overlapped steps: {png_path}")
    if trace_path:
        tl.to_chrome_trace(trace_path)
        print(f"Perfetto trace of the median overlapped step: {trace_path}")
    for r in rows:
        r["link"] = str(link)
    return rows
