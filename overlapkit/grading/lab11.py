"""Checks for lab 11: the decomposed AllGather-matmul, and the chunked (pipelined) MoE."""

from __future__ import annotations

import time

import torch

from .. import handles
from ..collectives import chunk_bounds
from .collectives import CHECK_LINK
from .common import builtin_collectives as _builtins
from .common import recorded_calls, refused_rank, run_or_report
from .report import Report

# --------------------------------------------------------------------------- shared


def _forbidden(names: dict):
    """Record the learner's calls of the kit functions ``names`` (dotted on overlapkit)."""
    import overlapkit as ok  # noqa: PLC0415

    return recorded_calls(ok, names)


class _Log:
    """Message posts and waits (``ok.p2p`` and ``ok.all_to_all``) and compute calls, in the
    order they happened: one list of (time, event, index). Verdicts read the order (a
    position in the list), never the times, so that they do not depend on the machine's
    speed."""

    def __init__(self):
        self.events: list[tuple[float, str, int]] = []

    def mark(self, event: str, index: int) -> None:
        self.events.append((time.perf_counter(), event, index))

    def wrap_handle(self, handle, event: str, index: int):
        original = handle.wait

        waited = []

        def wait(*args, **kwargs):
            result = original(*args, **kwargs)
            if not waited:  # the first wait is when the data was asked for
                waited.append(True)
                self.mark(event, index)
            return result

        handle.wait = wait
        return handle


def _compute_calls(events, compute: str) -> list[tuple[int, int | None]]:
    """(start, end) positions in ``events`` of each ``compute`` call."""
    calls: list = []
    for at, (_, e, _) in enumerate(events):
        if e == compute + " start":
            calls.append([at, None])
        elif e == compute + " end" and calls:
            calls[-1][1] = at
    return [tuple(c) for c in calls]


def _in_flight_across(events, issued: str, waited: str, compute: str, only=None) -> list[int]:
    """The ``issued`` messages (those numbered in ``only``, if given) that were in flight,
    posted and not yet waited, across a whole ``compute`` call: their numbers."""
    starts = {i: at for at, (_, e, i) in enumerate(events)
              if e == issued and (only is None or i in only)}  # fmt: skip
    ends: dict = {}
    for at, (_, e, i) in enumerate(events):
        if e == waited:
            ends.setdefault(i, at)
    calls = _compute_calls(events, compute)
    return [
        i for i, a0 in starts.items()
        if any(a > a0 and b is not None and b < ends.get(i, len(events)) for a, b in calls)
    ]  # fmt: skip


def _overlapped(events, issued: str, waited: str, compute: str, only=None) -> int:
    """How many ``issued`` messages (those numbered in ``only``, if given) were in flight,
    posted and not yet waited, across a whole ``compute`` call."""
    return len(_in_flight_across(events, issued, waited, compute, only))


# --------------------------------------------------------------------------- AG-matmul

ROWS, FEATURES, OUT = 3, 5, 4
_PRODUCTS = {"matmul", "__matmul__", "mm", "linear", "addmm", "einsum", "bmm"}

_AG_FORBIDDEN = {
    "ring_all_gather": "ok.ring_all_gather",
    "tensor_parallel.all_gather_matmul": "ok.tensor_parallel.all_gather_matmul",
    "all_to_all": "ok.all_to_all",
}


def _run_ag(ag_matmul):
    import overlapkit as ok  # noqa: PLC0415

    me, world = ok.rank(), ok.world_size()
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(world * ROWS, FEATURES, generator=gen)
    weight = torch.randn(OUT, FEATURES, generator=torch.Generator().manual_seed(8 + me))
    x = full[me * ROWS : (me + 1) * ROWS].clone()
    log = _Log()
    orig_isend, orig_irecv = ok.p2p.isend, ok.p2p.irecv
    counter = {"send": 0, "recv": 0}

    sending: dict = {}  # data_ptr -> the send's handle, while it may still read it
    aliased = []

    def isend(tensor, dst, group=None):
        n = counter["send"] = counter["send"] + 1
        log.mark("send", n)
        handle = log.wrap_handle(orig_isend(tensor, dst, group), "send waited", n)
        ptr, inner = tensor.data_ptr(), handle.wait
        sending[ptr] = handle

        def wait(*args, **kwargs):
            result = inner(*args, **kwargs)
            sending.pop(ptr, None)  # sent: its memory may be used again
            return result

        handle.wait = wait
        return handle

    def irecv(tensor, src, group=None):
        n = counter["recv"] = counter["recv"] + 1
        log.mark("recv", n)
        if tensor.data_ptr() in sending:  # receiving over what is being sent
            aliased.append(n)
        return log.wrap_handle(orig_irecv(tensor, src, group), "recv waited", n)

    class Watched(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            product = getattr(func, "__name__", "") in _PRODUCTS
            if product:
                log.mark("matmul start", 0)
            out = func(*args, **(kwargs or {}))
            if product:
                log.mark("matmul end", 0)
            return out

    handles.take_unwaited()
    ok.p2p.isend, ok.p2p.irecv = isend, irecv
    try:
        with _forbidden(_AG_FORBIDDEN) as called, _builtins() as builtin, Watched():
            got = ag_matmul(x, weight)
    finally:
        ok.p2p.isend, ok.p2p.irecv = orig_isend, orig_irecv
    return {
        "got": got if isinstance(got, torch.Tensor) else repr(got)[:80],
        "want": full @ weight.t(),
        "shards": [full[r * ROWS : (r + 1) * ROWS] @ weight.t() for r in range(world)],
        "called": called,
        "builtin": builtin,
        "events": log.events,
        "aliased": aliased,
        "unwaited": handles.take_unwaited(),
    }


def check_ag_matmul(ag_matmul, timeout: float = 20.0) -> Report:
    """Check ``ag_matmul(x, weight)`` (``AllGather(x) @ weightᵀ`` round the ring, each
    shard multiplied while the next travels) on 2 and 3 ranks against gather-then-multiply:
    which rank, which block of rows (whose shard) differs; then that it was built from
    ``ok.p2p`` messages and that a transfer was in flight during a multiplication."""
    report = Report("ag_matmul")
    for world in (2, 3):
        what = f"ag_matmul on {world} ranks"
        results = run_or_report(report, what, _run_ag, ag_matmul, world_size=world,
                                timeout=timeout, link=CHECK_LINK)  # fmt: skip
        if results is None or not _ag_results(report, what, results, world):
            return report
    report.ok("every rank holds AllGather(x) @ Wᵀ, shard by shard, on 2 and 3 ranks")
    return report


def _ag_results(report, what, results, world) -> bool:
    for rank, (res, traffic) in enumerate(results):
        if res["called"]:
            name = _AG_FORBIDDEN[res["called"][0]]
            report.fail(
                f"{what}: rank {rank} called {name}, which does the gathering for you: "
                "pass the shards round the ring with ok.p2p.isend / irecv yourself"
            )
            return False
        if refused_rank(report, what, rank, res, traffic, "build it from ok.p2p.isend / irecv"):
            return False
        if res["aliased"]:
            report.fail(
                f"{what}: rank {rank} received the next shard into the tensor it was still "
                "sending (and multiplying): the arriving shard overwrites the one in hand. "
                "Receive into a new tensor (torch.empty_like) and swap after the wait"
            )
            return False
        got, want = res["got"], res["want"]
        if not isinstance(got, torch.Tensor):
            report.fail(f"{what}: rank {rank} returned {got}, not a tensor of shape "
                        f"{list(want.shape)}")  # fmt: skip
            return False
        if got.shape != want.shape:
            report.fail(f"{what}: rank {rank} returned shape {list(got.shape)}; expected "
                        f"{list(want.shape)} (every rank's {ROWS} rows, this rank's "
                        f"{OUT} output features)")  # fmt: skip
            return False
        for src in range(world):
            block = got[src * ROWS : (src + 1) * ROWS]
            if torch.allclose(block, res["shards"][src], atol=1e-5):
                continue
            holds = next(
                (
                    r
                    for r in range(world)
                    if r != src and torch.allclose(block, res["shards"][r], atol=1e-5)
                ),
                None,
            )
            diff = (block - res["shards"][src]).abs()
            i, j = divmod(int(diff.argmax()), OUT)
            hint = (
                f" — they hold shard {holds}'s product: the shard in hand at ring step k came "
                f"from rank (rank − k) mod N, and its rows go to block (rank − k) mod N"
                if holds is not None
                else " — a shard used before its receive was waited (or never received) "
                "leaves garbage there: wait for the receive before multiplying what came"
            )
            report.fail(
                f"{what}: rank {rank}, rows {src * ROWS}–{(src + 1) * ROWS - 1} (shard of rank "
                f"{src}): at row {src * ROWS + i}, column {j} expected "
                f"{res['shards'][src][i, j].item():.4f}, got {block[i, j].item():.4f}{hint}"
            )
            return False
    for rank, (res, _) in enumerate(results):
        sends = sum(1 for _, e, _ in res["events"] if e == "send")
        if sends < world - 1:
            report.fail(f"{what}: rank {rank} sent {sends} message(s); passing every shard on "
                        f"round the ring takes N − 1 = {world - 1}")  # fmt: skip
            return False
        if _overlapped(res["events"], "recv", "recv waited", "matmul") == 0:
            report.fail(
                f"{what}: rank {rank} waited for each incoming shard before it "
                "multiplied the one in hand: no transfer was in flight during a "
                "multiplication. Post the send and the receive, multiply, then wait"
            )
            return False
    return True


# --------------------------------------------------------------------------- chunked MoE

TOKENS, D = 11, 4  # per rank: not a multiple of the chunk counts checked


def _run_moe(chunked_moe, chunks):
    import overlapkit as ok  # noqa: PLC0415

    me, world = ok.rank(), ok.world_size()
    n = TOKENS + me  # ranks hold different token counts
    x = torch.randn(n, D, generator=torch.Generator().manual_seed(20 + me))
    expert_of = torch.randint(0, world, (n,), generator=torch.Generator().manual_seed(30 + me))
    torch.manual_seed(40)
    experts = [torch.nn.Linear(D, D) for _ in range(world)]
    want = torch.stack([experts[int(e)](t) for t, e in zip(x, expert_of, strict=True)]).detach()
    log = _Log()
    counter = [0]
    orig = ok.all_to_all

    outputs: set = set()  # storages of the expert's outputs: what a combine sends
    received: dict = {}  # an all-to-all's output storage -> its number
    dispatches: set = set()  # all-to-alls whose output the expert then computed on
    combines: set = set()  # all-to-alls that sent what the expert computed
    tokens: dict = {}  # an all-to-all's number -> the tokens (rows of x) it sent

    def all_to_all(*args, **kwargs):
        counter[0] += 1
        n_ = counter[0]
        source = args[1] if len(args) > 1 else kwargs.get("input")
        if isinstance(source, torch.Tensor) and source.is_floating_point():
            rows = _token_numbers(source, x)
            if any(i >= 0 for i in rows):  # rows of x: a dispatch
                tokens[n_] = rows
            elif source.data_ptr() in outputs or any(e == "expert start" for _, e, _ in log.events):
                combines.add(n_)  # the expert's outputs, on their way back
        target = args[0] if args else kwargs.get("output")
        if isinstance(target, torch.Tensor):
            received[target.data_ptr()] = n_
        log.mark("a2a", n_)
        handle = orig(*args, **kwargs)
        if kwargs.get("async_op"):
            return log.wrap_handle(handle, "a2a waited", n_)
        log.mark("a2a waited", n_)
        return handle

    expert = experts[me]
    orig_forward = expert.forward

    def forward(inp):
        if isinstance(inp, torch.Tensor) and inp.data_ptr() in received:
            dispatches.add(received[inp.data_ptr()])
        log.mark("expert start", 0)
        out = orig_forward(inp)
        log.mark("expert end", 0)
        outputs.add(out.data_ptr())
        return out

    expert.forward = forward
    handles.take_unwaited()
    ok.all_to_all = all_to_all
    try:
        with (_forbidden({"moe.MoELayer": "ok.moe.MoELayer"}) as called, _builtins() as builtin,
              torch.no_grad()):  # fmt: skip
            got = chunked_moe(x, expert_of, expert, chunks)
    finally:
        ok.all_to_all = orig
    return {
        "got": got if isinstance(got, torch.Tensor) else repr(got)[:80],
        "want": want,
        "called": called,
        "builtin": builtin,
        "events": log.events,
        "a2a": counter[0],
        "dispatches": dispatches,
        "combines": sorted(combines - dispatches),
        "tokens": tokens,
        "unwaited": handles.take_unwaited(),
        "expert_of": expert_of,
    }


def _token_numbers(rows: torch.Tensor, x: torch.Tensor) -> list[int]:
    """Which token (row of ``x``) each row of ``rows`` is (−1: none); x's rows are random,
    so equal rows are the same token."""
    if rows.dim() != 2 or rows.shape[1] != x.shape[1]:
        return [-1] * (len(rows) if rows.dim() else 0)
    same = (rows.detach()[:, None, :] == x[None, :, :]).all(dim=-1)
    found = same.any(dim=1)
    return [int(i) if f else -1 for i, f in zip(same.int().argmax(dim=1), found, strict=True)]


def check_chunked_moe(chunked_moe, timeout: float = 20.0) -> Report:
    """Check ``chunked_moe(x, expert_of, expert, chunks)`` (every token through the expert
    ``expert_of`` names, on that expert's rank; tokens in ``chunks`` chunks, the next
    chunk's dispatch in flight while this one's expert computes) on 2 and 3 ranks, with
    token counts that differ by rank and do not divide into the chunks."""
    report = Report("chunked_moe")
    for world, chunks in ((2, 1), (2, 3), (3, 4)):
        what = f"chunked_moe on {world} ranks, {chunks} chunk{'s' if chunks > 1 else ''}"
        results = run_or_report(report, what, _run_moe, chunked_moe, chunks, world_size=world,
                                timeout=timeout, link=CHECK_LINK)  # fmt: skip
        if results is None or not _moe_results(report, what, results, chunks):
            return report
        report.ok(f"{what}: every token came back with its expert's output")
    return report


def _moe_results(report, what, results, chunks) -> bool:
    for rank, (res, traffic) in enumerate(results):
        if res["called"]:
            report.fail(f"{what}: rank {rank} used ok.moe.MoELayer, the kit's answer: "
                        "dispatch and combine with ok.all_to_all yourself")  # fmt: skip
            return False
        if refused_rank(report, what, rank, res, traffic, "use ok.all_to_all"):
            return False
        twice = _dispatched_twice(res, chunks)
        if twice:
            report.fail(f"{what}: rank {rank} {twice}")
            return False
        got, want = res["got"], res["want"]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            shape = list(got.shape) if isinstance(got, torch.Tensor) else got
            report.fail(
                f"{what}: rank {rank} returned {shape}; expected a tensor of shape "
                f"{list(want.shape)}: one output per token, in the tokens' order"
            )
            return False
        bad = [i for i in range(len(want)) if not torch.allclose(got[i], want[i], atol=1e-5)]
        if bad:
            i = bad[0]
            twin = next((j for j in range(len(want))
                         if torch.allclose(got[i], want[j], atol=1e-5)), None)  # fmt: skip
            hint = (
                f" — it holds token {twin}'s output: put each returned row back at its token's "
                "place (undo the sort by expert)"
                if twin is not None
                else " — rows sent to the wrong expert give such values: sort each chunk's "
                "tokens by expert before the dispatch (block j of what you send goes to rank "
                "j) and give the split sizes in rank order"
            )
            report.fail(
                f"{what}: rank {rank}, token {i} (expert {int(res['expert_of'][i])}): expected "
                f"{[round(v, 4) for v in want[i].tolist()]}, got "
                f"{[round(v, 4) for v in got[i].tolist()]}; {len(bad)} of {len(want)} tokens "
                f"differ{hint}"
            )
            return False
    for rank, (res, _) in enumerate(results):
        if res["a2a"] < 2 * chunks:
            report.fail(
                f"{what}: rank {rank} ran {res['a2a']} all-to-all(s); chunking the "
                f"tokens means one dispatch and one combine per chunk ({2 * chunks})"
            )
            return False
        if (
            chunks > 1
            and _overlapped(res["events"], "a2a", "a2a waited", "expert", res["dispatches"]) == 0
        ):
            report.fail(f"{what}: rank {rank} had no dispatch in flight while its expert "
                        "computed: issue the next chunk's dispatch (async_op=True) before "
                        "computing this one, and wait for it only when you need it")  # fmt: skip
            return False
        exposed = _exposed_combines(res) if chunks > 1 else []
        if exposed:
            c, n = exposed[0], len(res["combines"]) - 1
            report.fail(
                f"{what}: rank {rank} waited for chunk {c}'s combine before its expert began "
                f"on chunk {c + 1}: nothing computed while that combine travelled ({len(exposed)} "
                f"of the {n} combines that can hide were waited so). Issue each combine with "
                "async_op=True and wait for them after the loop (or one chunk later), so that "
                "chunk c's combine travels while chunk c + 1 is in the expert"
            )
            return False
    return True


def _exposed_combines(res) -> list[int]:
    """The chunks (numbered in issue order) whose combine was waited before another
    chunk's expert call could run beneath it; the last combine has none after it. Read
    from the order of the issue, wait and compute events, not from their times."""
    combines = res["combines"]
    hidden = set(_in_flight_across(res["events"], "a2a", "a2a waited", "expert", set(combines)))
    return [c for c, i in enumerate(combines[:-1]) if i not in hidden]


def _dispatched_twice(res, chunks: int) -> str:
    """Why some token left in more than one dispatch ("" when none did)."""
    sent: dict[int, int] = {}
    for rows in res["tokens"].values():
        for t in rows:
            if t >= 0:
                sent[t] = sent.get(t, 0) + 1
    twice = sorted(t for t, k in sent.items() if k > 1)
    if not twice:
        return ""
    n = len(res["want"])
    first = chunk_bounds(n, chunks)[0][1]  # the first chunk's tokens: 0 … first − 1
    if max(sent) < first < n:
        return (
            f"dispatched only tokens 0–{max(sent)}, some of them in several chunks' dispatches, "
            f"and tokens {first}–{n - 1} never: torch.argsort(expert_of[lo:hi]) numbers a "
            "chunk's tokens from 0, so every chunk indexed the first chunk's rows. Add the "
            "chunk's offset: order = torch.argsort(expert_of[lo:hi], stable=True) + lo (for "
            "x[order] and out[order] alike)"
        )
    t = twice[0]
    return (f"sent token {t} in {sent[t]} dispatches ({len(twice)} token(s) went out more "
            "than once): each token goes out once, in its own chunk's dispatch")  # fmt: skip
