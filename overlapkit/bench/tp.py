"""bench tp: the decomposed AllGather-matmul and matmul-ReduceScatter against their serial
forms, for a sweep of chunk counts, against ``ok.costmodel.collective_matmul``.

One launch on ``world`` ranks. Column-parallel with a sequence-split input (``ag``):
serial = ``ring_all_gather`` of the input shards, then one matmul; decomposed =
``tensor_parallel.all_gather_matmul(chunks=k)``. Row-parallel with a sequence-split
output (``rs``): serial = one matmul, then ``ring_reduce_scatter``; decomposed =
``tensor_parallel.matmul_reduce_scatter(chunks=k)``. Forward only (the decomposition
is the forward's; backward runs the conjugate collective).

The link is sized, unless ``--link`` names one, so that the whole transfer of the serial
collective costs ``--transfer-share`` (default 1.0) of the whole matmul, at α = 50 µs.
Per row: step_ms (median of the slowest rank, ``reps`` rounds after ``warmup``, every
configuration interleaved), × serial, hidden (share of send time under a multiplication,
from the timeline), predicted_ms from the model fed with each piece's multiplication
timed alone and the link's α + bytes·β, and its error.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .. import costmodel, p2p, runtime
from ..collectives import ring_all_gather, ring_reduce_scatter
from ..tensor_parallel import all_gather_matmul, matmul_reduce_scatter
from ..timeline import Timeline
from .progress import launch_with_progress, median_seconds, slowest, slowest_value
from .table import format_table, write


def _inputs(op: str, rows: int, width: int, world: int):
    """(x, weight) of this rank: ``ag``: its rows of the input and its output features;
    ``rs``: every row of its input features, and its columns of the weight."""
    gen = torch.Generator().manual_seed(runtime.rank())
    if op == "ag":
        return torch.randn(rows, width, generator=gen), torch.randn(width, width, generator=gen)
    return (torch.randn(world * rows, width, generator=gen),
            torch.randn(width, width, generator=gen))  # fmt: skip


def _message_overhead(link) -> float:
    """What one message costs beyond the link's α + bytes·β: a one-float exchange with the
    neighbours, timed (the host's share: posting, waking, copying; each piece pays it)."""
    me, world = runtime.rank(), runtime.world_size()
    if world == 1:
        return 0.0
    one, got = torch.zeros(1), torch.zeros(1)
    right, left = (me + 1) % world, (me - 1) % world

    def exchange():
        p2p.wait_all([p2p.isend(one, right), p2p.irecv(got, left)])

    spent = median_seconds(exchange, reps=9) - (link.message_time(4) if link else 0.0)
    return slowest_value(max(spent, 0.0))


def _serial(op: str, x, w, world: int, tl: Timeline):
    if op == "ag":
        with tl.span("all_gather", "comm"):
            full = x.new_empty((world * len(x), x.shape[1]))
            ring_all_gather(full, x)
        with tl.span("matmul"):
            return full @ w.t()
    with tl.span("matmul"):
        partial = x @ w.t()
    with tl.span("reduce_scatter", "comm"):
        out = partial.new_empty((len(partial) // world, partial.shape[1]))
        ring_reduce_scatter(out, partial)
    return out


def _rank_bench(rows, width, chunks, reps, warmup, share, progress):
    world = runtime.world_size()
    torch.manual_seed(0)
    ops = ("ag", "rs")
    data = {op: _inputs(op, rows, width, world) for op in ops}
    x, w = data["ag"]
    full = torch.randn(world * rows, width)
    whole = median_seconds(lambda: full @ w.t())  # every multiplication of one step, alone
    piece = {k: median_seconds(lambda k=k: x[: -(-rows // k)] @ w.t())
             for k in chunks}  # fmt: skip
    t = torch.tensor([whole, *piece.values()], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's compute sets the pace
    whole, piece = t[0].item(), dict(zip(chunks, t[1:].tolist(), strict=True))
    link = p2p.current_link()
    if link is None and share > 0:
        alpha = 50e-6
        nbytes = (world - 1) * rows * width * 4  # what the serial collective puts on a link
        link = p2p.Link(alpha * 1e6, nbytes / max(share * whole - (world - 1) * alpha, 1e-6) / 1e9)
        p2p.set_link(link)
    per_msg = _message_overhead(link)
    configs = [(op, k) for op in ops for k in [0, *chunks]]  # k = 0: serial
    times = {c: [] for c in configs}
    hidden = {c: [] for c in configs}
    for i in range(warmup + reps):
        for op, k in configs:
            x, w = data[op]
            tl = Timeline()
            dist.barrier()
            start = time.perf_counter()
            if k == 0:
                _serial(op, x, w, world, tl)
            elif op == "ag":
                all_gather_matmul(x, w, chunks=k, timeline=tl, check=False)
            else:
                matmul_reduce_scatter(x, w, chunks=k, timeline=tl, check=False)
            step = slowest(start, time.perf_counter())
            if i >= warmup:
                times[op, k].append(step)
                hidden[op, k].append(tl.hidden_fraction() or 0.0)
            progress.tick()
    if runtime.rank() != 0:
        return None
    return {"times": times, "hidden": hidden, "whole": whole, "piece": piece, "link": link,
            "per_msg": per_msg}  # fmt: skip


def run(rows: int = 512, width: int = 1024, world: int = 2, chunks=(1, 2, 4, 8, 16),
        link=None, transfer_share: float = 1.0, reps: int = 5, warmup: int = 1,
        csv_path=None, json_path=None) -> list[dict]:  # fmt: skip
    if any(k > rows for k in chunks):
        raise ValueError(f"chunk counts {list(chunks)} exceed the {rows} rows of a shard")
    total = 2 * (len(chunks) + 1) * (warmup + reps)
    result = launch_with_progress(
        _rank_bench, rows, width, list(chunks), reps, warmup,
        0.0 if link is not None else transfer_share, total=total, desc="bench tp",
        world_size=world, link=link, quiet=True, timeout=1800,
    )[0]  # fmt: skip
    link, whole, piece = result["link"], result["whole"], result["piece"]
    shard = rows * width * 4
    print(
        f"{world} ranks; shard {rows} × {width} fp32 ({shard / 2**20:.1f} MiB), weight "
        f"{width} × {width}; the whole matmul {whole * 1e3:.1f} ms; "
        + (f"{link}" if link else "no link")
        + (
            f" (sized so the serial collective's transfer ≈ {transfer_share:g} × the matmul)"
            if transfer_share and link
            else ""
        )  # fmt: skip
        + f"; host cost per message beyond the link {result['per_msg'] * 1e3:.2f} ms"
    )
    rows_out = []
    for op in ("ag", "rs"):
        serial = statistics.median(result["times"][op, 0])
        kind = "all_gather" if op == "ag" else "reduce_scatter"
        for k in [0, *chunks]:
            step = statistics.median(result["times"][op, k])
            if k == 0:
                coll = costmodel.ring_all_gather if op == "ag" else costmodel.ring_reduce_scatter
                n_bytes = world * shard
                pred = whole + (coll(n_bytes, world, link.alpha, link.beta) if link else 0.0)
            else:
                moved = link.message_time(-(-rows // k) * width * 4) if link else 0.0
                moved += result["per_msg"]
                pred = costmodel.collective_matmul(world, k, piece[k], moved, kind)["step"]
            rows_out.append({
                "op": "AllGather-matmul" if op == "ag" else "matmul-ReduceScatter",
                "chunks": "serial" if k == 0 else k,
                "step_ms": step * 1e3,
                "x_serial": step / serial,
                "hidden": statistics.median(result["hidden"][op, k]),
                "predicted_ms": pred * 1e3,
                "pred_err": (pred - step) / step,
            })  # fmt: skip
    print(format_table(rows_out))
    for name in ("AllGather-matmul", "matmul-ReduceScatter"):
        mine = [r for r in rows_out if r["op"] == name and r["chunks"] != "serial"]
        best = min(mine, key=lambda r: r["step_ms"])
        model = min(mine, key=lambda r: r["predicted_ms"])
        print(f"{name}: best chunks {best['chunks']} ({best['x_serial']:.2f}× serial, "
              f"hidden {best['hidden']:.2f}); the model's best: {model['chunks']}")  # fmt: skip
    meta = {"bench": "tp", "rows": rows, "width": width, "world": world,
            "link": str(link) if link else None}  # fmt: skip
    write(rows_out, csv_path, json_path, meta=meta)
    return rows_out
