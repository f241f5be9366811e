"""bench fsdp: fully sharded training without, with implicit and with explicit prefetch,
against data parallelism, and PyTorch's ``fully_shard`` beside the kit's.

One launch on ``world`` ranks. The model is ``units`` blocks of Linear(width, width) + Tanh,
one FSDP unit each. First each rank times one block's forward and backward alone (the
inputs of the prediction); unless ``--link`` names one, the emulated link is then sized so
that one unit's AllGather takes ``--gather-share`` (default 1.0) of its forward: where
prefetch matters most. Then every configuration runs, interleaved, ``reps`` rounds after
``warmup``, all over the same link with the kit's ring:

* ``fsdp none`` / ``implicit`` / ``explicit``: ``ok.FullyShardedDP`` with that prefetch
  (reshard after forward; backward prefetch on but for ``none``, which prefetches nothing);
* ``ddp``: ``ok.BucketedDDP`` (25 MiB buckets) on the same model: every rank whole.

Columns: step_ms (median of the slowest rank's step: forward, backward, the last
ReduceScatter, SGD), x_none (÷ the step without prefetch), fwd_hidden (share of the
forward's AllGather time during which a unit computed), exposed_ms (step − the compute
the timeline saw), params_mib (per rank, the most parameter bytes held at once: the
shards plus the whole units, as the wrapper counted them; for DDP the whole model),
predicted_ms (``ok.costmodel.fsdp_step`` from the block timed alone and the link's α-β)
and its error, and in_step_pred_ms (the same model fed with a unit's transfers and compute
as timed beside each other on these ranks, ``_time_in_step``) and its error: where the two
predictions part, the host's share of communication is what the α-β model misses.
A forward hides at most (units − 1)/units of its AllGathers: the first unit's has no
compute before it (hence the default of 8 units). The default batch (1024 per rank) makes a
unit's forward ~25 ms here: each transfer pays a few ms of waking its threads on cores
busy with compute, which at 256 (6 ms units) left 71% of the AllGathers hidden, not 85%.

Then, without a link (gloo's own AllGather and ReduceScatter on both sides): the kit's
explicit prefetch against ``torch.distributed.fsdp.fully_shard`` on the same units (and
``set_modules_to_forward_prefetch`` for its explicit prefetch), the step ratio and the
largest parameter difference after the timed steps, where this PyTorch build runs it.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .. import costmodel, p2p, runtime
from ..collectives import ring_all_gather, ring_reduce_scatter
from ..ddp import BucketedDDP
from ..fsdp import FullyShardedDP
from ..timeline import COMPUTE, Timeline, intersect, length, union
from .pictures import median_steps
from .progress import launch_with_progress, slowest
from .table import format_table, write

CONFIGS = ("fsdp none", "fsdp implicit", "fsdp explicit", "ddp")
PICTURED = ("fsdp none", "fsdp explicit")  # the two steps ``--png`` draws
ALPHA = 100e-6  # the link's latency when the bench sizes it


def make_model(units: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)  # every rank the same model
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
              for _ in range(units)]  # fmt: skip
    return torch.nn.Sequential(*blocks)


def _time_block(width: int, batch: int, reps: int = 9) -> tuple[float, float]:
    """Median forward and backward seconds of one block, its input needing a gradient
    (as every unit's but the first does)."""
    block = make_model(1, width)[0]
    x = torch.randn(batch, width, requires_grad=True)
    fs, bs = [], []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        y = block(x)
        t1 = time.perf_counter()
        y.backward(torch.ones_like(y))
        t2 = time.perf_counter()
        if i >= 2:  # the first runs warm up
            fs.append(t1 - t0)
            bs.append(t2 - t1)
    return statistics.median(fs), statistics.median(bs)


def _time_in_step(width: int, batch: int, unit_bytes: int, reps: int = 5) -> dict:
    """What a unit's transfers and compute take on this rank in a step, timed on every rank
    at once (medians, seconds): one unit's ring AllGather with nothing else running
    (``ag_idle``: a step without prefetch waits through it) and while the unit's forward
    runs again and again (``ag_busy``: a prefetched forward), one ReduceScatter while the
    backward does (``rs_busy``), and those forwards and backwards meanwhile (``fwd_busy``,
    ``bwd_busy``). The link's α-β model leaves out what the ring's copies and the emulated
    link's threads take from a computing rank, and what they take from its compute. The
    AllGathers write into parameters allocated anew, as the wrapper's do after a reshard
    (their fresh pages cost ~1 ms of a 4 MiB unit's gather here)."""
    block = make_model(1, width)[0]
    x = torch.randn(batch, width, requires_grad=True)
    world = runtime.world_size()
    numel = -(-(unit_bytes // 4) // world) * world  # padded as the wrapper pads its shards
    full, shard = torch.zeros(numel), torch.zeros(numel // world)
    got: dict = {k: [] for k in ("ag_idle", "ag_busy", "rs_busy", "fwd_busy", "bwd_busy")}

    def while_in_flight(start_op, work) -> tuple[float, float]:
        dist.barrier()
        start, ends, spent = time.perf_counter(), [], []
        handle = start_op()
        handle.get_future().then(lambda _: ends.append(time.perf_counter()))
        spent.append(work())  # at least once: a transfer that beats one forward still has it
        while not ends:  # keep computing until the transfer is over, as a step would
            spent.append(work())
        handle.wait()
        return ends[0] - start, statistics.median(spent)

    def forward():
        t0 = time.perf_counter()
        block(x)
        return time.perf_counter() - t0

    def backward():
        y = block(x)
        t0 = time.perf_counter()
        y.backward(torch.ones_like(y))
        return time.perf_counter() - t0

    def fresh():  # the wrapper gathers into parameters allocated anew (reshard frees them)
        full.untyped_storage().resize_(0)
        full.untyped_storage().resize_(numel * full.element_size())
        return full

    for i in range(reps + 1):  # the first round warms up
        dist.barrier()
        start = time.perf_counter()
        ring_all_gather(fresh(), shard)
        idle = time.perf_counter() - start
        ag, fwd = while_in_flight(lambda: ring_all_gather(fresh(), shard, async_op=True),
                                  forward)  # fmt: skip
        rs, bwd = while_in_flight(
            lambda: ring_reduce_scatter(shard, full, async_op=True), backward)  # fmt: skip
        if i:
            for key, value in zip(got, (idle, ag, rs, fwd, bwd), strict=True):
                got[key].append(value)
    return {key: statistics.median(values) for key, values in got.items()}


def _predict(config: str, units: int, world: int, link, block, in_step, unit_bytes) -> dict:
    """``costmodel.fsdp_step`` for one configuration, twice: from the link's α-β and the
    block timed alone (``alpha_beta``), and with what a step's transfers and compute were
    timed to take on these ranks (``in_step``: a step without prefetch waits through idle
    transfers; a prefetched one computes beside them)."""
    prefetch = config.split()[1]
    forward, backward = block
    ag_model = costmodel.ring_all_gather(unit_bytes, world, link.alpha, link.beta)
    rs_model = costmodel.ring_reduce_scatter(unit_bytes, world, link.alpha, link.beta)

    def step(fwd, bwd, per_op, per_op_rs):
        return costmodel.fsdp_step([(fwd, bwd, unit_bytes)] * units, world, link.alpha,
                                   link.beta, prefetch, backward_prefetch=prefetch != "none",
                                   per_op=per_op, per_op_rs=per_op_rs)["step"]  # fmt: skip

    overlapped = prefetch == "explicit"  # "implicit" is "none" on a CPU (costmodel)
    measured = (
        step(in_step["fwd_busy"], in_step["bwd_busy"], in_step["ag_busy"] - ag_model,
             in_step["rs_busy"] - rs_model) if overlapped
        else step(forward, backward, in_step["ag_idle"] - ag_model,
                  in_step["rs_busy"] - rs_model)
    )  # fmt: skip
    return {"alpha_beta": step(forward, backward, 0.0, 0.0), "in_step": measured}


def _size_link(forward: float, nbytes: int, world: int, share: float) -> p2p.Link:
    """A link on which a ring AllGather of ``nbytes`` takes ``share`` × ``forward``:
    (N−1)·(α + S/N·β) = share·forward."""
    per_step = share * forward / (world - 1)
    alpha = min(ALPHA, per_step / 4)
    beta = (per_step - alpha) * world / nbytes
    return p2p.Link(alpha * 1e6, 1 / beta / 1e9)


def _forward_hidden(tl: Timeline) -> float:
    """Share of the forward's AllGather time during which a unit computed."""
    forwards = [s for s in tl.spans if s.name.startswith("F ")]
    if not forwards:
        return float("nan")
    end = max(s.end for s in forwards)
    gathers = union((s.start, s.end) for s in tl.spans if s.name.startswith("AG ") and
                    s.start < end)  # fmt: skip
    work = union((s.start, s.end) for s in forwards)
    total = length(gathers)
    return length(intersect(gathers, work)) / total if total else float("nan")


def _build(config: str, units: int, width: int, timeline: Timeline):
    model = make_model(units, width)
    if config == "ddp":
        wrapper = BucketedDDP(model, all_reduce="ring", bucket_mb=25, timeline=timeline)
    else:
        prefetch = config.split()[1]  # "none": no prefetch in backward either
        wrapper = FullyShardedDP(model, prefetch=prefetch, all_gather="ring",
                                 reduce_scatter="ring", timeline=timeline,
                                 backward_prefetch=prefetch != "none")  # fmt: skip
    return wrapper, torch.optim.SGD(wrapper.parameters(), lr=1e-4)


def _step(wrapper, opt, x) -> None:
    wrapper(x).square().mean().backward()
    wrapper.finish_gradient_synchronization()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _rank_bench(units, width, batch, reps, warmup, share, compare, progress):
    world = runtime.world_size()
    block = _time_block(width, batch)
    everyone = [None] * world
    dist.all_gather_object(everyone, block)
    forward = max(f for f, _ in everyone)
    backward = max(b for _, b in everyone)
    unit_bytes = (width * width + width) * 4
    link = p2p.current_link()
    if link is None:
        link = _size_link(forward, unit_bytes, world, share)
        p2p.set_link(link)
    timed = [None] * world
    dist.all_gather_object(timed, _time_in_step(width, batch, unit_bytes))
    in_step = {k: max(t[k] for t in timed) for k in timed[0]}  # the slowest rank's
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(runtime.rank()))
    timelines = {c: Timeline() for c in CONFIGS}
    built = {c: _build(c, units, width, timelines[c]) for c in CONFIGS}
    times = {c: [] for c in CONFIGS}
    extra: dict = {}
    pictured: dict = {}
    for i in range(warmup + reps):
        for c in CONFIGS:
            wrapper, opt = built[c]
            tl = timelines[c]
            tl.spans.clear()
            if c != "ddp":
                wrapper.reset_peak()
            dist.barrier()
            start = time.perf_counter()
            _step(wrapper, opt, x)
            end = time.perf_counter()
            step = slowest(start, end)
            if i >= warmup:
                times[c].append(step)
                held = (sum(p.numel() * p.element_size() for p in wrapper.parameters())
                        if c == "ddp" else _fsdp_params(wrapper))  # fmt: skip
                extra.setdefault(c, []).append((_forward_hidden(tl), tl.busy(COMPUTE), held))
                if c in PICTURED:  # every timed step's spans: the picture shows the median one
                    pictured.setdefault(c, []).append(Timeline(runtime.rank(), tl.spans))
            progress.tick()
    gathered = [None] * world
    dist.all_gather_object(gathered, (extra, pictured))
    pictured = {c: [[g[1][c][i] for g in gathered] for i in range(reps)] for c in PICTURED}
    gathered = [g[0] for g in gathered]
    p2p.set_link(None)
    theirs = _beside_fully_shard(units, width, x, reps, warmup) if compare else {}
    if runtime.rank() != 0:
        return None
    return {"times": times, "extra": gathered, "block": (forward, backward), "link": link,
            "unit_bytes": unit_bytes, "in_step": in_step, "torch": theirs,
            "pictured": pictured}  # fmt: skip


def _fsdp_params(wrapper: FullyShardedDP) -> int:
    memory = wrapper.memory()
    return memory["shards"] + memory["peak_gathered"]


def _beside_fully_shard(units, width, x, reps, warmup) -> dict:
    """The kit's explicit prefetch (built-in collectives) against ``fully_shard`` with its
    explicit forward prefetch, no link; {"error": ...} where it does not run."""
    try:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
    except ImportError as exc:
        return {"error": f"fully_shard is not available: {exc}"}
    try:
        mesh = init_device_mesh("cpu", (runtime.world_size(),))
        theirs = make_model(units, width)
        for block in theirs:
            fully_shard(block, mesh=mesh)
        fully_shard(theirs, mesh=mesh)
        for block, after in zip(theirs, list(theirs)[1:], strict=False):
            block.set_modules_to_forward_prefetch([after])
        ours = FullyShardedDP(make_model(units, width), prefetch="explicit")
        optims = {"kit": torch.optim.SGD(ours.parameters(), lr=1e-4),
                  "torch": torch.optim.SGD(theirs.parameters(), lr=1e-4)}  # fmt: skip
        steps: dict = {"kit": [], "torch": []}
        for i in range(warmup + reps):
            for name, model in (("kit", ours), ("torch", theirs)):
                dist.barrier()
                start = time.perf_counter()
                model(x).square().mean().backward()
                if name == "kit":
                    model.finish_gradient_synchronization()
                optims[name].step()
                optims[name].zero_grad(set_to_none=True)
                step = slowest(start, time.perf_counter())
                if i >= warmup:
                    steps[name].append(step)
        mine = ours.full_state_dict()
        gap = max((mine[k] - v.full_tensor()).abs().max().item()
                  for k, v in theirs.state_dict().items())  # fmt: skip
        return {"kit": statistics.median(steps["kit"]),
                "torch": statistics.median(steps["torch"]), "gap": gap}  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - reported under the table, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}


def run(units: int = 8, width: int = 1024, batch: int = 1024, world: int = 2, link=None,
        gather_share: float = 1.0, reps: int = 5, warmup: int = 2, torch_compare: bool = True,
        csv_path=None, json_path=None, png_path=None) -> list[dict]:  # fmt: skip
    if world < 2:
        raise ValueError(f"bench fsdp needs at least 2 ranks to shard over; got {world}")
    result = launch_with_progress(
        _rank_bench, units, width, batch, reps, warmup, gather_share, torch_compare,
        total=len(CONFIGS) * (warmup + reps), desc="bench fsdp", world_size=world, link=link,
        quiet=True, timeout=1800,
    )[0]  # fmt: skip
    link, (forward, backward) = result["link"], result["block"]
    unit_bytes = result["unit_bytes"]
    gather = costmodel.ring_all_gather(unit_bytes, world, link.alpha, link.beta)
    print(
        f"model: {units} units of Linear({width}, {width}) + Tanh ({unit_bytes / 2**20:.1f} MiB "
        f"each), batch {batch} per rank, {world} ranks; {link}: one unit's AllGather "
        f"{gather * 1e3:.1f} ms, its forward {forward * 1e3:.1f} ms, backward "
        f"{backward * 1e3:.1f} ms"
    )
    t = result["in_step"]
    print(
        f"timed in a step's conditions (the slowest rank): one unit's AllGather "
        f"{t['ag_idle'] * 1e3:.1f} ms alone, {t['ag_busy'] * 1e3:.1f} ms beside its forward "
        f"(which took {t['fwd_busy'] * 1e3:.1f} ms meanwhile); its ReduceScatter "
        f"{t['rs_busy'] * 1e3:.1f} ms beside its backward ({t['bwd_busy'] * 1e3:.1f} ms)"
    )
    rows = []
    base = statistics.median(result["times"]["fsdp none"])
    for c in CONFIGS:
        step = statistics.median(result["times"][c])
        per_rank = [e[c] for e in result["extra"]]
        hidden = [statistics.median(h for h, _, _ in r) for r in per_rank]
        busy = max(statistics.median(b for _, b, _ in r) for r in per_rank)
        held = max(max(m for _, _, m in r) for r in per_rank)
        predicted = ({"alpha_beta": float("nan"), "in_step": float("nan")} if c == "ddp"
                     else _predict(c, units, world, link, (forward, backward),
                                   result["in_step"], unit_bytes))  # fmt: skip
        rows.append({
            "config": c,
            "step_ms": step * 1e3,
            "x_none": step / base,
            "fwd_hidden": statistics.mean(hidden) if c != "ddp" else float("nan"),
            "exposed_ms": (step - busy) * 1e3,
            "params_mib": held / 2**20,
            "predicted_ms": predicted["alpha_beta"] * 1e3,
            "pred_err": (predicted["alpha_beta"] - step) / step,
            "in_step_pred_ms": predicted["in_step"] * 1e3,
            "in_step_err": (predicted["in_step"] - step) / step,
        })  # fmt: skip
    print(format_table(rows))
    ddp_mib = rows[-1]["params_mib"]
    bound = ddp_mib / world + 2 * unit_bytes / 2**20
    explicit = next(r for r in rows if r["config"] == "fsdp explicit")
    print(
        f"explicit prefetch: step {explicit['x_none']:.2f}× the step without, forward "
        f"AllGathers {explicit['fwd_hidden']:.0%} hidden (at most {(units - 1) / units:.0%}: "
        f"the first unit's has no compute before it); parameters held "
        f"{explicit['params_mib']:.1f} MiB per rank against DDP's {ddp_mib:.1f} MiB "
        f"(1/N of DDP's + two units: {bound:.1f} MiB)"
    )
    theirs = result["torch"]
    if theirs.get("error"):
        print(f"fully_shard: not compared here ({theirs['error']})")
    elif theirs:
        print(
            f"beside torch's fully_shard, no link, same units, explicit prefetch on both: kit "
            f"{theirs['kit'] * 1e3:.1f} ms, torch {theirs['torch'] * 1e3:.1f} ms per step, "
            f"ratio {theirs['kit'] / theirs['torch']:.2f}; parameters differ by at most "
            f"{theirs['gap']:.1e} after {warmup + reps} steps"
        )
    if png_path:
        median_steps(result["times"], result["pictured"], PICTURED, png_path)
        print(f"timelines of the median steps without and with explicit prefetch: {png_path}")
    meta = {"bench": "fsdp", "units": units, "width": width, "batch": batch, "world": world,
            "link": str(link), "fully_shard": theirs}  # fmt: skip
    write(rows, csv_path, json_path, meta=meta)
    return rows
