"""Check for lab 11's decomposed AllGather-matmul: each shard multiplied while the next
travels round the ring."""

from __future__ import annotations

import torch

from .. import handles, inflight
from .cases import Case, private_seeds, run_cases, seeded
from .common import builtin_collectives as _builtins
from .common import (
    refused_rank,
)
from .lab03_collectives import CHECK_LINK
from .lab11_tensor_expert import (
    _WORLD_HINT,
    _forbidden,
    _Hinted,
    _hinted,
    _Log,
    _overlapped,
    _Patient,
    _rank_result,
    _Stuck,
    _stuck_line,
    _tensors,
)
from .report import Report

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


class _Messages:
    """``ok.p2p.isend`` and ``irecv`` as the check watches them: each logged and counted per
    peer, a send's tensor held until its wait, a receive over a send noted (``aliased``)."""

    def __init__(self, log: _Log, peers: _Patient, orig_isend, orig_irecv):
        self.log, self.peers = log, peers
        self.orig_isend, self.orig_irecv = orig_isend, orig_irecv
        self.counter = {"send": 0, "recv": 0}
        # what each send in flight reads, held (not its address: a tensor sent and dropped
        # would free its memory for the next empty_like, and look like a receive into it)
        self.sending: dict = {}  # send number -> the tensor it may still read
        self.aliased: list = []

    def isend(self, tensor, dst, group=None):
        """The kit's isend, logged, its tensor held as still read until the send's wait."""
        counter, sending = self.counter, self.sending
        n = counter["send"] = counter["send"] + 1
        self.log.mark("send", n)
        handle = self.log.wrap_handle(self.orig_isend(tensor, dst, group), "send waited", n)
        handle = self.peers.wrap(handle, "send", dst)
        inner = handle.wait
        sending[n] = tensor

        def wait(*args, **kwargs):
            result = inner(*args, **kwargs)
            sending.pop(n, None)  # sent: its memory may be used again
            return result

        handle.wait = wait
        return handle

    def irecv(self, tensor, src, group=None):
        """The kit's irecv, logged; unless over a send, landing in ``tensor`` only when waited."""
        log, counter = self.log, self.counter
        n = counter["recv"] = counter["recv"] + 1
        log.mark("recv", n)
        if any(inflight.overlaps(tensor, sent) for sent in self.sending.values()):  # over a send
            self.aliased.append(n)
            return log.wrap_handle(self.orig_irecv(tensor, src, group), "recv waited", n)
        # the race guard of the kit's collectives, for a message: the message lands in a
        # private tensor, the learner's holds NaN until wait(), so that a shard multiplied
        # before its wait shows every run (a small message lands only when waited anyway)
        private = torch.empty_like(tensor)
        handle = self.orig_irecv(private, src, group)
        inflight.poison(tensor)
        handle = self.peers.wrap(log.wrap_handle(handle, "recv waited", n), "recv", src)
        return _landing_when_waited(handle, private, tensor)


def _landing_when_waited(handle, private: torch.Tensor, tensor: torch.Tensor):
    """``handle``, made to copy ``private`` into ``tensor`` once, when it is first seen done."""
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


class _Products(torch.overrides.TorchFunctionMode):
    """Marks each matrix product in ``log``; keeps its row blocks and whether one held NaN."""

    def __init__(self, log: _Log):
        super().__init__()
        self.log = log
        self.operands: list = []  # the row blocks seen in a product (the checker tells whose)
        self.nan_operands: list = []  # products of a tensor holding NaN (a receive read early)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        product = getattr(func, "__name__", "") in _PRODUCTS
        if product:
            self.log.mark("matmul start", 0)
            for a in _tensors(args, kwargs):
                if a.dim() == 2 and a.shape[-1] == FEATURES and a.is_floating_point():
                    self.nan_operands.extend([True] if bool(a.isnan().any()) else [])
                    if len(self.operands) < 64:
                        self.operands.append(a.detach().clone())
        out = func(*args, **(kwargs or {}))
        if product:
            self.log.mark("matmul end", 0)
        return out


def _run_ag(ag_matmul, seed: int):
    """On each rank: its own shard and weight only (``seed``, drawn per check and sent to
    this rank alone), so no rank can rebuild the others' shards without the messages; what
    is wanted is worked out by the checking process (:func:`_ag_wants`)."""
    import overlapkit as ok  # noqa: PLC0415

    me = ok.rank()
    x, weight = _ag_inputs(seed)
    del seed
    log = _Log()
    messages = _Messages(log, _Patient(me), ok.p2p.isend, ok.p2p.irecv)
    products = _Products(log)
    handles.take_unwaited()
    ok.p2p.isend, ok.p2p.irecv = messages.isend, messages.irecv
    stuck = None
    try:
        with (_forbidden(_AG_FORBIDDEN) as called, _builtins() as builtin,
              products):  # fmt: skip
            got = ag_matmul(x, weight)
    except _Stuck as exc:
        got, stuck = None, exc.args
    finally:
        ok.p2p.isend, ok.p2p.irecv = messages.orig_isend, messages.orig_irecv
        messages.peers.done()
    return {
        **_rank_result(got, called, builtin, log),
        "aliased": messages.aliased,
        "unwaited": handles.take_unwaited(),
        "stuck": stuck,
        "operands": products.operands,
        "nan_operand": bool(products.nan_operands),
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
        if sends == 0:  # yet every block right: the messages went by a name the check missed
            report.fail(f"{what}: rank {rank}'s result is right, but none of its messages went "
                        "through ok.p2p.isend / ok.p2p.irecv as the check sees them (it watches "
                        "those names, to tell what overlaps what): call them as "
                        "ok.p2p.isend(...), not by a name imported or saved before the check ran "
                        "(from overlapkit.p2p import isend)")  # fmt: skip
            return False
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
    mine = res["shards"][rank]  # this rank's own shard's product
    blocks = [res["got"][b * ROWS : (b + 1) * ROWS] for b in range(world)]
    if src != rank and all(torch.allclose(b, mine, atol=1e-5) for b in blocks):
        return (
            f"{where} — every block holds shard {rank}'s product, this rank's own: the "
            "shards it received were never multiplied. After each step's wait, take the "
            "received shard in hand (the tensor it was received into) and multiply that one "
            "next, then pass it on"
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
