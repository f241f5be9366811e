"""Check for lab 11's chunked (pipelined) MoE: every token through its expert, the next
chunk's dispatch in flight while this one's expert computes."""

from __future__ import annotations

import torch

from .. import handles
from ..collectives import chunk_bounds
from .cases import Case, private_seeds, run_cases
from .common import builtin_collectives as _builtins
from .common import (
    refused_rank,
)
from .lab03_collectives import CHECK_LINK
from .lab11_tensor_expert import (
    _WORLD_HINT,
    _forbidden,
    _Hinted,
    _in_flight_across,
    _Log,
    _overlapped,
    _rank_result,
    _tensors,
)
from .report import Report

# --------------------------------------------------------------------------- chunked MoE

TOKENS, D = 11, 4  # per rank: not a multiple of the chunk counts checked


#: calls that read a tensor's shape, not its values: no race with an op filling it
_METADATA = {"__get__", "__len__", "size", "dim", "numel", "stride", "data_ptr",
             "untyped_storage", "storage_offset", "is_contiguous", "element_size",
             "is_floating_point", "new_empty", "new_zeros", "new_ones", "new_full", "empty_like",
             "zeros_like", "ones_like"}  # fmt: skip


def _moe_tokens(seed: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's tokens and the expert each goes to, from the seed drawn for it. Rank 0
    sends the last expert nothing, whatever the seed: counts made without
    ``minlength=world`` then come out one short there, every time (with random routing
    alone, a fresh-clone run once gave every expert a token and passed that mistake)."""
    gen = torch.Generator().manual_seed(seed)
    n = TOKENS + rank  # ranks hold different token counts
    experts = world - 1 if rank == 0 and world > 1 else world
    return torch.randn(n, D, generator=gen), torch.randint(0, experts, (n,), generator=gen)


def _moe_expert(seed: int) -> torch.nn.Linear:
    """A rank's expert, from the seed drawn for it (torch's global generator left as it was)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.Linear(D, D)


class _AllToAlls:
    """``ok.all_to_all`` and the rank's expert as the check watches them: each all-to-all
    logged and told a dispatch or a combine, its output held in flight until its wait."""

    def __init__(self, log: _Log, x: torch.Tensor, world: int, orig):
        self.log, self.x, self.world, self.orig = log, x, world, orig
        self.count = 0
        self.outputs: set = set()  # storages of the expert's outputs: what a combine sends
        self.received: dict = {}  # an all-to-all's output storage -> its number
        self.dispatches: set = set()  # all-to-alls whose output the expert then computed on
        self.combines: set = set()  # all-to-alls that sent what the expert computed
        self.tokens: dict = {}  # an all-to-all's number -> the tokens (rows of x) it sent
        self.blocks: dict = {}  # a dispatch's number -> the rows it sent to each rank
        # an async all-to-all's output storage -> (kind, chunk) until waited
        self.in_flight: dict = {}
        self.touched: list = []  # (kind, chunk) of outputs read while in flight
        # the kit's own calls (filling, copying back) are no read of the learner
        self.inside = False

    def all_to_all(self, *args, **kwargs):
        """The kit's all_to_all, numbered, logged, and its output's storage noted."""
        self.count += 1
        n_ = self.count
        kind = self._kind(n_, args, kwargs)
        chunk = len(self.tokens) - 1 if kind == "dispatch" else len(self.combines) - 1
        target = args[0] if args else kwargs.get("output")
        if isinstance(target, torch.Tensor):
            self.received[target.data_ptr()] = n_
        self.log.mark("a2a", n_)
        self.inside = True
        try:
            handle = self.orig(*args, **kwargs)
        finally:
            self.inside = False
        if not kwargs.get("async_op"):
            self.log.mark("a2a waited", n_)
            return handle
        handle = self.log.wrap_handle(handle, "a2a waited", n_)
        if isinstance(target, torch.Tensor):
            self._in_flight_until_waited(handle, target, (kind, chunk))
        return handle

    def _kind(self, n_: int, args, kwargs) -> str:
        """What all-to-all ``n_`` sends: rows of x (dispatch) or the expert's outputs (combine)."""
        source = args[1] if len(args) > 1 else kwargs.get("input")
        if isinstance(source, torch.Tensor) and source.is_floating_point():
            rows = _token_numbers(source, self.x)
            if any(i >= 0 for i in rows):  # rows of x: a dispatch
                self.tokens[n_] = rows
                splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
                self.blocks[n_] = _blocks(rows, splits, self.world)
                return "dispatch"
            if source.data_ptr() in self.outputs or any(
                e == "expert start" for _, e, _ in self.log.events
            ):
                self.combines.add(n_)  # the expert's outputs, on their way back
                return "combine"
        return "all-to-all"

    def _in_flight_until_waited(self, handle, target: torch.Tensor, what: tuple) -> None:
        """Holds ``target``'s storage in flight as ``what`` (kind, chunk) until its wait."""
        key = target.untyped_storage().data_ptr()
        self.in_flight[key] = what
        inner = handle.wait

        def wait(*a, **k):
            self.inside = True
            try:
                return inner(*a, **k)
            finally:
                self.inside = False
                self.in_flight.pop(key, None)

        handle.wait = wait

    def watch_expert(self, expert: torch.nn.Module) -> None:
        """Logs each call of ``expert``: which all-to-all's output it took, where its own lives."""
        orig_forward = expert.forward

        def forward(inp):
            if isinstance(inp, torch.Tensor) and inp.data_ptr() in self.received:
                self.dispatches.add(self.received[inp.data_ptr()])
            self.log.mark("expert start", 0)
            out = orig_forward(inp)
            self.log.mark("expert end", 0)
            self.outputs.add(out.data_ptr())
            return out

        expert.forward = forward


class _Touches(torch.overrides.TorchFunctionMode):
    """Notes a read of an all-to-all's output before its wait (under the check's race
    guard it holds NaN then: this says which output it was)."""

    def __init__(self, a2a: _AllToAlls):
        super().__init__()
        self.a2a = a2a

    def __torch_function__(self, func, types, args=(), kwargs=None):
        a2a = self.a2a
        if a2a.in_flight and not a2a.inside and getattr(func, "__name__", "") not in _METADATA:
            for a in _tensors(args, kwargs):
                hit = a2a.in_flight.get(a.untyped_storage().data_ptr())
                if hit is not None:
                    a2a.touched.append(hit)
                    break
        return func(*args, **(kwargs or {}))


def _run_moe(chunked_moe, chunks, seed: int, expert_seed: int):
    """On each rank: its own tokens and its own expert only (seeds drawn per check and sent
    to this rank alone), so no rank can work out another's tokens or apply another's
    expert without the all-to-alls; what is wanted is worked out by the checking process
    (:func:`_moe_wants`)."""
    import overlapkit as ok  # noqa: PLC0415

    me, world = ok.rank(), ok.world_size()
    x, expert_of = _moe_tokens(seed, me, world)
    expert = _moe_expert(expert_seed)
    del seed, expert_seed
    log = _Log()
    a2a = _AllToAlls(log, x, world, ok.all_to_all)
    a2a.watch_expert(expert)
    handles.take_unwaited()
    ok.all_to_all = a2a.all_to_all
    try:
        with (_forbidden({"moe.MoELayer": "ok.moe.MoELayer"}) as called, _builtins() as builtin,
              torch.no_grad(), _Touches(a2a)):  # fmt: skip
            got = chunked_moe(x, expert_of, expert, chunks)
    finally:
        ok.all_to_all = a2a.orig
    return {
        **_rank_result(got, called, builtin, log),
        "a2a": a2a.count,
        "dispatches": a2a.dispatches,
        "combines": sorted(a2a.combines - a2a.dispatches),
        "tokens": a2a.tokens,
        "blocks": [a2a.blocks[k] for k in sorted(a2a.blocks)],
        "touched": a2a.touched,
        "unwaited": handles.take_unwaited(),
        "expert_of": expert_of,
    }


def _blocks(rows: list[int], splits, world: int) -> list[list[int]]:
    """The tokens of ``rows`` that went to each rank, block j to rank j."""
    if splits is None:
        splits = [len(rows) // world] * world
    splits = [int(s) for s in splits]
    bounds = [sum(splits[:j]) for j in range(len(splits) + 1)]
    return [rows[bounds[j] : bounds[j + 1]] for j in range(len(splits))]


def _token_numbers(rows: torch.Tensor, x: torch.Tensor) -> list[int]:
    """Which token (row of ``x``) each row of ``rows`` is (−1: none); x's rows are random,
    so equal rows are the same token."""
    if rows.dim() != 2 or rows.shape[1] != x.shape[1]:
        return [-1] * (len(rows) if rows.dim() else 0)
    same = (rows.detach()[:, None, :] == x[None, :, :]).all(dim=-1)
    found = same.any(dim=1)
    return [int(i) if f else -1 for i, f in zip(same.int().argmax(dim=1), found, strict=True)]


def _moe_wants(results: list, seeds: list[int], expert_seeds: list[int]) -> None:
    """In the checking process: each token through every expert, and through its own."""
    world = len(seeds)
    experts = [_moe_expert(s) for s in expert_seeds]
    for rank, ((res, _), seed) in enumerate(zip(results, seeds, strict=True)):
        x, expert_of = _moe_tokens(seed, rank, world)
        with torch.no_grad():
            res["through"] = torch.stack([e(x) for e in experts], dim=1)  # [token, expert, D]
        res["want"] = res["through"][torch.arange(len(x)), expert_of]
        res["expert_of"] = expert_of  # the rank's own copy is the learner's to change


def check_chunked_moe(chunked_moe, timeout: float = 20.0) -> Report:
    """Check ``chunked_moe(x, expert_of, expert, chunks)`` (every token through the expert
    ``expert_of`` names, on that expert's rank; tokens in ``chunks`` chunks, the next
    chunk's dispatch in flight while this one's expert computes) on 2 and 3 ranks, with
    token counts that differ by rank and do not divide into the chunks."""
    report = Report("chunked_moe")
    cases = [_moe_case(report, chunked_moe, world, chunks)
             for world, chunks in ((2, 1), (2, 3), (3, 4))]  # fmt: skip
    run_cases(report, "check_chunked_moe", cases, timeout=timeout, link=CHECK_LINK,
              explain=_split_sizes)  # fmt: skip
    return report


def _moe_case(report: Report, chunked_moe, world: int, chunks: int) -> Case:
    what = f"chunked_moe on {world} ranks, {chunks} chunk{'s' if chunks > 1 else ''}"
    # the 3-rank case runs once the 2-rank ones passed
    hint = _WORLD_HINT.replace("2 where", "2 (or minlength=2) where") if world > 2 else ""
    seeds, expert_seeds = private_seeds(world), private_seeds(world)

    def judge(results) -> bool:
        _moe_wants(results, seeds, expert_seeds)
        return _moe_results(report, what, results, chunks, hint)

    private = [{"seed": s, "expert_seed": e} for s, e in zip(seeds, expert_seeds, strict=True)]
    return Case(what, world, _run_moe, (chunked_moe, chunks), judge, private,
                passed="every token came back with its expert's output",
                failures=_Hinted(report, hint))  # fmt: skip


#: a rank whose tokens came back right with no all-to-all the check saw
_UNSEEN = ("returned the right outputs, but none of its all-to-alls went through "
           "ok.all_to_all as the check sees it (it watches that name, to tell what overlaps "
           "what): call it as ok.all_to_all(...), not by a name imported or saved before the "
           "check ran (from overlapkit import all_to_all, a2a = ok.all_to_all)")  # fmt: skip
#: a rank that ran no all-to-all the check saw, and whose outputs are wrong
_NONE = ("ran no all-to-all the check saw: each token goes to its expert's rank with "
         "ok.all_to_all (the dispatch) and comes back the same way (the combine); call it by "
         "that name, which the check watches")  # fmt: skip


def _all_right(res) -> bool:
    """Whether a rank's outputs are every token's through its own expert."""
    got, want = res["got"], res["want"]
    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and bool(torch.allclose(got, want, atol=1e-5)))  # fmt: skip


def _split_sizes(error: str) -> str:
    """What the split sizes of an all-to-all are, after an error about them."""
    if "split_sizes" not in error:
        return ""
    return (
        " — input_split_sizes[j] is how many rows this rank sends to rank j (they add up to "
        "the input's rows), output_split_sizes[j] how many it receives from rank j (they add "
        "up to the output's rows). In the combine, this rank sends every rank back as many "
        "rows as that rank dispatched here"
    )


def refused_moe_rank(report, what, rank, res, traffic, instead: str, use: str) -> bool:
    """The ✘ line for a rank that ran the kit's MoE layer (``instead``: what to do) or a
    built-in collective (``use``: what to call), or left an operation unwaited."""
    if res["called"]:
        report.fail(f"{what}: rank {rank} used ok.moe.MoELayer, the kit's answer: {instead}")
        return True
    return refused_rank(report, what, rank, res, traffic, use)


def _moe_results(report, what, results, chunks, hint) -> bool:
    for rank, (res, traffic) in enumerate(results):
        instead = "dispatch and combine with ok.all_to_all yourself"
        if refused_moe_rank(report, what, rank, res, traffic, instead, "use ok.all_to_all"):
            return False
        twice = _dispatched_twice(res, chunks)
        if twice:
            report.fail(f"{what}: rank {rank} {twice}")
            return False
        got, want = res["got"], res["want"]
        if res["a2a"] == 0:  # right everywhere: the all-to-alls went by a name the check missed
            right = all(_all_right(r) for r, _ in results)
            report.fail(f"{what}: rank {rank} " + (_UNSEEN if right else _NONE))
            return False
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            shape = list(got.shape) if isinstance(got, torch.Tensor) else got
            _Hinted(report, hint).fail(
                f"{what}: rank {rank} returned {shape}; expected a tensor of shape "
                f"{list(want.shape)}: one output per token, in the tokens' order"
            )
            return False
        bad = [i for i in range(len(want)) if not torch.allclose(got[i], want[i], atol=1e-5)]
        if bad:
            i = bad[0]
            report.fail(
                f"{what}: rank {rank}, token {i} (expert {int(res['expert_of'][i])}): expected "
                f"{[round(v, 4) for v in want[i].tolist()]}, got "
                f"{[round(v, 4) for v in got[i].tolist()]}; {len(bad)} of {len(want)} tokens "
                f"differ — {_moe_wrong_rows(res, bad)}"
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


def _moe_wrong_rows(res, bad: list[int]) -> str:
    """Why the tokens ``bad`` hold wrong outputs: an all-to-all's output read before its
    wait (NaN under the race guard), a dispatch not sorted by expert, outputs not put back
    at their tokens' places, or a token through the wrong expert."""
    if res["touched"]:
        kind, c = res["touched"][0]
        what = {
            "dispatch": f"chunk {c}'s dispatched tokens (the dispatch's output) were read",
            "combine": f"chunk {c}'s combine output was read",
        }.get(kind, "an all-to-all's output was read")
        return (
            f"{what} before its wait() returned. The check fills a tensor that an all-to-all "
            "is still writing with NaN until its wait() (so the race shows every run, not one "
            "in ten): wait for each all-to-all before reading what it delivers"
        )
    expert_of = res["expert_of"].tolist()
    for c, blocks in enumerate(res["blocks"]):
        for j, rows in enumerate(blocks):
            wrong = next((t for t in rows if t >= 0 and expert_of[t] != j), None)
            if wrong is not None:
                return (
                    f"chunk {c}'s dispatch sent token {wrong} (expert {expert_of[wrong]}) in "
                    f"block {j}, which goes to rank {j}: the first input_split_sizes[0] rows "
                    "go to rank 0, the next input_split_sizes[1] to rank 1, … — send the "
                    "chunk's tokens sorted by expert (torch.argsort(…, stable=True) of their "
                    "experts gives that order), not in their own order"
                )
    got, want, through = res["got"], res["want"], res["through"]
    i = bad[0]
    twin = next((j for j in range(len(want)) if torch.allclose(got[i], want[j], atol=1e-5)), None)
    if twin is not None:
        return (
            f"it holds token {twin}'s output: the dispatch went out sorted by expert, and the "
            "combine brings the outputs back in that same order; put each returned row back "
            "at its token's place (undo the sort by expert)"
        )
    by = next((e for e in range(through.shape[1])
               if torch.allclose(got[i], through[i, e], atol=1e-5)), None)  # fmt: skip
    if by is not None:
        return (
            f"token {i} came back through expert {by}, not its own: give the split sizes in "
            "rank order, the combine's the dispatch's the other way round"
        )
    return (
        "no token's output through any expert: rows never written keep what the output "
        "held when it was made (did every chunk's combine land in the output?)"
    )


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
