"""Lab 09's local SGD, judged step by step: each rank on its own batches, the models
averaged after steps k, 2k, … and only then, against local SGD on simulated ranks."""

from __future__ import annotations

import torch

from .. import handles
from .common import (
    builtin_collectives,
    worst_element,
)
from .lab09_mean import (
    _by_another_door,
    _close,
    _recorded_reductions,
    _refused_or_unwaited,
    _short,
)

STEPS, LR = 7, 0.1


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
        if _refused_or_unwaited(report, what, rank, res, traffic, res["after"]):
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
        off = [
            r for r, (res, _) in enumerate(results) if not _close(res["after"][i], res["want"][i])
        ]
        if off:
            report.fail(_step_line(what, results, off[0], i, k, periods))
            return False
    values = results[0][0]["after"][0].numel()
    for rank, (res, traffic) in enumerate(results):
        if short := _short(res, traffic, values, len(_steps(k)), len(results)):
            report.fail(_by_another_door(what, rank, short, len(results)))
            return False
    return True


def _step_line(what: str, results, rank: int, i: int, k: int, periods: str) -> str:
    """The ✘ line for the first step (index ``i``) after which ``rank`` holds what local SGD
    does not: averaged out of turn, not averaged, or a step of its own gone wrong."""
    step = i + 1
    res = results[rank][0]
    first = results[0][0]["after"][i]
    agree = all(_close(r["after"][i], first) for r, _ in results)
    of_grads = any("(gradient)" in e for e in res["events"][i])
    of_params = any("(parameter)" in e for e in res["events"][i])
    if agree and step % k and of_grads and not of_params:
        every = all(any("(gradient)" in e for e in ev) for ev in res["events"])
        when = "in every step" if every else f"in step {step}"
        return (
            f"{what}: rank {rank} all-reduced the gradients {when}, so every rank took "
            "the same update and the models never drifted apart: that is synchronous "
            f"SGD. Local SGD communicates only after steps {periods}, … (k = {k}), and "
            "then averages the parameters"
        )
    if agree and step % k:
        return (
            f"{what}: after step {step} every rank holds the same model: rank {rank} "
            f"averaged at step {step}. Local SGD lets each rank take k = {k} steps on its "
            f"own batches, and averages after steps {periods}, … (steps count from 1)"
        )
    if step % k == 0 and not agree:
        why = _why_apart(res, rank, i, k, periods)
        return f"{what}: after step {step} the ranks' models differ: {why}"
    return _wrong_update(what, res, rank, i, k)


def _why_apart(res, rank: int, i: int, k: int, periods: str) -> str:
    """Why the ranks' models differ after step ``i + 1``, which ends a period: what
    ``rank`` averaged, and when."""
    step = i + 1
    before, after = _averaging(res["events"][i])
    of_grads = any("(gradient)" in e for e in res["events"][i])
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
    return why


def _wrong_update(what: str, res, rank: int, i: int, k: int) -> str:
    """The ✘ line for a step (index ``i``) whose update is not local SGD's: what it
    looks like it did instead."""
    step = i + 1
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
    return (
        f"{what}: after step {step}, rank {rank}'s parameters differ from local "
        f"SGD's (element {j}: expected {want[j].item():.5f}, got {got[j].item():.5f})"
        f"{hint}"
    )


def _add_local_sgd_wants(results, seeds: list[int], k: int) -> None:
    """Put into each rank's result what it should hold after each step (from every rank's
    seed), and what it would hold had no step cleared the gradients."""
    wants, unzeroed = _reference(seeds, k), _reference(seeds, k, zero_grad=False)
    for rank, (res, _) in enumerate(results):
        res["want"], res["unzeroed"] = wants[rank], unzeroed[rank]
