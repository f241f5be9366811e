"""Lab 09's averaging, recorded and judged: which AllReduces of the kit a rank ran (on
parameters, gradients, anything else) and whether the mean landed in the parameters."""

from __future__ import annotations

import contextlib
import math

import torch

from .. import handles
from .common import (
    builtin_collectives,
    refused_rank,
    wait_unless_stuck,
    worst_element,
)
from .mistakes import WAIT_BEFORE_READING_THE_TENSOR, never_waited
from .peers import PeersReturned
from .report import Report

_KIT_REDUCTIONS = ("ring_all_reduce", "naive_all_reduce", "bucketed_all_reduce")


def _model(rank: int, seed: int) -> torch.nn.Module:
    """The same architecture on every rank, different values (as after local steps):
    ``seed`` is the rank's own, drawn by the checking process and sent to it alone, so no
    rank can rebuild another's model and skip the communication."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2, bias=False)
    )
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank + 1))  # left as they are
    with torch.no_grad():
        model[1].running_mean.fill_(float(rank))  # a buffer: not a parameter
    return model


# --------------------------------------------------------------------------- the recorder


def _kind(model, tensor) -> str:
    """What a tensor handed to an AllReduce is: "parameter", "gradient" (one of them, or all
    of them flat — itself, a view, or a copy), or "" (something else)."""
    if isinstance(tensor, (list, tuple)) and tensor:
        tensor = tensor[0]
    if not isinstance(tensor, torch.Tensor):
        return ""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    ptr = tensor.data_ptr()
    if any(g is not None and g.data_ptr() == ptr for g in grads):
        return "gradient"
    if any(p.data_ptr() == ptr for p in params):
        return "parameter"
    flat = tensor.detach().reshape(-1)

    def same(other) -> bool:
        return other.numel() == flat.numel() and torch.equal(other.reshape(-1), flat)

    with torch.no_grad():
        if all(g is not None for g in grads) and same(torch.cat([g.reshape(-1) for g in grads])):
            return "gradient"
        if same(torch.cat([p.detach().reshape(-1) for p in params])):
            return "parameter"
        if any(g is not None and same(g) for g in grads):
            return "gradient"
        return "parameter" if any(same(p.detach()) for p in params) else ""


class _Calls(list):
    """The calls :func:`_recorded_reductions` saw, in order, and how many values the kit's
    AllReduces among them were given (``values``)."""

    values = 0


def _short(res: dict, traffic, values: int, times: int, world: int) -> tuple[int, int] | None:
    """(moved, needed) when a rank put fewer values through the kit — its AllReduces' and
    its own ok.p2p sends' (fp32: 4 bytes each) — than averaging ``values`` parameters
    ``times`` times over ``world`` ranks needs of every rank, (N−1)/N of them; else None."""
    moved = res["kit values"] + sum(n for _, n in traffic.sent) // 4
    need = times * ((world - 1) * values // world)
    return (moved, need) if moved < need else None


def _by_another_door(what: str, rank: int, short: tuple[int, int], world: int) -> str:
    """The ✘ line for a rank whose models agree although the kit moved too little."""
    moved, need = short
    return (
        f"{what}: rank {rank} holds the mean, yet only {moved} parameter values went through "
        f"the kit (ok.ring_all_reduce or ok.p2p), where averaging over N = {world} ranks "
        f"moves at least (N−1)/N of them: {need}. The rest was averaged by another door (a "
        "process group of its own, or a built-in reached some other way): average with the "
        "kit's ok.ring_all_reduce"
    )


@contextlib.contextmanager
def _recorded_reductions(ok, model, optimizer=None, *, finished: str, advice: str,
                         where=lambda: ""):  # fmt: skip
    """Record, in one list, the kit's AllReduces (with what they reduce: a parameter, a
    gradient, or another tensor) and the optimizer's steps, in the order they ran.

    A rank's ``ok.ring_all_reduce`` also ends, rather than hangs until the check's
    timeout, when another rank has finished (``finished`` says what it did) having called
    fewer of them: that rank will never join it (``advice``: what to do). Each rank posts
    its count in the process group's store when its work is done."""
    me, world, returned = ok.rank(), ok.world_size(), PeersReturned("lab09")
    called = _Calls()
    count = [0]

    def joined(wait, index: int) -> None:
        def stuck():
            for r in range(world):
                theirs = None if r == me else returned.of(r)
                if theirs is not None and theirs < index:
                    handles.take_unwaited()  # this one is abandoned: no report of it
                    raise RuntimeError(
                        f"its ok.ring_all_reduce #{index}{where()} can never finish: rank "
                        f"{r} {finished} having called ok.ring_all_reduce {theirs} time(s). "
                        f"A collective completes only when every rank calls it: {advice}"
                    )

        wait_unless_stuck(wait, stuck)

    def ring(original, tensor, *args, **kwargs):
        count[0] += 1
        index, args = count[0], list(args)
        if len(args) > 2:  # (op, group, async_op, …)
            asked, args[2] = args[2], True
        else:
            asked, kwargs["async_op"] = kwargs.get("async_op", False), True
        handle = original(tensor, *args, **kwargs)
        plain_wait = handle.wait
        if not asked:
            joined(plain_wait, index)
            return None

        def wait(timeout=None):
            if timeout is not None:
                return plain_wait(timeout)
            joined(plain_wait, index)
            return True

        handle.wait = wait
        return handle

    def recorder(original, name):
        def call(tensor, *args, **kwargs):
            called.append(f"ok.{name}({_kind(model, tensor)})")
            called.values += tensor.numel() if isinstance(tensor, torch.Tensor) else 0
            if name == "ring_all_reduce":
                return ring(original, tensor, *args, **kwargs)
            return original(tensor, *args, **kwargs)

        return call

    saved = {name: getattr(ok, name) for name in _KIT_REDUCTIONS}
    for name, original in saved.items():
        setattr(ok, name, recorder(original, name))
    if optimizer is not None:

        def step(*args, _step=optimizer.step, **kwargs):
            called.append("optimizer.step()")
            return _step(*args, **kwargs)

        optimizer.step = step
    try:
        yield called
    finally:
        for name, original in saved.items():
            setattr(ok, name, original)
        returned.post(me, count[0])  # done: what a peer still waiting needs to know


# --------------------------------------------------------------------------- what: the mean


def _run(average_parameters, seed: int = 0):
    import overlapkit as ok  # noqa: PLC0415

    me = ok.rank()
    model = _model(me, seed)
    before = [p for p in model.parameters()]
    own = [p.detach().clone() for p in before]
    with (
        _recorded_reductions(
            ok, model, finished="returned from average_parameters", advice="every rank averages"
        ) as called,
        builtin_collectives() as builtin,
    ):
        result = average_parameters(model)
    unwaited = handles.take_unwaited()
    after = list(model.parameters())
    return {
        "same objects": all(a is b for a, b in zip(before, after, strict=True)),
        "values": [p.detach().clone() for p in after],
        "own": own,
        "grads": [None if p.grad is None else p.grad.clone() for p in after],
        "grad_want": float(me + 1),
        "buffer": model[1].running_mean.clone(),
        "rank": me,
        "names": [n for n, _ in model.named_parameters()],
        "builtin": builtin,
        "kit values": called.values,
        "never waited": unwaited,
        "returned": result is not None and not isinstance(result, torch.nn.Module),
    }


def _add_wants(results, seeds: list[int]) -> None:
    """Put into each rank's result what it should hold (from every rank's seed)."""
    everyone = [list(_model(r, s).parameters()) for r, s in enumerate(seeds)]
    want = [sum(ps[i].detach() for ps in everyone) / len(seeds)
            for i in range(len(everyone[0]))]  # fmt: skip
    for res, _ in results:
        res["want"], res["sums"] = want, [w * len(seeds) for w in want]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=1e-5)


def _never_waited(report: Report, what: str, rank: int, unwaited: list[str], nan: bool) -> None:
    read = ("; what it read in the meantime is NaN (the check poisons a tensor while an "
            "operation on it is in flight)") if nan else ""  # fmt: skip
    report.fail(never_waited(what, rank, unwaited, WAIT_BEFORE_READING_THE_TENSOR, read))


def _divisor(got: torch.Tensor, total: torch.Tensor) -> float | None:
    """The d with got = total / d in every element, when there is one."""
    mask = got.abs() > 1e-4
    if not mask.any():
        return None
    d = (total[mask] / got[mask]).median().item()
    if not math.isfinite(d) or d <= 0:
        return None
    return d if torch.allclose(got, total / d, atol=1e-5, rtol=1e-4) else None


def _mean_hint(got, res, i, world) -> str:
    """Why a parameter is not the mean, when its value says so."""
    if got.isnan().any():
        return (
            " — NaN: the check poisons a tensor while an operation on it is in flight, so "
            "this was read before that operation's wait(): wait for each handle before "
            "reading what it delivers"
        )
    # averaged: now the mean, and not already the mean before (equal on every rank)
    rows = zip(res["values"], res["want"], res["own"], res["names"], strict=True)
    right = [n for v, m, o, n in rows if _close(v, m) and not _close(o, m)]
    if right:
        return f" — {right[0]!r} is averaged, this one is not: is every parameter averaged?"
    if torch.equal(got, res["own"][i]):
        grads = [g for g in res["grads"] if g is not None]
        if any(not torch.allclose(g, torch.full_like(g, res["grad_want"])) for g in grads):
            return (
                " — this rank's own value, unchanged, while its .grad changed: average the "
                "parameters themselves (not their .grad), in place"
            )
        return (
            " — this rank's own value, unchanged: the average must land in the parameters "
            "themselves (in place, or copied back)"
        )
    d = _divisor(got, res["sums"][i])
    if d is None:
        return ""
    if abs(d - 1) < 1e-3:
        return f" — that is the sum over the {world} ranks: divide by the world size (or op='avg')"
    if abs(d - world * world) < 1e-3:
        return (
            f" — that is the mean divided by {world} once more: op='avg' already divides "
            "by the world size"
        )
    if abs(d - round(d)) < 1e-3:
        return (
            f" — that is the sum divided by {round(d)} with N = {world} ranks: divide by "
            "ok.world_size() (or use op='avg'), not a fixed number"
        )
    return ""


def _refused_or_unwaited(report, what, rank, res, traffic, read) -> bool:
    """Print the ✘ line of a rank the check refused, or that never waited for an operation
    (``read``: the tensors it left, NaN where read while an operation on them was in
    flight); say whether there was one."""
    if refused_rank(report, what, rank, res, traffic,
                    "average with the kit's ok.ring_all_reduce"):  # fmt: skip
        return True
    if res["never waited"]:
        nan = any(t.isnan().any() for t in read)
        _never_waited(report, what, rank, res["never waited"], nan)
        return True
    return False


def _judge(report, what, results, world) -> bool:
    for rank, (res, traffic) in enumerate(results):
        if _refused_or_unwaited(report, what, rank, res, traffic, res["values"]):
            return False
        for i, (got, want, name) in enumerate(
            zip(res["values"], res["want"], res["names"], strict=True)
        ):
            if _close(got, want):
                continue
            j = worst_element((got - want).abs(), 0.0)
            g, w = got.reshape(-1)[j].item(), want.reshape(-1)[j].item()
            report.fail(
                f"{what}: rank {rank}, parameter {name!r} (#{i}), element {j}: expected "
                f"the mean {w:.5f}, got {g:.5f}{_mean_hint(got, res, i, world)}"
            )
            return False
        if not res["same objects"]:
            report.fail(
                f"{what}: rank {rank}'s model has new parameter objects: the optimizer "
                "still holds the old ones. Write the mean into each parameter in place "
                "(p.copy_ under torch.no_grad(), or p.data)"
            )
            return False
        for name, grad in zip(res["names"], res["grads"], strict=True):
            if grad is None or not torch.allclose(grad, torch.full_like(grad, res["grad_want"])):
                cleared = grad is None or not grad.any()
                why = (
                    "was cleared: leave the gradients as they are (zero_grad is the step's "
                    "business, not the average's)"
                    if cleared
                    else "changed: local SGD averages the parameters, not the gradients"
                )
                report.fail(f"{what}: rank {rank}'s gradient of {name!r} {why}")
                return False
        if not torch.allclose(res["buffer"], torch.full_like(res["buffer"], float(rank))):
            report.fail(
                f"{what}: rank {rank}'s BatchNorm running_mean changed: average the "
                "parameters (model.parameters()), not the buffers"
            )
            return False
        values = sum(v.numel() for v in res["values"])
        if short := _short(res, traffic, values, 1, world):
            report.fail(_by_another_door(what, rank, short, world))
            return False
    return True
