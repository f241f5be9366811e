"""bench moe: ``ok.moe.MoELayer`` pipelined in k token chunks against the serial layer
(k = 1), for a sweep of k and both schedules (``pipelined``; ``local first``: the tokens
of the rank's own expert computed while every chunk's dispatch travels), against
``ok.costmodel.moe_step``.

One launch on ``world`` ranks, one expert each (Linear–GELU–Linear), ``tokens`` tokens
per rank, top-1 routing by a router whose bias is zero (the tokens spread about evenly
over the experts). Forward only, as in inference and in the forward of training: the
chunked all-to-alls are the forward's (backward sends gradients back chunk by chunk).

The link is sized, unless ``--link`` names one, so that the serial layer's two
all-to-alls (dispatch and combine) cost ``--transfer-share`` (default 1.0) of the expert
compute, at α = 50 µs. Per row: step_ms (median of the slowest rank, ``reps`` rounds
after ``warmup``, every configuration interleaved), × serial (the pipelined schedule's
k = 1), hidden (share of all-to-all time under expert compute, from the timeline), and
predicted_ms: the model fed with one chunk's expert compute timed alone (expert_ms; with
local first, of the others' tokens, and local_ms for the own ones), one chunk's
all-to-all on the link (α-β, a2a_ms), the layer's own host cost per chunk (host_ms: the
layer with experts that do nothing over a link that takes no time, less its routing) and
the routing time.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.distributed as dist

from .. import costmodel, p2p, runtime
from ..moe import MoELayer, make_moe
from ..timeline import Timeline
from .progress import launch_with_progress, median_seconds, slowest, slowest_value
from .table import format_table, write

ALPHA = 50e-6


SCHEDULES = {"pipelined": False, "local first": True}


def _rank_bench(tokens, d_model, d_hidden, chunks, reps, warmup, share, progress):
    me, world = runtime.rank(), runtime.world_size()
    router, experts = make_moe(d_model, d_hidden, world, seed=0)
    with torch.no_grad():
        router.bias.zero_()
    x = torch.randn(tokens, d_model, generator=torch.Generator().manual_seed(me))
    expert = experts[me]
    torch.set_grad_enabled(False)
    configs = [(name, k) for name in SCHEDULES for k in chunks]
    # the parts, alone: the expert on as many tokens as it gets per chunk (about tokens/k
    # arrive per expert; with local first the own tokens, tokens/world, apart) ...
    expert(x)

    @functools.cache  # each row count timed once (and in the same order on every rank)
    def alone(rows):
        return slowest_value(median_seconds(lambda: expert(x[:rows])))

    own = tokens // world
    parts = {("pipelined", k): (alone(-(-tokens // k)), 0.0) for k in chunks}
    parts |= {("local first", k): (alone(-(-(tokens - own) // k)), alone(own)) for k in chunks}
    whole = alone(tokens)
    # ... and the layer's own cost per chunk (routing and sorting, issuing the all-to-alls,
    # moving the bytes, waking threads): the layer with experts that do nothing over a
    # link that takes no time, less its routing
    link = p2p.current_link()
    p2p.set_link(p2p.Link(0, 1e6))
    idle = [torch.nn.Identity()] * world
    overhead = {}
    for name, k in configs:
        tl = Timeline()
        layer = MoELayer(router, idle, chunks=k, timeline=tl, local_first=SCHEDULES[name])
        machinery = slowest_value(median_seconds(lambda layer=layer: layer(x)))
        route0 = statistics.median(s.duration for s in tl.spans if s.name == "route")
        overhead[name, k] = max(machinery - route0, 0.0) / k
    p2p.set_link(link)
    if link is None and share > 0:
        nbytes = tokens * (world - 1) // world * d_model * 4  # leaves a rank per all-to-all
        compute = min(k * parts["pipelined", k][0] for k in chunks)  # as the pipeline computes
        budget = share * compute / 2 - (world - 1) * ALPHA
        link = p2p.Link(ALPHA * 1e6, nbytes / max(budget, 1e-6) / 1e9)
        p2p.set_link(link)
    # a chunk's all-to-all on the link alone (α-β): its host cost is in the machinery
    a2a = {k: costmodel.all_to_all(-(-tokens // k) * d_model * 4, world, link.alpha, link.beta)
           if link else 0.0 for k in chunks}  # fmt: skip
    times, hidden, route, sent = ({c: [] for c in configs} for _ in range(4))
    for i in range(warmup + reps):
        for name, k in configs:
            tl = Timeline()
            layer = MoELayer(router, experts, chunks=k, timeline=tl, local_first=SCHEDULES[name])
            dist.barrier()
            start = time.perf_counter()
            layer(x)
            step = slowest(start, time.perf_counter())
            if i >= warmup:
                times[name, k].append(step)
                hidden[name, k].append(tl.hidden_fraction() or 0.0)
                spans = {s.name: s for s in tl.spans}
                route[name, k].append(spans["dispatch 0"].start - start)
                sent[name, k].append(layer.tokens_sent)
            progress.tick()
    torch.set_grad_enabled(True)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"hidden": hidden, "route": route, "sent": sent})
    if me != 0:
        return None
    return {"times": times, "ranks": per_rank, "parts": parts, "a2a": a2a, "whole": whole,
            "link": link, "overhead": overhead}  # fmt: skip


def run(tokens: int = 4096, d_model: int = 256, d_hidden: int = 1024, world: int = 2,
        chunks=(1, 2, 4, 8, 16), link=None, transfer_share: float = 1.0, reps: int = 5,
        warmup: int = 1, csv_path=None, json_path=None) -> list[dict]:  # fmt: skip
    chunks = sorted(set(chunks) | {1})  # k = 1 is the serial layer, the yardstick
    if max(chunks) > tokens:
        raise ValueError(f"chunk counts {chunks} exceed the {tokens} tokens of a rank")
    total = len(SCHEDULES) * len(chunks) * (warmup + reps)
    result = launch_with_progress(
        _rank_bench, tokens, d_model, d_hidden, chunks, reps, warmup,
        0.0 if link is not None else transfer_share, total=total, desc="bench moe",
        world_size=world, link=link, quiet=True, timeout=1800,
    )[0]  # fmt: skip
    link, ranks = result["link"], result["ranks"]
    sent = statistics.mean(statistics.mean(r["sent"]["pipelined", 1]) for r in ranks)
    print(
        f"{world} ranks, one expert each: Linear({d_model}, {d_hidden})–GELU–Linear; "
        f"{tokens} tokens per rank, {sent:.0f} of them sent to other ranks on average; "
        f"expert compute for every token {result['whole'] * 1e3:.1f} ms; "
        + (f"{link}" if link else "no link")
        + (
            f" (sized so dispatch + combine ≈ {transfer_share:g} × the expert compute, as "
            "the fastest chunking computes it)"
            if transfer_share and link
            else ""
        )  # fmt: skip
    )
    serial = statistics.median(result["times"]["pipelined", 1])
    rows = []
    for name, k in result["times"]:
        step = statistics.median(result["times"][name, k])
        route = max(statistics.median(r["route"][name, k]) for r in ranks)
        chunk_s, local_s = result["parts"][name, k]
        expert = chunk_s + result["overhead"][name, k]
        local = local_s if SCHEDULES[name] else None
        pred = costmodel.moe_step(k, route, expert, result["a2a"][k], local=local)
        rows.append({
            "schedule": name,
            "chunks": k,
            "step_ms": step * 1e3,
            "x_serial": step / serial,
            "hidden": statistics.mean(statistics.median(r["hidden"][name, k]) for r in ranks),
            "expert_ms": chunk_s * 1e3,
            "local_ms": local_s * 1e3,
            "a2a_ms": result["a2a"][k] * 1e3,
            "host_ms": result["overhead"][name, k] * 1e3,
            "predicted_ms": pred["step"] * 1e3,
            "pred_err": (pred["step"] - step) / step,
        })  # fmt: skip
    print(format_table(rows))
    for name in SCHEDULES:
        mine = [r for r in rows if r["schedule"] == name]
        best = min(mine, key=lambda r: r["step_ms"])
        model = min(mine, key=lambda r: r["predicted_ms"])
        print(f"{name}: best chunk count {best['chunks']} ({best['x_serial']:.2f}× serial, "
              f"hidden {best['hidden']:.2f}, predicted {best['pred_err']:+.0%}); the model's "
              f"best: {model['chunks']}")  # fmt: skip
    meta = {"bench": "moe", "tokens": tokens, "d_model": d_model, "d_hidden": d_hidden,
            "world": world, "link": str(link) if link else None}  # fmt: skip
    write(rows, csv_path, json_path, meta=meta)
    return rows
