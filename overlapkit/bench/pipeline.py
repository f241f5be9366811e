"""bench pipeline: schedules × micro-batches × overlap on two stages, against the model.

One launch on 2 ranks (stage 0 and stage 1, each half of a stack of
Linear+ReLU layers). First each stage times its forward and backward for every
micro-batch size of the sweep (the inputs of the prediction). The link is then
sized so that one activation's transfer costs ``--transfer-share`` (default
30%) of a stage's micro-batch compute at the largest micro-batch count, unless
``--link`` names one. Then every configuration runs, interleaved, ``reps``
rounds after ``warmup``:

* step_ms: median of the slowest stage's step (forward and backward of every
  micro-batch, with their transfers);
* bubble: each stage's idle share of the step (1 − compute / step), averaged over
  the stages, beside theory (p−1)/(m+p−1);
* hidden: the share of transfer time (each send, from start to arrival) during
  which its stage was computing;
* peak_act: the most micro-batches whose activations a stage held at once;
* predicted_ms: ``ok.costmodel.pipeline_step`` from the timed compute and the link.

``1f1b+1`` is 1F1B with one extra warm-up forward on stage 0: with slow transfers each
1F1B micro-batch waits for a round trip (activation out, gradient back), and one more
micro-batch in flight fills that wait — for one more micro-batch's activations held.

``torch.distributed.pipelining``'s GPipe and 1F1B run on the same split without a
link (its messages do not go through the kit's link), beside the kit's schedules
without a link, where this PyTorch build supports them on this backend.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .. import costmodel, p2p, runtime
from ..pipeline import PipelineStage, make_schedule
from ..timeline import COMPUTE, Timeline
from .progress import launch_with_progress, slowest
from .table import format_table, write

P = 2  # stages


def make_stage(stage: int, layers: int, width: int) -> torch.nn.Module:
    """Stage ``stage`` of a stack of ``layers`` Linear+ReLU layers (the same on any rank)."""
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    half = len(mods) // 2
    return torch.nn.Sequential(*(mods[:half] if stage == 0 else mods[half:]))


def _time_compute(stage_mod, width: int, sizes, first: bool, last: bool, reps: int = 9,
                  warmup: int = 2) -> dict:  # fmt: skip
    """Median forward and backward seconds of this stage for each micro-batch size, as the
    pipeline runs them: stage 0's input needs no gradient (its backward skips the first
    layer's input gradient, 1/8 of the work here), a later stage's does. Every size is
    warmed up before any is timed: a size's first runs were 20–40% slower here."""
    inputs = {b: torch.randn(b, width, requires_grad=not first) for b in sorted(set(sizes))}

    def once(x):
        t0 = time.perf_counter()
        y = stage_mod(x)
        loss = y.square().mean() if last else None
        t1 = time.perf_counter()
        (loss.backward() if last else y.backward(torch.ones_like(y)))
        return t1 - t0, time.perf_counter() - t1

    for _ in range(warmup):
        for x in inputs.values():
            once(x)
    out = {}
    for b, x in inputs.items():
        fs, bs = zip(*(once(x) for _ in range(reps)), strict=True)
        out[b] = (statistics.median(fs), statistics.median(bs))
    stage_mod.zero_grad(set_to_none=True)
    return out


def _parse(schedule: str) -> tuple[str, int]:
    """``"1f1b+1"`` → ("1f1b", 1): 1F1B with one extra warm-up forward."""
    name, _, extra = schedule.partition("+")
    return name, int(extra or 0)


def _configs(micro, schedules):
    rows = []
    for schedule in schedules:
        counts = [1] if schedule == "sequential" else micro
        for m in counts:
            for overlap in (False, True):
                rows.append((schedule, m, overlap))
    return rows


def _rank_bench(layers, width, batch, micro, schedules, reps, warmup, share, torch_compare,
                progress):  # fmt: skip
    s = runtime.rank()
    stage_mod = make_stage(s, layers, width)
    sizes = [n for m in micro for n in (batch // m, -(-batch // m))] + [batch]
    compute = _time_compute(stage_mod, width, sizes, first=s == 0, last=s == P - 1)
    # every stage's timings, for the prediction and for sizing the link
    everyone = [None] * P
    dist.all_gather_object(everyone, compute)
    link = p2p.current_link()
    if link is None and share > 0:
        m = max(micro)
        b = -(-batch // m)
        t = max(sum(c[b]) for c in everyone)  # a stage's F + B of one micro-batch
        nbytes = b * width * 4
        alpha = 100e-6
        seconds = max(share * t - alpha, 1e-6)
        link = p2p.Link(alpha * 1e6, nbytes / seconds / 1e9)
        p2p.set_link(link)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)
    configs = _configs(micro, schedules)
    times = {c: [] for c in configs}
    extra = {c: None for c in configs}
    for i in range(warmup + reps):
        for c in configs:
            schedule, m, overlap = c
            tl = Timeline()
            stage = PipelineStage(stage_mod)
            dist.barrier()
            start = time.perf_counter()
            name, warm = _parse(schedule)
            res = stage.step(x if s == 0 else None, y if s == P - 1 else None,
                             torch.nn.functional.mse_loss, m, name, overlap, tl,
                             warm)  # fmt: skip
            end = time.perf_counter()
            stage_mod.zero_grad(set_to_none=True)
            step = slowest(start, end)
            if i >= warmup:
                times[c].append(step)
                bubble = 1 - tl.busy(COMPUTE) / (end - start)
                hidden = tl.hidden_fraction()
                hidden = float("nan") if hidden is None else hidden
                extra[c] = (bubble, hidden, res.peak_activations)
            progress.tick()
    gathered = [None] * P
    dist.all_gather_object(gathered, extra)
    torch_rows = _torch_pipelining(stage_mod, x, y, micro, reps, warmup) if torch_compare else {}
    if s != 0:
        return None
    return {"times": times, "extra": gathered, "compute": everyone, "link": link,
            "torch": torch_rows}  # fmt: skip


def _torch_pipelining(stage_mod, x, y, micro, reps, warmup) -> dict:
    """torch.distributed.pipelining's GPipe and 1F1B on the same split, no link; and the
    kit's schedules beside them, also without a link. {} where it does not run."""
    link = p2p.current_link()
    p2p.set_link(None)
    out: dict = {}
    try:
        from torch.distributed.pipelining import PipelineStage as TorchStage
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
    except ImportError as exc:
        out["error"] = f"torch.distributed.pipelining is not available: {exc}"
        p2p.set_link(link)
        return out
    s = runtime.rank()
    for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        for m in micro:
            if m < P:
                continue
            try:
                stage = TorchStage(stage_mod, s, P, torch.device("cpu"))
                sched = cls(stage, m, loss_fn=torch.nn.functional.mse_loss)
                theirs, ours = [], []
                for i in range(warmup + reps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    if s == 0:
                        sched.step(x)
                    else:
                        sched.step(target=y)
                    t1 = time.perf_counter()
                    torch_grads = [q.grad.clone() for q in stage_mod.parameters()]
                    stage_mod.zero_grad(set_to_none=True)
                    dist.barrier()
                    t2 = time.perf_counter()
                    mine = PipelineStage(stage_mod)
                    mine.step(x if s == 0 else None, y if s == P - 1 else None,
                              torch.nn.functional.mse_loss, m, name, True)  # fmt: skip
                    t3 = time.perf_counter()
                    pairs = zip(stage_mod.parameters(), torch_grads, strict=True)
                    diff = max((q.grad - g).abs().max().item() for q, g in pairs)
                    stage_mod.zero_grad(set_to_none=True)
                    if i >= warmup:
                        theirs.append(t1 - t0)
                        ours.append(t3 - t2)
                out[(name, m)] = (statistics.median(theirs), statistics.median(ours), diff)
            except Exception as exc:  # noqa: BLE001 - reported in the table, not fatal
                out["error"] = f"{type(exc).__name__}: {exc}"
                break
    p2p.set_link(link)
    return out


def run(layers: int = 8, width: int = 512, batch: int = 512, micro=(1, 2, 4, 8),
        schedules=("sequential", "gpipe", "1f1b", "1f1b+1"), link=None, transfer_share: float = 0.3,
        reps: int = 5, warmup: int = 1, torch_compare: bool = True, csv_path=None,
        json_path=None) -> list[dict]:  # fmt: skip
    if any(m > batch for m in micro):
        raise ValueError(f"micro-batch counts {list(micro)} exceed the batch ({batch})")
    total = len(_configs(micro, schedules)) * (warmup + reps)
    result = launch_with_progress(
        _rank_bench, layers, width, batch, list(micro), list(schedules), reps, warmup,
        0.0 if link is not None else transfer_share, torch_compare, total=total,
        desc="bench pipeline", world_size=P, link=link, quiet=True, timeout=1800,
    )[0]  # fmt: skip
    link = result["link"]
    compute = result["compute"]
    print(
        f"model: {layers} × Linear({width}, {width}) + ReLU in {P} stages, batch {batch}; "
        + (f"{link}" if link else "no link")
        + (
            f" (sized so one transfer costs {transfer_share:.0%} of a stage's micro-batch compute "
            f"at m = {max(micro)})"
            if transfer_share and link
            else ""
        )  # fmt: skip
    )
    rows = []
    for c, samples in result["times"].items():
        schedule, m, overlap = c
        step = statistics.median(samples)
        per_stage = [e[c] for e in result["extra"]]
        sizes = [len(r) for r in torch.tensor_split(torch.arange(batch), m)]
        t_f = [statistics.mean(comp[b][0] for b in sizes) for comp in compute]
        t_b = [statistics.mean(comp[b][1] for b in sizes) for comp in compute]
        nbytes = max(sizes) * width * 4
        t_c = link.message_time(nbytes) if link else 0.0
        name, extra = _parse(schedule)
        plan = make_schedule(name, P, m, extra)
        predicted = costmodel.pipeline_step(plan, t_f, t_b, t_c, overlap)
        hidden = [h for _, h, _ in per_stage if h == h]
        rows.append(
            {
                "schedule": schedule,
                "m": m,
                "overlap": "on" if overlap else "off",
                "step_ms": step * 1e3,
                "bubble": statistics.mean(b for b, _, _ in per_stage),
                "theory": costmodel.pipeline_bubble(P, m),
                "hidden": statistics.mean(hidden) if hidden else float("nan"),
                "peak_act": max(p for _, _, p in per_stage),
                "predicted_ms": predicted["step"] * 1e3,
                "pred_err": (predicted["step"] - step) / step,
            }
        )
    print(format_table(rows))
    torch_rows = result["torch"]
    if torch_rows.get("error"):
        print(f"torch.distributed.pipelining: not compared here ({torch_rows['error']})")
    elif torch_rows:
        print("torch.distributed.pipelining on the same split, no link (kit ÷ torch):")
        for (name, m), (theirs, ours, diff) in torch_rows.items():
            print(f"  {name:5} m={m}: torch {theirs * 1e3:.1f} ms, kit {ours * 1e3:.1f} ms, "
                  f"ratio {ours / theirs:.2f}; stage 0's gradients differ by at most "
                  f"{diff:.1e}")  # fmt: skip
    best = min(rows, key=lambda r: r["step_ms"])
    print(
        f"best schedule: {best['schedule']} m={best['m']} overlap {best['overlap']}: "
        f"{best['step_ms']:.1f} ms per step, bubble {best['bubble']:.2f} "
        f"(theory {best['theory']:.2f}), transfers hidden {best['hidden']:.2f}"
    )
    compared = {f"{k[0]} m={k[1]}": v for k, v in torch_rows.items() if k != "error"}
    meta = {"bench": "pipeline", "layers": layers, "width": width, "batch": batch,
            "link": str(link) if link else None, "torch": compared}  # fmt: skip
    write(rows, csv_path, json_path, meta=meta)
    return rows
