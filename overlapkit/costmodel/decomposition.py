"""A collective decomposed into chunks that overlap computation, simulated: tensor
parallelism's AllGather-matmul and matmul-ReduceScatter, and a mixture of experts'
dispatch and combine all-to-alls around each chunk's expert compute."""

from __future__ import annotations

from collections.abc import Sequence

from .collectives import all_to_all


def _hidden(spans) -> float:
    """Share of the ``comm`` spans' time that overlaps ``compute`` spans, for simulated
    spans (lane, name, start, end)."""
    from ..timeline import intersect, length, union  # noqa: PLC0415

    comm = union((b, e) for lane, _, b, e in spans if lane == "comm")
    work = union((b, e) for lane, _, b, e in spans if lane == "compute")
    total = length(comm)
    return length(intersect(comm, work)) / total if total else 0.0


def collective_matmul(world: int, chunks: int, compute: float, transfer: float,
                      kind: str = "all_gather") -> dict:  # fmt: skip
    """Simulate one rank of the decomposed AllGather-matmul (``kind="all_gather"``) or
    matmul-ReduceScatter (``"reduce_scatter"``) of ``ok.tensor_parallel``, every rank
    alike: N·chunks pieces, each ``compute`` seconds to multiply, each ``transfer``
    seconds to cross to the right neighbour (α + piece bytes·β; one piece at a time on a
    rank's outgoing link).

    AllGather-matmul: a piece is multiplied once it is in hand and sent on (steps < N−1)
    as its multiplication starts. Matmul-ReduceScatter: a piece is multiplied, added to
    the running sum from the left (once that arrived) and sent on. Returns ``step``,
    ``serial`` (the same transfers and products one after another: the whole collective,
    then the matmul), ``hidden`` (share of transfer time under computation) and ``spans``
    (lane, name, start, end). More chunks: the first product starts sooner and less of
    the last transfer is exposed; each piece pays α once more.
    """
    if kind not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"kind must be 'all_gather' or 'reduce_scatter', got {kind!r}")
    arrive: dict = {}  # (step, piece) -> when it is here (from the left; same for all)
    link = clock = 0.0
    spans = []
    for k in range(world):
        for p in range(chunks):
            ready = arrive.get((k, p), 0.0)
            if kind == "all_gather":
                start = max(clock, ready)
                send_at = start
            else:
                start = clock
                send_at = max(start + compute, ready)
            clock = start + compute
            spans.append(("compute", f"matmul {k}.{p}", start, clock))
            if k < world - 1:
                leave = max(send_at, link)
                link = leave + transfer
                spans.append(("comm", f"send {k}.{p}", leave, link))
                arrive[(k + 1, p)] = link
    step = max(clock, link)
    serial = (world - 1) * chunks * transfer + world * chunks * compute
    return {"step": step, "serial": serial, "hidden": _hidden(spans), "spans": spans}


#: the chunk counts the benches and labs sweep
CHUNK_SWEEP = (1, 2, 4, 8, 16, 32)


def moe_step(chunks: int, route: float, expert, all_to_all, local: float | None = None) -> dict:
    """Simulate one rank of ``ok.moe.MoELayer`` with ``chunks`` token chunks.

    ``route``: seconds before the first dispatch (router, sort, count exchange);
    ``expert``: seconds of expert compute per chunk; ``all_to_all``: seconds of one
    chunk's dispatch (= its combine) — numbers, or one per chunk. The all-to-alls run
    one at a time in the order the layer issues them — D0, D1, C0, D2, C1, … (dispatch
    c+1 is issued before chunk c computes, combine c after) — and chunk c computes once
    D(c) is done. ``chunks=1`` is the serial layer: route, dispatch, compute, combine.

    ``local``: the layer's ``local_first`` schedule, with ``local`` seconds of compute for
    the tokens of the rank's own expert (``expert`` is then a chunk's compute of the
    others' tokens): every dispatch is issued at once, the own tokens computed while they
    travel, then D0 … C0 C1 … as before. Returns ``step``, ``hidden`` (share of
    all-to-all time under expert compute) and ``spans``. More chunks hide more; each
    all-to-all pays its latency and host cost once more, which ``all_to_all`` per chunk
    carries.
    """
    e = expert if isinstance(expert, (list, tuple)) else [expert] * chunks
    a = all_to_all if isinstance(all_to_all, (list, tuple)) else [all_to_all] * chunks
    if len(e) != chunks or len(a) != chunks:
        raise ValueError(f"give one expert time and one all-to-all time per chunk ({chunks})")
    spans = []

    def comm(name, issued, cost):
        nonlocal link
        start = max(issued, link)
        link = start + cost
        spans.append(("comm", name, start, link))
        return link

    link = clock = route
    ahead = chunks if local is not None else 1  # dispatches issued before any compute
    dispatched = {c: comm(f"dispatch {c}", clock, a[c]) for c in range(ahead)}
    if local is not None:
        spans.append(("compute", "expert local", clock, clock + local))
        clock += local
    for c in range(chunks):
        if c + ahead < chunks:
            dispatched[c + ahead] = comm(f"dispatch {c + ahead}", clock, a[c + ahead])
        start = max(clock, dispatched[c])
        clock = start + e[c]
        spans.append(("compute", f"expert {c}", start, clock))
        comm(f"combine {c}", clock, a[c])
    return {"step": link, "hidden": _hidden(spans), "spans": spans}


def moe_best_chunks(route: float, expert: float, nbytes: float, world: int, alpha: float,
                    beta: float, per_op: float = 0.0, per_chunk: float = 0.0,
                    candidates: Sequence[int] = CHUNK_SWEEP) -> tuple[int, dict]:  # fmt: skip
    """The chunk count with the shortest predicted MoE step, from α-β: ``expert`` seconds
    of expert compute for every token and ``nbytes`` of tokens each rank dispatches (all
    chunks); a chunk's all-to-all is ``all_to_all(nbytes/k)`` plus ``per_op`` of host
    cost, its compute ``expert/k + per_chunk``. Returns (best k, {k: step})."""
    steps = {
        k: moe_step(
            k, route, expert / k + per_chunk, all_to_all(nbytes / k, world, alpha, beta) + per_op
        )["step"]  # fmt: skip
        for k in candidates
    }
    return min(steps, key=steps.get), steps
