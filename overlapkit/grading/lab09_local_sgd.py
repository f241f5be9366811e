"""Checks for lab 09: local SGD — what its averaging averages, and when it runs."""

from __future__ import annotations

import contextlib
import math

import torch

from .. import handles
from .cases import Case, private_seeds, run_cases, seeded
from .common import (
    PeersReturned,
    builtin_collectives,
    refused_rank,
    wait_unless_stuck,
    worst_element,
)
from .lab03_collectives import CHECK_LINK
from .mistakes import WAIT_BEFORE_READING_THE_TENSOR, never_waited
from .report import Report

WORLDS = (2, 3)  # average_parameters: 2 ranks, then 3 (a divisor of 2 shows there)
STEPS, LR = 7, 0.1
LOCAL_CASES = ((2, 3), (3, 2))  # local_sgd_step: (ranks, k) — two k, so a fixed period shows
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


def _add_wants(results, seeds: list[int], k: int | None) -> None:
    """Put into each rank's result what it should hold (from every rank's seed)."""
    if k is None:
        everyone = [list(_model(r, s).parameters()) for r, s in enumerate(seeds)]
        want = [sum(ps[i].detach() for ps in everyone) / len(seeds)
                for i in range(len(everyone[0]))]  # fmt: skip
        for res, _ in results:
            res["want"], res["sums"] = want, [w * len(seeds) for w in want]
        return
    wants, unzeroed = _reference(seeds, k), _reference(seeds, k, zero_grad=False)
    for rank, (res, _) in enumerate(results):
        res["want"], res["unzeroed"] = wants[rank], unzeroed[rank]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=1e-5)


def _explain(text: str) -> str:
    if "leaf Variable that requires grad" in text:
        return (
            " — your own in-place change of a parameter (p /= …, p.copy_(…)) goes through "
            "autograd, which refuses it on a parameter that requires grad: make that change "
            "under torch.no_grad() (or on p.data). A collective writing into p is not "
            "recorded by autograd, so ok.ring_all_reduce(p, op='avg') alone needs neither"
        )
    return ""


def check_average_parameters(average_parameters, local_sgd_step=None,
                             timeout: float = 20.0) -> Report:  # fmt: skip
    """Check ``average_parameters(model)`` (every parameter replaced, in place, by its
    mean over the ranks; gradients and buffers untouched) on 2 and 3 ranks; then, when
    given, ``local_sgd_step(model, optimizer, batch, step, k)`` (one SGD step on the
    rank's batch; the models averaged after steps k, 2k, … and only then) with k = 3 on
    2 ranks and k = 2 on 3. The check stops at its first failure; the cases after it
    count as not passed ("not reached"), so the score is out of every case."""
    report = Report("average_parameters")
    cases = [_mean_case(report, average_parameters, world) for world in WORLDS]
    if local_sgd_step is not None:
        cases += [_local_sgd_case(report, local_sgd_step, w, k) for w, k in LOCAL_CASES]
    run_cases(report, "check_average_parameters", cases, timeout=timeout, link=CHECK_LINK,
              explain=_explain, not_reached=True)  # fmt: skip
    return report


# each rank's values come from a seed of its own, drawn here and sent to it alone; what
# they should come to is worked out here, where every seed is known


def _mean_case(report: Report, average_parameters, world: int) -> Case:
    what, seeds = f"average_parameters on {world} ranks", private_seeds(world, 40)

    def judge(results) -> bool:
        _add_wants(results, seeds, None)
        return _judge(report, what, results, world)

    passed = ("every parameter is the mean over the ranks, in place; gradients and "
              "buffers untouched")  # fmt: skip
    return Case(what, world, _run, (average_parameters,), judge, seeded(seeds), passed)


def _local_sgd_case(report: Report, local_sgd_step, world: int, k: int) -> Case:
    what, seeds = f"local_sgd_step on {world} ranks, k = {k}", private_seeds(world, 40)

    def judge(results) -> bool:
        _add_wants(results, seeds, k)
        return _judge_local_sgd(report, what, results, k)

    passed = (f"each rank followed its own batches, and after steps "
              f"{', '.join(map(str, _steps(k)))} (and only then) every rank held the "
              "mean of the ranks' models")  # fmt: skip
    return Case(what, world, _run_local_sgd, (local_sgd_step, k), judge, seeded(seeds), passed)


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


def _judge(report, what, results, world) -> bool:
    for rank, (res, traffic) in enumerate(results):
        if refused_rank(report, what, rank, res, traffic,
                        "average with the kit's ok.ring_all_reduce"):  # fmt: skip
            return False
        if res["never waited"]:
            nan = any(v.isnan().any() for v in res["values"])
            _never_waited(report, what, rank, res["never waited"], nan)
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
                report.fail(
                    f"{what}: rank {rank}'s gradient of {name!r} changed: local SGD "
                    "averages the parameters, not the gradients"
                )
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


# --------------------------------------------------------------------------- when: local SGD


def _sgd_model() -> torch.nn.Module:
    """The same initial model on every rank (as after the broadcast of rank 0's)."""
    torch.manual_seed(9)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


class _SGD:
    """Plain SGD with the interface of ``torch.optim.SGD`` that a training step uses
    (``zero_grad``, ``step()``, ``param_groups``, ``state``). Not torch's own: constructing
    that imports torch._dynamo, seconds in every fresh rank of the check."""

    def __init__(self, params, lr: float):
        self.param_groups = [{"params": list(params), "lr": lr}]
        self.state: dict = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_groups[0]["params"]:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        for p in group["params"]:
            if p.grad is not None:
                p.add_(p.grad, alpha=-group["lr"])


BATCH = 6  # samples (and targets) per batch


def _batch(seed: int, step: int):
    """A rank's batch of ``step``; ``seed`` is the rank's own (see :func:`_model`)."""
    gen = torch.Generator().manual_seed(seed + step)
    return torch.randn(BATCH, 3, generator=gen), torch.randn(BATCH, 1, generator=gen)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _reference(seeds: list[int], k: int, zero_grad: bool = True) -> list[list[torch.Tensor]]:
    """Local SGD on ``len(seeds)`` simulated ranks: [rank][step − 1] -> flat parameters."""
    world = len(seeds)
    models = [_sgd_model() for _ in range(world)]
    out: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for step in range(1, STEPS + 1):
        for rank, model in enumerate(models):
            if zero_grad:
                model.zero_grad(set_to_none=True)
            x, y = _batch(seeds[rank], step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= LR * p.grad
        if step % k == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models), strict=True):
                    mean = sum(p.detach() for p in ps) / world
                    for p in ps:
                        p.copy_(mean)
        for rank, model in enumerate(models):
            out[rank].append(_flat(model))
    return out


def _run_local_sgd(local_sgd_step, k: int, seed: int = 0):
    import overlapkit as ok  # noqa: PLC0415

    model = _sgd_model()
    optimizer = _SGD(model.parameters(), lr=LR)
    after, events, at = [], [], [0]
    with (
        _recorded_reductions(ok, model, optimizer, finished=f"finished all {STEPS} steps",
                             advice="every rank averages, after the same steps",
                             where=lambda: f" (in step {at[0]})") as called,
        builtin_collectives() as builtin,
    ):  # fmt: skip
        for step in range(1, STEPS + 1):
            at[0], start = step, len(called)
            local_sgd_step(model, optimizer, _batch(seed, step), step, k)
            events.append(list(called[start:]))
            after.append(_flat(model))
    return {
        "after": after,
        "events": events,
        "builtin": builtin,
        "kit values": called.values,
        "never waited": handles.take_unwaited(),
    }


def _steps(k: int) -> list[int]:
    return list(range(k, STEPS + 1, k))


def _averaging(events: list[str]) -> tuple[int, int]:
    """How many kit AllReduces a step ran before and after its optimizer.step()."""
    if "optimizer.step()" not in events:
        return 0, sum(e != "optimizer.step()" for e in events)
    at = events.index("optimizer.step()")
    return len(events[:at]), sum(e != "optimizer.step()" for e in events[at + 1 :])


def _fixed_period(results, k: int) -> int | None:
    """The period k' ≠ k (≥ 2) with which the ranks' models were averaged, when they
    agreed exactly after steps k', 2k', … and every rank communicated in those steps
    only (a number written in place of k)."""
    agreed = [
        s
        for s in range(1, STEPS + 1)
        if all(_close(res["after"][s - 1], results[0][0]["after"][s - 1]) for res, _ in results)
    ]
    if not agreed or agreed[0] in (1, k) or agreed != _steps(agreed[0]):
        return None
    talked = [
        [s for s, ev in enumerate(res["events"], 1) if any(e != "optimizer.step()" for e in ev)]
        for res, _ in results
    ]
    return agreed[0] if all(t == agreed for t in talked) else None


def _scaled_update(got, want, before) -> float | None:
    """c when this step moved the parameters c times as far as local SGD's, in its
    direction (c ≠ 1); None otherwise."""
    moved, should = got - before, want - before
    norm = float(should @ should)
    if norm == 0:
        return None
    c = float(moved @ should) / norm
    same_way = torch.allclose(moved, c * should, rtol=1e-3, atol=1e-6)
    return c if same_way and abs(c - 1) > 1e-3 else None


def _judge_local_sgd(report, what, results, k) -> bool:
    for rank, (res, traffic) in enumerate(results):
        if refused_rank(report, what, rank, res, traffic,
                        "average with the kit's ok.ring_all_reduce"):  # fmt: skip
            return False
        if res["never waited"]:
            nan = any(a.isnan().any() for a in res["after"])
            _never_waited(report, what, rank, res["never waited"], nan)
            return False
    periods = ", ".join(map(str, _steps(k)))
    fixed = _fixed_period(results, k)
    if fixed is not None:
        report.fail(
            f"{what}: the ranks averaged after steps {', '.join(map(str, _steps(fixed)))} — "
            f"every {fixed} steps, with k = {k}: average every k steps (the argument k), "
            "not a fixed number"
        )
        return False
    for i in range(STEPS):
        step = i + 1
        off = [
            r for r, (res, _) in enumerate(results) if not _close(res["after"][i], res["want"][i])
        ]
        if not off:
            continue
        rank = off[0]
        res = results[rank][0]
        first = results[0][0]["after"][i]
        agree = all(_close(r["after"][i], first) for r, _ in results)
        before, after = _averaging(res["events"][i])
        of_grads = any("(gradient)" in e for e in res["events"][i])
        of_params = any("(parameter)" in e for e in res["events"][i])
        if agree and step % k and of_grads and not of_params:
            every = all(any("(gradient)" in e for e in ev) for ev in res["events"])
            when = "in every step" if every else f"in step {step}"
            report.fail(
                f"{what}: rank {rank} all-reduced the gradients {when}, so every rank took "
                "the same update and the models never drifted apart: that is synchronous "
                f"SGD. Local SGD communicates only after steps {periods}, … (k = {k}), and "
                "then averages the parameters"
            )
        elif agree and step % k:
            report.fail(
                f"{what}: after step {step} every rank holds the same model: rank {rank} "
                f"averaged at step {step}. Local SGD lets each rank take k = {k} steps on its "
                f"own batches, and averages after steps {periods}, … (steps count from 1)"
            )
        elif step % k == 0 and not agree:
            if of_grads:
                why = (
                    f"rank {rank} averaged the gradients at step {step}: the ranks still "
                    "differ by everything the steps before did. Local SGD averages the "
                    "parameters (the models), after optimizer.step()"
                )
            elif before and not after:
                why = (
                    f"rank {rank} averaged before its update of step {step}: optimizer.step() "
                    "then moved each rank by its own gradient, apart again. Average after "
                    "optimizer.step()"
                )
            elif not before and not after:
                late = i + 1 < STEPS and _averaging(res["events"][i + 1])[0]
                why = f"rank {rank} ran no AllReduce in step {step}" + (
                    f"; it averaged at the start of step {step + 1}, too late: the model "
                    f"after step {step} (an evaluation, a checkpoint, the end of training) "
                    f"is no average. Average at the end of step {step}, after "
                    "optimizer.step()"
                    if late
                    else f": with k = {k}, average after steps {periods}, …"
                )
            else:
                why = (
                    f"rank {rank} communicated after its update of step {step}, but not the "
                    "parameters' mean into the model: average the parameters "
                    "(average_parameters(model))"
                )
            report.fail(f"{what}: after step {step} the ranks' models differ: {why}")
        else:
            got, want = res["after"][i], res["want"][i]
            j = worst_element((got - want).abs(), 0.0)
            start = res["want"][i - 1] if i else _flat(_sgd_model())
            scale = _scaled_update(got, want, start) if step % k else None
            if _close(got, res["unzeroed"][i]):
                hint = (
                    ": the gradients of earlier steps were added in — clear them every step "
                    "(optimizer.zero_grad())"
                )
            elif scale is not None and abs(scale - BATCH) < 1e-2 * BATCH:
                hint = (
                    f": this step moved the parameters {BATCH}× as far as local SGD's, and "
                    f"the batch has {BATCH} targets — the loss summed the squared errors; use "
                    "their mean (torch.nn.functional.mse_loss's default reduction)"
                )
            elif scale is not None:
                hint = (
                    f": this step moved the parameters {scale:.3g}× as far as local SGD's, in "
                    "the same direction: one step is the mean squared error of this rank's "
                    "batch, backward, and one optimizer.step()"
                )
            else:
                hint = (
                    ": one step is the mean squared error of this rank's batch, backward, "
                    "and one optimizer.step()"
                )
            report.fail(
                f"{what}: after step {step}, rank {rank}'s parameters differ from local "
                f"SGD's (element {j}: expected {want[j].item():.5f}, got {got[j].item():.5f})"
                f"{hint}"
            )
        return False
    values = results[0][0]["after"][0].numel()
    for rank, (res, traffic) in enumerate(results):
        if short := _short(res, traffic, values, len(_steps(k)), len(results)):
            report.fail(_by_another_door(what, rank, short, len(results)))
            return False
    return True
