"""Check for lab 11's MoE dispatch plan: per chunk, the tokens in the order they leave
(grouped by expert) and the rows each rank sends and receives.

One rank's plan for its 11 tokens in 3 chunks, on 2 ranks (expert of each token below it)::

    tokens   0 1 2 3 | 4 5 6 7 | 8 9 10        chunk_bounds(11, 3)
    expert   1 0 1 0 | 0 0 1 1 | 1 0 0
    orders   [1 3 0 2] [4 5 6 7] [9 10 8]       each chunk's tokens, expert 0's first
    send     [[2 2]     [2 2]     [2 1]]        send[c, j]: chunk c's rows for rank j
    recv     = exchange_counts(send)            recv[c, i]: chunk c's rows from rank i
"""

from __future__ import annotations

import torch

from .. import handles
from ..collectives import chunk_bounds
from .cases import Case, private_seeds, run_cases
from .common import builtin_collectives
from .lab03_collectives import CHECK_LINK
from .lab11_moe import _moe_tokens, refused_moe_rank
from .lab11_tensor_expert import _WORLD_HINT, _forbidden, _Hinted
from .report import Report

SHAPE = ("return (orders, send, recv): a list of `chunks` index tensors, one per chunk, and "
         "two integer tensors of shape [chunks, N]")  # fmt: skip


def _rows(value):
    """A returned tensor (or list) as nested lists of ints, or None where it is none."""
    try:
        return torch.as_tensor(value).tolist()
    except (TypeError, ValueError, RuntimeError):
        return None


def _described(value, depth: int = 0) -> str:
    """What a returned value is, for a ✘ line: "a tuple of 3: a list of 3 Tensors, …"."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    if isinstance(value, (tuple, list)) and depth < 1:
        inner = ", ".join(_described(v, depth + 1) for v in value[:3])
        return f"a {type(value).__name__} of {len(value)}: {inner}{', …' if len(value) > 3 else ''}"
    if isinstance(value, (tuple, list)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {len(value)} {'/'.join(kinds) or 'nothing'}"
    return f"{type(value).__name__} {value!r:.40}"


def _run_plan(moe_plan, chunks: int, seed: int):
    """On each rank: its own routing only (the seed drawn for it), so what comes here can
    be known only through the count exchange."""
    import overlapkit as ok  # noqa: PLC0415

    _, expert_of = _moe_tokens(seed, ok.rank(), ok.world_size())
    del seed
    handles.take_unwaited()
    with (
        _forbidden({"moe.MoELayer": "ok.moe.MoELayer"}) as called,
        builtin_collectives() as builtin,
    ):
        got = moe_plan(expert_of.clone(), chunks)
    plain = _described(got)
    if isinstance(got, (tuple, list)) and len(got) == 3:
        orders = got[0] if isinstance(got[0], (tuple, list)) else None
        parts = (None if orders is None else [_rows(o) for o in orders],
                 _rows(got[1]), _rows(got[2]))  # fmt: skip
        if None not in parts:
            plain = parts
    return {"got": plain, "called": called, "builtin": builtin,
            "unwaited": handles.take_unwaited(), "expert_of": expert_of.tolist()}  # fmt: skip


def _why_error(text: str) -> str:
    """What a rank's error means for a plan: counts of unequal lengths."""
    if "stack expects each tensor to be equal size" in text or "send must be [chunks" in text:
        return (" — torch.bincount(e) has max(e) + 1 entries, so a chunk whose tokens skip the "
                "last experts gets a shorter row of counts: bincount(…, minlength=N) gives "
                "every rank a count, zero included")  # fmt: skip
    return ""


def check_moe_plan(moe_plan, timeout: float = 20.0) -> Report:
    """Check ``moe_plan(expert_of, chunks) -> (orders, send, recv)`` on 2 and 3 ranks, with
    token counts that differ by rank and do not divide into the chunks, and a rank that
    sends the last expert nothing."""
    report = Report("moe_plan")
    cases = []
    for world, chunks in ((2, 1), (2, 3), (3, 4)):
        what = f"moe_plan on {world} ranks, {chunks} chunk{'s' if chunks > 1 else ''}"
        seeds = private_seeds(world)
        hint = _WORLD_HINT.replace("2 where", "2 (or minlength=2) where") if world > 2 else ""

        def judge(results, what=what, chunks=chunks, hint=hint) -> bool:
            return _judge(_Hinted(report, hint), what, results, chunks)

        cases.append(Case(what, world, _run_plan, (moe_plan, chunks), judge,
                          [{"seed": s} for s in seeds], failures=_Hinted(report, hint),
                          passed="every chunk's tokens grouped by expert, and the rows "
                                 "each rank sends and receives"))  # fmt: skip
    run_cases(report, "check_moe_plan", cases, timeout=timeout, link=CHECK_LINK,
              explain=_why_error)  # fmt: skip
    return report


def _judge(report, what: str, results, chunks: int) -> bool:
    """Every rank's plan against the one its routing makes, the first fault named."""
    world = len(results)
    sends = []
    for rank, (res, traffic) in enumerate(results):
        use = "use ok.moe.exchange_counts"
        if refused_moe_rank(report, what, rank, res, traffic, "plan the dispatch yourself", use):
            return False
        expert_of = res["expert_of"]
        bounds = chunk_bounds(len(expert_of), chunks)
        sends.append([[sum(1 for t in range(lo, hi) if expert_of[t] == j) for j in range(world)]
                      for lo, hi in bounds])  # fmt: skip
        got = res["got"]
        if isinstance(got, str):
            report.fail(f"{what}: rank {rank} returned {got}; {SHAPE}")
            return False
        fault = _order_fault(got[0], expert_of, bounds) or _send_fault(
            got[1], sends[-1], expert_of, world
        )
        if fault:
            report.fail(f"{what}: rank {rank}: {fault}")
            return False
    for rank, (res, _) in enumerate(results):
        want = [[sends[i][c][rank] for i in range(world)] for c in range(chunks)]
        fault = _recv_fault(res["got"][2], want, sends[rank], rank)
        if fault:
            report.fail(f"{what}: rank {rank}: {fault}")
            return False
    return True


def _order_fault(orders, expert_of: list[int], bounds) -> str:
    """What is wrong with the orders ("" when nothing is)."""
    if len(orders) != len(bounds):
        return f"{len(orders)} orders for {len(bounds)} chunks: {SHAPE}"
    for c, ((lo, hi), order) in enumerate(zip(bounds, orders, strict=True)):
        if not isinstance(order, list) or not all(isinstance(t, int) for t in order):
            return f"chunk {c}'s order is {order!r:.60}, not a list of token numbers: {SHAPE}"
        if sorted(order) == list(range(lo, hi)):
            experts = [expert_of[t] for t in order]
            if experts != sorted(experts):
                i = next(i for i in range(len(order) - 1) if experts[i] > experts[i + 1])
                return (
                    f"chunk {c}'s order puts token {order[i]} (expert {experts[i]}) before "
                    f"token {order[i + 1]} (expert {experts[i + 1]}): block j of a dispatch goes "
                    "to rank j, so a chunk's tokens leave grouped by expert, expert 0's first "
                    "(torch.argsort of the chunk's experts gives that order)"
                )
            continue
        if c > 0 and sorted(order) == list(range(hi - lo)):
            return (
                f"chunk {c}'s order holds tokens 0–{hi - lo - 1}, but chunk {c} is tokens "
                f"{lo}–{hi - 1}: torch.argsort(expert_of[lo:hi]) numbers the chunk's tokens "
                "from 0. Add the chunk's offset: torch.argsort(expert_of[lo:hi]) + lo"
            )
        stray = sorted(set(order) - set(range(lo, hi)))
        if stray:
            return (f"chunk {c}'s order holds token {stray[0]}, which is not in chunk {c} "
                    f"(tokens {lo}–{hi - 1}: ok.collectives.chunk_bounds(len(expert_of), "
                    "chunks) gives each chunk's (lo, hi))")  # fmt: skip
        if len(set(order)) < len(order):
            t = next(t for t in order if order.count(t) > 1)
            return f"chunk {c}'s order holds token {t} {order.count(t)} times: each token once"
        missing = sorted(set(range(lo, hi)) - set(order))
        return (
            f"chunk {c}'s order leaves out token {missing[0]} (chunk {c} is tokens "
            f"{lo}–{hi - 1}, as ok.collectives.chunk_bounds(len(expert_of), chunks) gives "
            "each chunk's (lo, hi)): every token of the chunk leaves once"
        )
    return ""


def _send_fault(send, want: list[list[int]], expert_of: list[int], world: int) -> str:
    """What is wrong with the counts sent ("" when nothing is)."""
    shape = [len(send), len(send[0]) if send and isinstance(send[0], list) else 0]
    if not send or not isinstance(send[0], list) or shape != [len(want), world]:
        got = shape if send and isinstance(send[0], list) else send
        short = shape[0] == len(want) and shape[1] < world
        why = (": torch.bincount(e) has max(e) + 1 entries, so this rank, which sends the "
               "last expert nothing, gets a short row; bincount(…, minlength=N) gives every "
               "rank a count") if short else f": {SHAPE}"  # fmt: skip
        return f"send has shape {got}; expected [{len(want)}, {world}] (chunks × ranks){why}"
    if send == want:
        return ""
    whole = [sum(1 for e in expert_of if e == j) for j in range(world)]
    if len(want) > 1 and all(row == whole for row in send):
        return (f"every row of send is {whole}, the counts of all the rank's tokens: send[c] "
                "counts chunk c's tokens only (torch.bincount(expert_of[lo:hi], …))")  # fmt: skip
    c = next(c for c in range(len(want)) if send[c] != want[c])
    j = next(j for j in range(world) if send[c][j] != want[c][j])
    return (f"send[{c}, {j}] is {send[c][j]}, but chunk {c} has {want[c][j]} token(s) for "
            f"expert {j}: send[c, j] counts chunk c's tokens whose expert is j")  # fmt: skip


def _recv_fault(recv, want: list[list[int]], own: list[list[int]], rank: int) -> str:
    """What is wrong with the counts received ("" when nothing is)."""
    if recv == want:
        return ""
    if recv == own:
        return ("recv is this rank's own send: what comes here is what the other ranks send "
                "it, which only they know. ok.moe.exchange_counts(send) trades the counts: "
                "recv[c, i] is what rank i sends here in chunk c")  # fmt: skip
    transposed = [list(col) for col in zip(*want, strict=True)]
    if recv == transposed:
        return (
            "recv is the counts transposed: it should be [chunks, N], recv[c, i] the rows "
            "of chunk c rank i sends here, as ok.moe.exchange_counts(send) returns it"
        )
    return (
        f"recv is {recv}; expected {want}: recv[c, i] is send[c, {rank}] of rank i, the "
        "rows of chunk c that rank i sends here (ok.moe.exchange_counts(send))"
    )
