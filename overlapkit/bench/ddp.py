"""bench ddp: naive, per-parameter and bucketed data parallelism against PyTorch's DDP.

One launch on ``world`` ranks does it all, so every configuration meets the
same machine: it sizes a stack of ``layers`` Linear+ReLU layers' batch so that
backward takes about as long as one AllReduce of all its gradients (what makes
overlap matter), measures when each gradient becomes ready
(``ok.profile_backward``) and what one AllReduce costs beyond the α-β model
(``per_op``), then runs the configurations interleaved, ``reps`` rounds after
``warmup`` rounds:

* ``naive``, ``overlap``: ``ok.NaiveDDP``, ``ok.OverlapDDP``;
* ``bucketed``: ``ok.BucketedDDP`` at each bucket size of the sweep;
* ``torch``: PyTorch's ``DistributedDataParallel`` at the same ``bucket_cap_mb``;
  under ``--link`` with the kit's comm hook (``ok.ddp_comm_hook``), so both reduce
  with the kit's ring over the same emulated link; without a link both use gloo's
  built-in AllReduce.

Columns: step_ms (median over rounds of the slowest rank's step: forward,
backward, synchronisation, optimizer), comm_ms (time with an AllReduce in flight),
hidden (share of that time under forward/backward compute), overlap (the lecture
notes' ratio (T_comp + T_comm − T_wall)/T_comm), predicted_ms
(``ok.costmodel.ddp_step`` from the profile, the link and per_op, plus the measured
optimizer step) and its error, x_naive (step ÷ NaiveDDP's step) and x_torch (step ÷
PyTorch DDP's at the same cap). PyTorch's hidden share is not shown: its backward
returns only after its reducer has waited for every bucket, so its compute cannot
be told apart from its waiting.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from .. import costmodel, ddp, p2p, runtime
from ..collectives import ring_all_reduce
from ..launcher import launch
from ..timeline import COMM, COMPUTE, Timeline
from .table import format_table, write


def make_model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def _reducer(link):
    """The AllReduce every kit configuration uses: the ring over the link, else the built-in."""
    return "ring" if link is not None else None


def _time_all_reduce(nbytes: int, link, reps: int = 5) -> tuple[float, float]:
    """Median wall time of one AllReduce of ``nbytes``, and the CPU time (all of this
    rank's threads) it took."""
    buf = torch.zeros(max(1, nbytes // 4))
    samples, cpu = [], []
    for i in range(reps + 1):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        if link is not None:
            ring_all_reduce(buf)
        else:
            dist.all_reduce(buf)
        if i:
            samples.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return statistics.median(samples), statistics.median(cpu)


def _calibrate(model, width: int, link, batch: int | None):
    """Pick the batch so that backward ≈ one AllReduce of every gradient; returns
    (batch, full AllReduce time, small AllReduce time, CPU time of the full one)."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    full, full_cpu = _time_all_reduce(nbytes, link)
    small, _ = _time_all_reduce(4096, link, reps=9)
    if batch is None:
        probe = 64
        x = torch.randn(probe, width)
        prof = ddp.profile_backward(model, lambda m: m(x).square().mean(), repeats=3)
        per_sample = prof.backward / probe
        wanted = torch.tensor([max(8, round(full / per_sample))], dtype=torch.float64)
        dist.broadcast(wanted, src=0)  # every rank trains on the same batch size
        batch = int(wanted.item())
    return batch, full, small, full_cpu


class _Progress:
    """Rank 0 appends a line per finished step to a file that the parent's bar follows."""

    def __init__(self, path):
        self.path = path

    def tick(self):
        if self.path and runtime.rank() == 0:
            with open(self.path, "a") as f:
                f.write(".")


def _configs(bucket_sweep, torch_ddp: bool):
    configs = [("naive", None), ("overlap", None)]
    configs += [("bucketed", mb) for mb in bucket_sweep]
    if torch_ddp:
        configs += [("torch", mb) for mb in bucket_sweep]
    return configs


def _build(kind, mb, layers, width, link, timeline):
    model = make_model(layers, width)
    reducer = _reducer(link)
    if kind == "naive":
        return ddp.NaiveDDP(model, all_reduce=reducer, timeline=timeline)
    if kind == "overlap":
        return ddp.OverlapDDP(model, all_reduce=reducer, timeline=timeline)
    if kind == "bucketed":
        return ddp.BucketedDDP(model, bucket_mb=mb, all_reduce=reducer, timeline=timeline)
    wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=mb)
    if link is not None:
        wrapped.register_comm_hook(None, ddp.ddp_comm_hook(timeline=timeline))
    return wrapped


def _rank_bench(layers, width, bucket_sweep, reps, warmup, batch, torch_ddp, progress_path):
    link = p2p.current_link()
    world = runtime.world_size()
    progress = _Progress(progress_path)
    batch, full, small, full_cpu = _calibrate(make_model(layers, width), width, link, batch)
    gen = torch.Generator().manual_seed(runtime.rank())
    x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)
    model = make_model(layers, width)
    profile = ddp.profile_backward(model, lambda m: torch.nn.functional.mse_loss(m(x), y))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt_samples = []
    for _ in range(5):
        start = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        opt_samples.append(time.perf_counter() - start)
    configs = _configs(bucket_sweep, torch_ddp)
    timelines = {c: Timeline() for c in configs}
    wrappers = {c: _build(*c, layers, width, link, timelines[c]) for c in configs}
    optimizers = {c: torch.optim.SGD(w.parameters(), lr=1e-4) for c, w in wrappers.items()}
    steps = {c: [] for c in configs}
    marks = torch.zeros(2, dtype=torch.float64)
    shared_clock = "OVERLAPKIT_RANK" in os.environ
    last_round = {}
    for i in range(warmup + reps):
        for c in configs:
            w, opt = wrappers[c], optimizers[c]
            tl = timelines[c]
            dist.barrier()
            n_before = len(tl.spans)
            start = time.perf_counter()
            loss = torch.nn.functional.mse_loss(w(x), y)
            if c[0] == "torch":
                b0 = time.perf_counter()
                loss.backward()  # PyTorch's reducer waits for its buckets inside backward
                tl.add("forward+backward", start, b0, COMPUTE)
            else:
                loss.backward()
                w.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad(set_to_none=True)
            end = time.perf_counter()
            marks[0], marks[1] = (start, end) if shared_clock else (0.0, end - start)
            dist.all_reduce(marks, op=dist.ReduceOp.MAX)
            if i >= warmup:
                steps[c].append((marks[1] - marks[0]).item())
                last_round[c] = Timeline(spans=tl.spans[n_before:])
            progress.tick()
    if runtime.rank() != 0:
        return None
    rows = []
    for c in configs:
        tl = last_round[c]
        comm = [s for s in tl.spans if s.lane == COMM]
        rows.append(
            {
                "config": c,
                "step": statistics.median(steps[c]),
                "comm": _union_length(comm),
                "hidden": None if c[0] == "torch" else tl.hidden_fraction(),
                "overlap": None if c[0] == "torch" else tl.overlap_ratio(),
                "buckets": len(wrappers[c].buckets) if c[0] != "torch" else None,
            }
        )
    return {
        "rows": rows,
        "batch": batch,
        "world": world,
        "profile": profile,
        "optimizer": statistics.median(opt_samples),
        "full": full,
        "small": small,
        "comm_cpu": full_cpu,
    }


def _union_length(spans) -> float:
    from ..timeline import length

    return length((s.start, s.end) for s in spans)


def _follow(path: str, bar: tqdm, stop: threading.Event) -> None:
    seen = 0
    while not stop.wait(0.2):
        try:
            size = os.path.getsize(path)
        except OSError:
            continue
        if size > seen:
            bar.update(size - seen)
            seen = size


def _model_terms(result, link):
    """α, β and per-op cost for the prediction: the link's own α and β plus what one small
    AllReduce costs beyond them; without a link, fitted from the small and the full one."""
    world, small, full = result["world"], result["small"], result["full"]
    total = result["profile"].total_bytes
    if link is not None:
        per_op = max(0.0, small - costmodel.ring_all_reduce(4096, world, link.alpha, link.beta))
        return link.alpha, link.beta, per_op
    factor = costmodel.BUSBW_FACTOR["all_reduce"](world)
    beta = max(0.0, full - small) / (factor * max(1, total - 4096))
    return 0.0, beta, small


def run(
    layers: int = 16,
    width: int = 256,
    world: int = 2,
    link=None,
    bucket_sweep=costmodel.BUCKET_SWEEP_MB,
    reps: int = 5,
    warmup: int = 2,
    batch: int | None = None,
    torch_ddp: bool = True,
    csv_path=None,
    json_path=None,
) -> list[dict]:
    if layers < 1 or width < 1:
        raise ValueError(f"layers and width must be positive, got {layers} and {width}")
    if any(not mb > 0 for mb in bucket_sweep):
        raise ValueError(f"bucket sizes must be positive MiB, got {list(bucket_sweep)}")
    total = len(_configs(bucket_sweep, torch_ddp)) * (warmup + reps)
    progress = tempfile.NamedTemporaryFile(prefix="overlapkit-bench-ddp-", delete=False)
    progress.close()
    stop = threading.Event()
    with tqdm(total=total, desc="bench ddp", unit="step", file=sys.stderr) as bar:
        follower = threading.Thread(target=_follow, args=(progress.name, bar, stop), daemon=True)
        follower.start()
        try:
            result = launch(
                _rank_bench, layers, width, list(bucket_sweep), reps, warmup, batch, torch_ddp,
                progress.name, world_size=world, link=link, quiet=True, timeout=1800,
            )[0]  # fmt: skip
        finally:
            stop.set()
            follower.join()
            os.unlink(progress.name)
    profile = result["profile"]
    alpha, beta, per_op = _model_terms(result, link)
    comm_cpu = result["comm_cpu"]
    print(
        f"model: {layers} × Linear({width}, {width}) + ReLU, {profile.total_bytes / 2**20:.2f} MiB "
        f"of gradients, batch {result['batch']} per rank, {world} ranks, "
        f"{'the kit ring over ' + str(link) if link else 'gloo built-in AllReduce, no link'}"
    )
    print(
        f"measured once: forward {profile.forward * 1e3:.2f} ms, backward "
        f"{profile.backward * 1e3:.2f} ms, optimizer {result['optimizer'] * 1e3:.2f} ms, one "
        f"AllReduce of all gradients {result['full'] * 1e3:.2f} ms, of 4 KiB "
        f"{result['small'] * 1e3:.3f} ms (per_op = {per_op * 1e3:.3f} ms beyond α-β); the "
        f"full one takes {comm_cpu * 1e3:.2f} ms of CPU, which overlapped backward shares"
    )
    naive_step = next(r["step"] for r in result["rows"] if r["config"][0] == "naive")
    torch_step = {r["config"][1]: r["step"] for r in result["rows"] if r["config"][0] == "torch"}
    rows = []
    for r in result["rows"]:
        kind, mb = r["config"]
        strategy = "bucketed" if kind == "torch" else kind
        model = costmodel.ddp_step(profile.ready, profile.forward, profile.backward, world,
                                   alpha, beta, strategy, mb, per_op, comm_cpu)  # fmt: skip
        predicted = model["step"] + result["optimizer"]
        rows.append(
            {
                "config": kind,
                "bucket_mb": mb if mb is not None else float("nan"),
                "buckets": r["buckets"] if r["buckets"] is not None else model["buckets"],
                "step_ms": r["step"] * 1e3,
                "comm_ms": r["comm"] * 1e3 if r["comm"] else float("nan"),
                "hidden": r["hidden"] if r["hidden"] is not None else float("nan"),
                "overlap": r["overlap"] if r["overlap"] is not None else float("nan"),
                "predicted_ms": predicted * 1e3,
                "pred_err": (predicted - r["step"]) / r["step"],
                "x_naive": r["step"] / naive_step,
                "x_torch": r["step"] / torch_step[mb] if mb in torch_step else float("nan"),
            }
        )
    print(format_table(rows))
    ours = [r for r in rows if r["config"] != "torch"]
    best = min(ours, key=lambda r: r["step_ms"])
    bucketed = [r for r in rows if r["config"] == "bucketed"]
    predicted_best = costmodel.best_bucket_mb(profile.ready, profile.forward, profile.backward,
                                              world, alpha, beta, per_op, comm_cpu,
                                              bucket_sweep)  # fmt: skip
    if bucketed:
        measured_best = min(bucketed, key=lambda r: r["step_ms"])
        sweep = list(bucket_sweep)
        apart = abs(sweep.index(measured_best["bucket_mb"]) - sweep.index(predicted_best))
        print(
            f"best bucket size: measured {measured_best['bucket_mb']:g} MiB "
            f"({measured_best['step_ms']:.1f} ms), predicted {predicted_best:g} MiB "
            f"({apart} sweep point{'s' if apart != 1 else ''} apart)"
        )
    label = best["config"] + (f" {best['bucket_mb']:g} MiB" if best["config"] == "bucketed" else "")
    print(
        f"best configuration: {label}: {best['step_ms']:.1f} ms per step, "
        f"{best['x_naive']:.2f}× NaiveDDP, hidden {best['hidden']:.2f}"
    )
    meta = {"bench": "ddp", "layers": layers, "width": width, "world": world,
            "link": str(link) if link else None, "batch": result["batch"], "reps": reps,
            "alpha": alpha, "beta": beta, "per_op": per_op, "comm_cpu": comm_cpu,
            "predicted_best_bucket_mb": predicted_best}  # fmt: skip
    write(rows, csv_path, json_path, meta=meta)
    return rows
