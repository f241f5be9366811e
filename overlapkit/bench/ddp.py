"""bench ddp: naive, per-parameter and bucketed data parallelism against PyTorch's DDP.

One launch on ``world`` ranks does it all, so every configuration meets the
same machine: it sizes a stack of ``layers`` Linear+ReLU layers' batch so that
backward takes about as long as one AllReduce of all its gradients (what makes
overlap matter), measures when each gradient becomes ready
(``ok.profile_backward``) and what one AllReduce costs beyond the α-β model
(``ok.costmodel.HostCost``: wall time idle and while the rank computes, and
CPU time), then runs the configurations interleaved, ``reps`` rounds after
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
(``ok.costmodel.ddp_step`` from the profile, the link and the host cost, plus the measured
optimizer step) and its error, x_naive (step ÷ NaiveDDP's step) and x_torch (step ÷
PyTorch DDP's at the same cap). PyTorch's hidden share is not shown: its backward
returns only after its reducer has waited for every bucket, so its compute cannot
be told apart from its waiting.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .. import costmodel, ddp, p2p, runtime
from ..timeline import COMM, COMPUTE, Timeline, length
from .progress import launch_with_progress, slowest
from .table import format_table, write


def make_model(layers: int, width: int, bias: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width, bias=bias), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def _reducer(link):
    """The AllReduce every kit configuration uses: the ring over the link, else the built-in."""
    return "ring" if link is not None else None


def _calibrate(model_fn, width: int, link, batch: int | None, ratio: float):
    """Size the batch so that backward takes ``ratio`` × one AllReduce of
    every gradient, and measure what an AllReduce costs this host (wall and CPU, idle
    and busy): returns (batch, full AllReduce seconds, HostCost)."""
    model = model_fn()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    host, full = ddp.measure_host_cost(nbytes, _reducer(link))
    if batch is None:
        batch = 64
        for _ in range(2):  # backward is not quite linear in the batch: correct once
            x = torch.randn(batch, width, device=runtime.device())
            prof = ddp.profile_backward(model, lambda m, x=x: m(x).square().mean(), repeats=3)
            wanted = batch * ratio * full / prof.backward
            agreed = torch.tensor([max(8.0, wanted)], dtype=torch.float64)
            dist.broadcast(agreed, src=0)  # every rank trains on the same batch size
            batch = round(agreed.item())
    return batch, full, host


#: "an AllReduce about as long as backward": backward takes this many AllReduce times
BACKWARD_PER_ALL_REDUCE = 1.0


def _configs(bucket_sweep, torch_ddp: bool):
    configs = [("naive", None), ("overlap", None)]
    configs += [("bucketed", mb) for mb in bucket_sweep]
    if torch_ddp:
        configs += [("torch", mb) for mb in bucket_sweep]
    return configs


def _build(kind, mb, spec, link, timeline):
    model = make_model(*spec).to(runtime.device())
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


def _rank_bench(spec, bucket_sweep, reps, warmup, batch, ratio, torch_ddp, progress):
    layers, width, _ = spec
    link = p2p.current_link()
    world = runtime.world_size()
    dev = runtime.device()
    batch, full, host = _calibrate(lambda: make_model(*spec).to(dev), width, link, batch, ratio)
    gen = torch.Generator().manual_seed(runtime.rank())
    x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)
    x, y = x.to(dev), y.to(dev)
    model = make_model(*spec).to(dev)
    profile = ddp.profile_backward(model, lambda m: torch.nn.functional.mse_loss(m(x), y))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt_samples = []
    for _ in range(5):
        start = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        runtime.synchronize()
        opt_samples.append(time.perf_counter() - start)
    configs = _configs(bucket_sweep, torch_ddp)
    timelines = {c: Timeline() for c in configs}
    wrappers = {c: _build(*c, spec, link, timelines[c]) for c in configs}
    optimizers = {c: torch.optim.SGD(w.parameters(), lr=1e-4) for c, w in wrappers.items()}
    steps = {c: [] for c in configs}
    last_round = {}
    for i in range(warmup + reps):
        for c in configs:
            w, opt = wrappers[c], optimizers[c]
            tl = timelines[c]
            runtime.synchronize()
            dist.barrier()
            n_before = len(tl.spans)
            start = time.perf_counter()
            loss = torch.nn.functional.mse_loss(w(x), y)
            if c[0] == "torch":
                tl.add("forward", start, time.perf_counter(), COMPUTE)
                loss.backward()  # PyTorch's reducer waits for its buckets inside backward
            else:
                loss.backward()
                w.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad(set_to_none=True)
            runtime.synchronize()
            end = time.perf_counter()
            step = slowest(start, end, dev)
            if i >= warmup:
                steps[c].append(step)
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
                "comm": length((s.start, s.end) for s in comm),
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
        "host": host,
    }


def _model_terms(result, link):
    """α and β for the prediction: the link's own; without a link, β from the full
    AllReduce (what is left after the host's per-operation cost)."""
    if link is not None:
        return link.alpha, link.beta
    world, full, host = result["world"], result["full"], result["host"]
    factor = costmodel.BUSBW_FACTOR["all_reduce"](world)
    total = result["profile"].total_bytes
    return 0.0, max(0.0, full - host.per_op) / (factor * total)


def _print_setup(result: dict, shape: tuple, world: int, link) -> None:
    """What was measured once: the model (``shape`` = layers, width, bias), its times and
    the host's cost per AllReduce."""
    layers, width, bias = shape
    profile, host = result["profile"], result["host"]
    print(
        f"model: {layers} × Linear({width}, {width}{'' if bias else ', bias=False'}) + ReLU, "
        f"{profile.total_bytes / 2**20:.2f} MiB "
        f"of gradients, batch {result['batch']} per rank, {world} ranks, "
        f"{'the kit ring over ' + str(link) if link else 'gloo built-in AllReduce, no link'}"
    )
    print(
        f"measured once: forward {profile.forward * 1e3:.2f} ms, backward "
        f"{profile.backward * 1e3:.2f} ms, optimizer {result['optimizer'] * 1e3:.2f} ms, one "
        f"AllReduce of all gradients {result['full'] * 1e3:.2f} ms"
    )
    print(
        f"host cost per AllReduce beyond α-β: {host.per_op * 1e3:.3f} ms idle, "
        f"{host.per_op_busy * 1e3:.3f} ms while the rank computes; CPU "
        f"{host.cpu_per_op * 1e3:.3f} ms + {host.cpu_per_byte * 2**20 * 1e3:.3f} ms/MiB "
        "(taken from an overlapped backward: each rank has about one core)"
    )


def _rows(result: dict, world: int, alpha: float, beta: float) -> list[dict]:
    """A row per configuration measured: its times, the model's prediction, the ratios."""
    profile, host = result["profile"], result["host"]
    naive_step = next(r["step"] for r in result["rows"] if r["config"][0] == "naive")
    torch_step = {r["config"][1]: r["step"] for r in result["rows"] if r["config"][0] == "torch"}
    rows = []
    for r in result["rows"]:
        kind, mb = r["config"]
        strategy = "bucketed" if kind == "torch" else kind
        model = costmodel.ddp_step(profile.ready, profile.forward, profile.backward, world,
                                   alpha, beta, strategy, mb, host=host)  # fmt: skip
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
    return rows


def _print_best_bucket(bucketed: list, profile, bucket_sweep, predicted_best: float) -> None:
    """The measured best bucket size against the predicted one, in sweep points apart
    (sizes that cut the gradients into the same buckets are one point)."""
    measured_best = min(bucketed, key=lambda r: r["step_ms"])
    sizes = [nbytes for _, nbytes in profile.ready]
    points: list = []
    for mb in bucket_sweep:
        cut = costmodel.ddp_buckets(sizes, mb)
        if not points or points[-1][1] != cut:
            points.append(([mb], cut))
        else:
            points[-1][0].append(mb)
    where = {mb: k for k, (mbs, _) in enumerate(points) for mb in mbs}
    apart = abs(where[measured_best["bucket_mb"]] - where[predicted_best])
    same = [f"{'/'.join(f'{m:g}' for m in mbs)}" for mbs, _ in points if len(mbs) > 1]
    print(
        f"best bucket size: measured {measured_best['bucket_mb']:g} MiB "
        f"({measured_best['step_ms']:.1f} ms), predicted {predicted_best:g} MiB "
        f"({apart} sweep point{'s' if apart != 1 else ''} apart"
        + (f"; {', '.join(same)} MiB make the same buckets: one point" if same else "")
        + ")"
    )


def run(
    layers: int = 8,
    width: int = 512,
    bias: bool = False,
    world: int = 2,
    link=None,
    bucket_sweep=costmodel.BUCKET_SWEEP_MB,
    reps: int = 10,
    warmup: int = 2,
    batch: int | None = None,
    backward_ratio: float = BACKWARD_PER_ALL_REDUCE,
    torch_ddp: bool = True,
    csv_path=None,
    json_path=None,
) -> list[dict]:
    if layers < 1 or width < 1:
        raise ValueError(f"layers and width must be positive, got {layers} and {width}")
    if any(not mb > 0 for mb in bucket_sweep):
        raise ValueError(f"bucket sizes must be positive MiB, got {list(bucket_sweep)}")
    total = len(_configs(bucket_sweep, torch_ddp)) * (warmup + reps)
    result = launch_with_progress(
        _rank_bench, (layers, width, bias), list(bucket_sweep), reps, warmup, batch,
        backward_ratio, torch_ddp, total=total, desc="bench ddp", world_size=world, link=link,
        quiet=True, timeout=1800,
    )[0]  # fmt: skip
    profile, host = result["profile"], result["host"]
    alpha, beta = _model_terms(result, link)
    _print_setup(result, (layers, width, bias), world, link)
    rows = _rows(result, world, alpha, beta)
    print(format_table(rows))
    if link is None:
        print(
            "no link: gloo's AllReduce is the machine's own copies and sums, on the same two "
            "cores as backward, and its α and β are fitted from two AllReduces: read "
            "predicted_ms as a rough guide here; the model is made for an emulated link"
        )
    ours = [r for r in rows if r["config"] != "torch"]
    best = min(ours, key=lambda r: r["step_ms"])
    bucketed = [r for r in rows if r["config"] == "bucketed"]
    predicted_best = costmodel.best_bucket_mb(profile.ready, profile.forward, profile.backward,
                                              world, alpha, beta, host=host,
                                              candidates=bucket_sweep)  # fmt: skip
    if bucketed:
        _print_best_bucket(bucketed, profile, bucket_sweep, predicted_best)
    label = best["config"] + (f" {best['bucket_mb']:g} MiB" if best["config"] == "bucketed" else "")
    print(
        f"best configuration: {label}: {best['step_ms']:.1f} ms per step, "
        f"{best['x_naive']:.2f}× NaiveDDP, hidden {best['hidden']:.2f}"
    )
    meta = {"bench": "ddp", "layers": layers, "width": width, "world": world,
            "link": str(link) if link else None, "batch": result["batch"], "reps": reps,
            "alpha": alpha, "beta": beta, "host": vars(host),
            "predicted_best_bucket_mb": predicted_best}  # fmt: skip
    write(rows, csv_path, json_path, meta=meta)
    return rows
