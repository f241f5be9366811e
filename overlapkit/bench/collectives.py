"""bench collectives: naive and ring AllReduce against the built-in, and against the α-β model.

For each world size and message size, one launch runs every algorithm on the
same ranks, interleaved (naive, ring, built-in, naive, ring, ...), after a
barrier and a warm-up; an iteration runs from the moment the last rank starts
it to the moment the last rank ends it (ranks of one ``ok.launch`` share a
clock; under torchrun, the slowest rank's own time); the table shows medians.

* algbw = S / t; busbw = algbw × 2(N−1)/N (nccl-tests' factor for AllReduce),
  which is comparable across world sizes and near the link's bandwidth when
  the algorithm is bandwidth-optimal;
* x_builtin: busbw ÷ the built-in's busbw in the same launch (no link only:
  the built-in does not go through the emulated link);
* ring_async: 8 ring AllReduces issued with ``async_op=True`` and then waited
  (as a data-parallel step issues its buckets); its time is per operation;
* every kit collective runs with its safety checks on (the announcement that
  catches ranks disagreeing, numbered ops, honest handles): they are part of
  what it costs;
* with ``--link``: bound_ms is the α-β lower bound of the ring, 2(N−1)·(α + S/N·β),
  with the link's α and β, and efficiency = bound / measured; model_ms predicts
  each algorithm from α and β *fitted* to a ping-pong over the same link (and
  the measured reduction cost γ), and model_err is its relative error;
  machine_ms is the same algorithm over a link that costs nothing — the real
  copies, reductions and Python that this machine needs anyway — and limit
  says whether the link or the machine sets the pace (machine when machine_ms
  is 80% of what the link alone costs the algorithm, or more: the emulation
  cannot be faithful there).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from .. import collectives, costmodel, p2p, pingpong, runtime
from ..launcher import launch
from .table import format_table, write

#: ring_async issues this many AllReduces with async_op=True, then waits them: per op
ASYNC_BATCH = 8
_batches: dict = {}


def _ring_async(t: torch.Tensor) -> None:
    """ASYNC_BATCH ring AllReduces of t's size in flight at once (as DDP issues buckets)."""
    key = (t.numel(), t.dtype, t.device)
    if key not in _batches:
        _batches[key] = [t.clone() for _ in range(ASYNC_BATCH - 1)]
    handles = [collectives.ring_all_reduce(b, async_op=True) for b in [t, *_batches[key]]]
    for h in handles:
        h.wait()


# every kit collective with its checks on (announcements, numbering): they are part of the cost
ALGORITHMS = {
    "naive": lambda t: collectives.naive_all_reduce(t),
    "ring": lambda t: collectives.ring_all_reduce(t),
    "ring_async": _ring_async,
    "builtin": lambda t: dist.all_reduce(t),
}
#: operations one call of an algorithm runs (times are reported per operation)
OPS_PER_CALL = {"ring_async": ASYNC_BATCH}


#: a link that costs nothing: what is left is the machine's own work (copies, reductions)
INSTANT = p2p.Link(latency_us=0, bandwidth_gbps=1e9)


def _measure(nbytes: int, algorithms, reps: int, warmup: int) -> dict[str, list[float]]:
    """Times per algorithm; with a link, also each algorithm over :data:`INSTANT`
    (key ``"<algorithm>@machine"``), interleaved in the same launch."""
    device = runtime.device()
    source = torch.randn(max(1, nbytes // 4), device=device)
    link = p2p.current_link()
    variants = [(a, link, a) for a in algorithms]
    if link is not None:
        variants += [(a, INSTANT, f"{a}@machine") for a in algorithms if a != "builtin"]
    bufs = {key: torch.empty_like(source) for _, _, key in variants}
    times: dict[str, list[float]] = {key: [] for _, _, key in variants}
    # ranks of one ok.launch share the machine's monotonic clock: an iteration then runs
    # from the moment the last rank starts it (so that the skew with which ranks leave
    # the barrier is not counted) to the moment the last rank ends it; elsewhere
    # (torchrun across machines) it is the slowest rank's own time
    shared_clock = "OVERLAPKIT_RANK" in os.environ
    marks = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(warmup + reps):
        for a, variant_link, key in variants:
            p2p.set_link(variant_link)
            bufs[key].copy_(source)
            runtime.synchronize()
            dist.barrier()
            start = time.perf_counter()
            ALGORITHMS[a](bufs[key])
            runtime.synchronize()
            end = time.perf_counter()
            marks[0], marks[1] = (start, end) if shared_clock else (0.0, end - start)
            dist.all_reduce(marks, op=dist.ReduceOp.MAX)
            if i >= warmup:
                elapsed = (marks[1] - marks[0]).item()
                times[key].append(elapsed / OPS_PER_CALL.get(a, 1))
    p2p.set_link(link)
    return times


def _fit_link(sizes) -> tuple[float, float, float]:
    """α, β from a ping-pong over the (emulated) link, and γ from timing a local reduction."""
    times = pingpong.sweep(sizes, iters=5, warmup=1)
    a = torch.randn(4 << 20)
    b = torch.randn(4 << 20)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        a.add_(b)
        samples.append(time.perf_counter() - start)
    gamma = statistics.median(samples) / a.numel() / a.element_size()
    if runtime.rank() != 0:
        return None
    alpha, beta = costmodel.fit_alpha_beta(sizes, times)
    return alpha, beta, gamma


#: the machine, not the link, limits a row when its own work takes this share of the bound
MACHINE_SHARE = 0.8


def parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _fitted(link) -> dict:
    """The link's α, β and the reduction's γ (``a``, ``b``, ``g``), fitted from a ping-pong
    over it; said."""
    probe = [8 * 4**k for k in range(12)]
    fitted = dict(
        zip("abg", launch(_fit_link, probe, world_size=2, link=link, quiet=True)[0], strict=True)
    )
    print(
        f"{link}: fitted from a ping-pong over it: α = {fitted['a'] * 1e6:.1f} µs, "
        f"1/β = {costmodel.bandwidth_gbps(fitted['b']):.3f} GB/s; "
        f"reduction γ = {fitted['g'] * 1e9:.3f} ns/byte"
    )
    return fitted


def _row(world: int, nbytes: int, a: str, medians: dict, factor: float, link, fitted: dict):
    """The row of algorithm ``a`` at ``nbytes`` on ``world`` ranks: its time and bandwidths;
    against the built-in without a link, against the link's bound and the model with one
    (``factor``: the bus-bandwidth factor)."""
    t = medians[a]
    row = {
        "world": world,
        "bytes": nbytes,
        "algorithm": a,
        "time_ms": t * 1e3,
        "algbw_GBps": nbytes / t / 1e9,
        "busbw_GBps": nbytes / t / 1e9 * factor,
    }
    if link is None:
        row["x_builtin"] = medians["builtin"] / t if "builtin" in medians else float("nan")
    else:
        bound = costmodel.ring_all_reduce(nbytes, world, link.alpha, link.beta)
        predict = {
            "naive": costmodel.naive_all_reduce,
            "ring": costmodel.ring_all_reduce,
            "ring_async": costmodel.ring_all_reduce,
        }
        model = predict[a](nbytes, world, fitted["a"], fitted["b"], fitted["g"])
        machine = medians[f"{a}@machine"]
        link_only = predict[a](nbytes, world, link.alpha, link.beta)  # no γ: the link
        row.update(
            bound_ms=bound * 1e3,
            efficiency=bound / t,
            model_ms=model * 1e3,
            model_err=(t - model) / model if model else float("nan"),
            machine_ms=machine * 1e3,
            limit="machine" if machine >= MACHINE_SHARE * link_only else "link",
        )
    return row


def run(
    sizes=("1K", "16K", "256K", "1M", "4M", "16M", "64M"),
    world_sizes=(2, 4),
    algorithms=None,
    link=None,
    reps: int = 5,
    warmup: int = 1,
    csv_path=None,
    json_path=None,
) -> list[dict]:
    sizes = [parse_size(s) if isinstance(s, str) else int(s) for s in sizes]
    if algorithms is None:  # the built-in ignores the emulated link: no fair comparison there
        algorithms = ("naive", "ring") if link else ("naive", "ring", "builtin")
    unknown = set(algorithms) - set(ALGORITHMS)
    if unknown:
        raise ValueError(f"unknown algorithms {sorted(unknown)}: choose from {sorted(ALGORITHMS)}")
    fitted = _fitted(link) if link is not None else {}
    rows = []
    combos = [(w, s) for w in world_sizes for s in sizes]
    for world, nbytes in tqdm(combos, desc="bench collectives", unit="size", file=sys.stderr):
        args = (nbytes, list(algorithms), reps, warmup)
        times = launch(_measure, *args, world_size=world, link=link, quiet=True, timeout=900)[0]
        factor = costmodel.BUSBW_FACTOR["all_reduce"](world)
        medians = {a: statistics.median(ts) for a, ts in times.items()}
        for a in algorithms:
            rows.append(_row(world, nbytes, a, medians, factor, link, fitted))
    print(format_table(rows))
    if any(r.get("limit") == "machine" for r in rows):
        print(
            "limit = machine: this machine's own work for the row (machine_ms: the same "
            f"algorithm over a link that costs nothing) is {MACHINE_SHARE:.0%} or more of "
            "what the link alone costs it, so the real copies and reductions, not the "
            "emulated link, set the pace: read efficiency and model_err there as limits of "
            "this machine. More ranks than cores share the cores; a slower --link leaves "
            "the machine more headroom."
        )
    meta = {"bench": "collectives", "link": str(link) if link else None, "reps": reps,
            "fitted": fitted or None}  # fmt: skip
    write(rows, csv_path, json_path, meta=meta)
    return rows
