"""Checks for lab 11: the decomposed AllGather-matmul, and the chunked (pipelined) MoE."""

from __future__ import annotations

import time

import torch

from .. import handles, inflight
from ..collectives import chunk_bounds
from .cases import Case, private_seeds, run_cases, seeded
from .common import (
    PeersReturned,
    recorded_calls,
    refused_rank,
    wait_unless_stuck,
)
from .common import builtin_collectives as _builtins
from .lab03_collectives import CHECK_LINK
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
        waited = []

        def wait(inner, timeout=None):
            result = inner(timeout)
            if not waited:  # the first wait is when the data was asked for
                waited.append(True)
                self.mark(event, index)
            return result

        # seen however the learner waits (handle.wait(), type(handle).wait(handle))
        return handles.wrap_wait(handle, wait)


def _tensors(args, kwargs) -> list:
    """The tensors among a call's arguments (also inside lists and tuples)."""
    found, todo = [], [*args, *(kwargs or {}).values()]
    while todo:
        a = todo.pop()
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            todo.extend(a)
    return found


class _Stuck(Exception):
    """A rank waits for a message that its peer, already returned, will never send (or
    never receive): args (what, peer, n, the peer's counts)."""


class _Patient:
    """Counts the messages a rank posts to and from each peer, and waits for them so that
    a wait nobody can answer ends at once, not at the check's timeout: a rank that
    returned from the learner's function leaves how many messages it sent to and received
    from each rank (:class:`~.common.PeersReturned`); a wait for the n-th message from (or
    to) a rank that returned having sent (received) fewer can never end."""

    def __init__(self, me: int):
        self.me = me
        self.counts: dict = {"send": {}, "recv": {}}
        self.returned = PeersReturned("lab11")

    def wrap(self, handle, kind: str, peer: int):
        mine = self.counts[kind]
        n = mine[peer] = mine.get(peer, 0) + 1
        inner = handle.wait
        other = "recv" if kind == "send" else "send"

        def stuck():
            theirs = self.returned.of(peer)
            if theirs is not None and theirs[other].get(str(self.me), 0) < n:
                raise _Stuck(kind, peer, n, theirs) from None

        def wait(*args, **kwargs):
            if args or kwargs:  # the learner's own timeout
                return inner(*args, **kwargs)
            return wait_unless_stuck(inner, stuck)

        handle.wait = wait
        return handle

    def done(self) -> None:
        self.returned.post(self.me, self.counts)


def _stuck_line(what: str, rank: int, stuck) -> str:
    """What a rank waited for that its peer will never send or receive."""
    kind, peer, n, theirs = stuck
    other = "recv" if kind == "send" else "send"
    k = theirs[other].get(str(rank), 0)
    partners = sorted(int(p) for p in theirs[other] if int(p) != rank)
    also = f" (its {'sends went' if other == 'send' else 'receives came'} " + (
        f"{'to' if other == 'send' else 'from'} rank {', '.join(map(str, partners))})"
        if partners else "nowhere else)")  # fmt: skip
    if kind == "recv":
        waits = (f"waits for message #{n} from rank {peer}, but rank {peer} returned having "
                 f"sent it {k} message(s){also}")  # fmt: skip
    else:
        waits = (f"waits for its message #{n} to rank {peer} to be received, but rank {peer} "
                 f"returned having received {k} message(s) from it{also}")  # fmt: skip
    return f"{what}: rank {rank} {waits}: that wait would never end"


def _hinted(message: str, hint: str) -> str:
    """``message`` with ``hint`` after it: on a line of its own after a traceback, as a
    sentence after a sentence, else after a dash."""
    if not hint:
        return message
    if "\n" in message:
        return f"{message}\n{hint[0].upper()}{hint[1:]}"
    if message.endswith((".", "?")):
        return f"{message} {hint[0].upper()}{hint[1:]}"
    return f"{message} — {hint}"


class _Hinted:
    """A report whose ✘ lines end with ``hint``."""

    def __init__(self, report: Report, hint: str):
        self.report, self.hint = report, hint

    def fail(self, message: str) -> None:
        self.report.fail(_hinted(message, self.hint))

    def ok(self, message: str) -> None:
        self.report.ok(message)


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


def _ag_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's shard x and its weight, from the seed the checking process drew for it."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, FEATURES, generator=gen), torch.randn(OUT, FEATURES, generator=gen)


def _run_ag(ag_matmul, seed: int):
    """On each rank: its own shard and weight only (``seed``, drawn per check and sent to
    this rank alone), so no rank can rebuild the others' shards without the messages; what
    is wanted is worked out by the checking process (:func:`_ag_wants`)."""
    import overlapkit as ok  # noqa: PLC0415

    me = ok.rank()
    x, weight = _ag_inputs(seed)
    del seed
    log = _Log()
    orig_isend, orig_irecv = ok.p2p.isend, ok.p2p.irecv
    counter = {"send": 0, "recv": 0}
    peers = _Patient(me)

    # what each send in flight reads, held (not its address: a tensor sent and dropped
    # would free its memory for the next empty_like, and look like a receive into it)
    sending: dict = {}  # send number -> the tensor it may still read
    aliased = []

    def isend(tensor, dst, group=None):
        n = counter["send"] = counter["send"] + 1
        log.mark("send", n)
        handle = log.wrap_handle(orig_isend(tensor, dst, group), "send waited", n)
        handle = peers.wrap(handle, "send", dst)
        inner = handle.wait
        sending[n] = tensor

        def wait(*args, **kwargs):
            result = inner(*args, **kwargs)
            sending.pop(n, None)  # sent: its memory may be used again
            return result

        handle.wait = wait
        return handle

    def irecv(tensor, src, group=None):
        n = counter["recv"] = counter["recv"] + 1
        log.mark("recv", n)
        if any(inflight.overlaps(tensor, sent) for sent in sending.values()):  # over a send
            aliased.append(n)
            return log.wrap_handle(orig_irecv(tensor, src, group), "recv waited", n)
        # the race guard of the kit's collectives, for a message: the message lands in a
        # private tensor, the learner's holds NaN until wait(), so that a shard multiplied
        # before its wait shows every run (a small message lands only when waited anyway)
        private = torch.empty_like(tensor)
        handle = orig_irecv(private, src, group)
        inflight.poison(tensor)
        handle = peers.wrap(log.wrap_handle(handle, "recv waited", n), "recv", src)
        inner_wait, inner_done, landed = handle.wait, handle.is_completed, []

        def land():
            if not landed:
                landed.append(True)
                tensor.copy_(private)

        def wait(*args, **kwargs):
            result = inner_wait(*args, **kwargs)
            land()
            return result

        def is_completed():
            done = inner_done()
            if done:
                land()
            return done

        handle.wait, handle.is_completed = wait, is_completed
        return handle

    operands: list = []  # the row blocks seen in a product (the checker tells whose)
    nan_operands = []  # products of a tensor holding NaN (a receive read before its wait)

    class Watched(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            product = getattr(func, "__name__", "") in _PRODUCTS
            if product:
                log.mark("matmul start", 0)
                for a in _tensors(args, kwargs):
                    if a.dim() == 2 and a.shape[-1] == FEATURES and a.is_floating_point():
                        nan_operands.extend([True] if bool(a.isnan().any()) else [])
                        if len(operands) < 64:
                            operands.append(a.detach().clone())
            out = func(*args, **(kwargs or {}))
            if product:
                log.mark("matmul end", 0)
            return out

    handles.take_unwaited()
    ok.p2p.isend, ok.p2p.irecv = isend, irecv
    stuck = None
    try:
        with _forbidden(_AG_FORBIDDEN) as called, _builtins() as builtin, Watched():
            got = ag_matmul(x, weight)
    except _Stuck as exc:
        got, stuck = None, exc.args
    finally:
        ok.p2p.isend, ok.p2p.irecv = orig_isend, orig_irecv
        peers.done()
    return {
        "got": got if isinstance(got, torch.Tensor) else repr(got)[:80],
        "called": called,
        "builtin": builtin,
        "events": log.events,
        "aliased": aliased,
        "unwaited": handles.take_unwaited(),
        "stuck": stuck,
        "operands": operands,
        "nan_operand": bool(nan_operands),
    }


def _ag_wants(results: list, seeds: list[int]) -> None:
    """In the checking process: each rank's wanted output (every shard times its weightᵀ),
    block by block, and which rows of the gathered input its products took."""
    shards, weights = zip(*(_ag_inputs(seed) for seed in seeds), strict=True)
    full = torch.cat(shards)
    for (res, _), weight in zip(results, weights, strict=True):
        res["want"] = full @ weight.t()
        res["shards"] = [shard @ weight.t() for shard in shards]
        rows: set = set()
        for a in res.get("operands") or []:
            if isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[-1] == FEATURES:
                same = (a.detach().float()[:, None, :] == full[None]).all(dim=-1)
                rows.update(same.nonzero()[:, 1].tolist())
        res["multiplied"] = sorted(rows)


_WORLD_HINT = "it passed on 2 ranks and fails on 3: did you write 2 where ok.world_size() belongs?"


def check_ag_matmul(ag_matmul, timeout: float = 20.0) -> Report:
    """Check ``ag_matmul(x, weight)`` (``AllGather(x) @ weightᵀ`` round the ring, each
    shard multiplied while the next travels) on 2 and 3 ranks against gather-then-multiply:
    which rank, which block of rows (whose shard) differs; then that it was built from
    ``ok.p2p`` messages and that a transfer was in flight during a multiplication."""
    report = Report("ag_matmul")
    cases = [_ag_case(report, ag_matmul, world) for world in (2, 3)]
    if run_cases(report, "check_ag_matmul", cases, timeout=timeout, link=CHECK_LINK) is not None:
        report.ok("every rank holds AllGather(x) @ Wᵀ, shard by shard, on 2 and 3 ranks")
    return report


def _ag_case(report: Report, ag_matmul, world: int) -> Case:
    what = f"ag_matmul on {world} ranks"
    hint = _WORLD_HINT if world > 2 else ""  # the 3-rank case runs once 2 ranks passed
    seeds = private_seeds(world)

    def judge(results) -> bool:
        _ag_wants(results, seeds)
        return _ag_results(report, what, results, world, hint)

    return Case(what, world, _run_ag, (ag_matmul,), judge, seeded(seeds),
                failures=_Hinted(report, hint))  # fmt: skip


def _ag_results(report, what, results, world, hint) -> bool:
    for rank, (res, _) in enumerate(results):
        if res["stuck"]:
            _Hinted(report, hint).fail(
                f"{_stuck_line(what, rank, res['stuck'])}. On a ring of N = ok.world_size() "
                "ranks, rank r sends to (r + 1) mod N and receives from (r − 1) mod N, N − 1 "
                "times each."
            )
            return False
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
            _Hinted(report, hint).fail(
                f"{what}: rank {rank} returned shape {list(got.shape)}; expected "
                f"{list(want.shape)} (every rank's {ROWS} rows, this rank's {OUT} output features)"
            )
            return False
        for src in range(world):
            block = got[src * ROWS : (src + 1) * ROWS]
            if not torch.allclose(block, res["shards"][src], atol=1e-5):
                line = _ag_block_line(what, rank, src, block, res, world)
                # a block never computed on 3 ranks after 2 passed: maybe a loop of 2 steps
                report.fail(_hinted(line, hint if "never computed" in line else ""))
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


def _ag_block_line(what, rank, src, block, res, world) -> str:
    """The ✘ line for the block of rows of shard ``src`` that differs: a shard read
    before its receive's wait (NaN), another shard's product, a block never computed."""
    rows = f"{src * ROWS}–{(src + 1) * ROWS - 1}"
    shard = res["shards"][src]
    diff = (block - shard).abs().nan_to_num(float("inf"))
    i, j = divmod(int(diff.argmax()), OUT)
    where = (f"{what}: rank {rank}, rows {rows} (shard of rank {src}): at row "
             f"{src * ROWS + i}, column {j} expected {shard[i, j].item():.4f}, got "
             f"{block[i, j].item():.4f}")  # fmt: skip
    if res["nan_operand"] and bool(block.isnan().any()):
        return (
            f"{where} — a shard multiplied before its receive was waited: the check keeps a "
            "receive buffer full of NaN until its wait() returns (so the race shows every "
            "run, not one in ten). Wait for the receive before multiplying the shard it brings"
        )
    others = [r for r in range(world) if r != src]
    holds = next((r for r in others if torch.allclose(block, res["shards"][r], atol=1e-5)), None)
    if holds is not None:
        return (
            f"{where} — they hold shard {holds}'s product: the shard in hand at ring step k came "
            "from rank (rank − k) mod N, and its rows go to block (rank − k) mod N"
        )
    if not set(range(src * ROWS, (src + 1) * ROWS)) <= set(res["multiplied"]):
        return (
            f"{where} — the block of shard {src} was never computed: no product on rank {rank} "
            f"took shard {src}'s rows, so they hold what the output held when it was made "
            f"(zeros, or torch.empty's leftovers). Did the loop run N = {world} steps, one "
            f"per shard, the own one included?"
        )
    return (
        f"{where} — shard {src} was multiplied, but its product is not what landed in "
        f"rows {rows}: multiply the shard by weightᵀ (x @ weight.t()) and write it there"
    )


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
    counter = [0]
    orig = ok.all_to_all

    outputs: set = set()  # storages of the expert's outputs: what a combine sends
    received: dict = {}  # an all-to-all's output storage -> its number
    dispatches: set = set()  # all-to-alls whose output the expert then computed on
    combines: set = set()  # all-to-alls that sent what the expert computed
    tokens: dict = {}  # an all-to-all's number -> the tokens (rows of x) it sent
    blocks: dict = {}  # a dispatch's number -> the rows it sent to each rank
    in_flight: dict = {}  # an async all-to-all's output storage -> (kind, chunk) until waited
    touched: list = []  # (kind, chunk) of outputs read while in flight
    inside = [False]  # the kit's own calls (filling, copying back) are no read of the learner

    def all_to_all(*args, **kwargs):
        counter[0] += 1
        n_ = counter[0]
        kind = "all-to-all"
        source = args[1] if len(args) > 1 else kwargs.get("input")
        if isinstance(source, torch.Tensor) and source.is_floating_point():
            rows = _token_numbers(source, x)
            if any(i >= 0 for i in rows):  # rows of x: a dispatch
                tokens[n_], kind = rows, "dispatch"
                splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
                blocks[n_] = _blocks(rows, splits, world)
            elif source.data_ptr() in outputs or any(e == "expert start" for _, e, _ in log.events):
                combines.add(n_)  # the expert's outputs, on their way back
                kind = "combine"
        chunk = len(tokens) - 1 if kind == "dispatch" else len(combines) - 1
        target = args[0] if args else kwargs.get("output")
        if isinstance(target, torch.Tensor):
            received[target.data_ptr()] = n_
        log.mark("a2a", n_)
        inside[0] = True
        try:
            handle = orig(*args, **kwargs)
        finally:
            inside[0] = False
        if not kwargs.get("async_op"):
            log.mark("a2a waited", n_)
            return handle
        handle = log.wrap_handle(handle, "a2a waited", n_)
        if isinstance(target, torch.Tensor):
            key = target.untyped_storage().data_ptr()
            in_flight[key] = (kind, chunk)
            inner = handle.wait

            def wait(*a, **k):
                inside[0] = True
                try:
                    return inner(*a, **k)
                finally:
                    inside[0] = False
                    in_flight.pop(key, None)

            handle.wait = wait
        return handle

    class Touches(torch.overrides.TorchFunctionMode):
        """Notes a read of an all-to-all's output before its wait (under the check's race
        guard it holds NaN then: this says which output it was)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if in_flight and not inside[0] and getattr(func, "__name__", "") not in _METADATA:
                for a in _tensors(args, kwargs):
                    hit = in_flight.get(a.untyped_storage().data_ptr())
                    if hit is not None:
                        touched.append(hit)
                        break
            return func(*args, **(kwargs or {}))

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
              torch.no_grad(), Touches()):  # fmt: skip
            got = chunked_moe(x, expert_of, expert, chunks)
    finally:
        ok.all_to_all = orig
    return {
        "got": got if isinstance(got, torch.Tensor) else repr(got)[:80],
        "called": called,
        "builtin": builtin,
        "events": log.events,
        "a2a": counter[0],
        "dispatches": dispatches,
        "combines": sorted(combines - dispatches),
        "tokens": tokens,
        "blocks": [blocks[k] for k in sorted(blocks)],
        "touched": touched,
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


def _split_sizes(error: str) -> str:
    """What the split sizes of an all-to-all are, after an error about them."""
    if "split_sizes" not in error:
        return ""
    return (
        " — input_split_sizes[j] is how many rows this rank sends to rank j (they add up to "
        "the input's rows), output_split_sizes[j] how many it receives from rank j (they add "
        "up to the output's rows). The combine sends every rank back as many rows as that "
        "rank dispatched here"
    )


def _moe_results(report, what, results, chunks, hint) -> bool:
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
