"""Checks for lab 09: local SGD — what its averaging averages, and when it runs."""

from __future__ import annotations

import contextlib

import torch

from .collectives import CHECK_LINK
from .common import builtin_collectives, refused_rank, run_or_report
from .report import Report


def _model(rank: int) -> torch.nn.Module:
    """The same architecture on every rank, different values (as after local steps)."""
    torch.manual_seed(100 + rank)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2, bias=False)
    )
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank + 1))  # left as they are
    with torch.no_grad():
        model[1].running_mean.fill_(float(rank))  # a buffer: not a parameter
    return model


def _run(average_parameters):
    import overlapkit as ok  # noqa: PLC0415

    me, world = ok.rank(), ok.world_size()
    model = _model(me)
    before = [p for p in model.parameters()]
    own = [p.detach().clone() for p in before]
    everyone = [list(_model(r).parameters()) for r in range(world)]
    want = [sum(ps[i].detach() for ps in everyone) / world for i in range(len(before))]
    with builtin_collectives() as builtin:
        result = average_parameters(model)
    after = list(model.parameters())
    return {
        "same objects": all(a is b for a, b in zip(before, after, strict=True)),
        "values": [p.detach().clone() for p in after],
        "want": want,
        "sums": [w * world for w in want],
        "own": own,
        "grads": [None if p.grad is None else p.grad.clone() for p in after],
        "grad_want": float(me + 1),
        "buffer": model[1].running_mean.clone(),
        "rank": me,
        "names": [n for n, _ in model.named_parameters()],
        "builtin": builtin,
        "returned": result is not None and not isinstance(result, torch.nn.Module),
    }


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
    rank's batch; the models averaged after steps k, 2k, … and only then)."""
    report = Report("average_parameters")
    for world in (2, 3):
        what = f"average_parameters on {world} ranks"
        results = run_or_report(
            report,
            what,
            _run,
            average_parameters,
            world_size=world,
            timeout=timeout,
            link=CHECK_LINK,
            explain=_explain,
        )
        if results is None or not _judge(report, what, results, world):
            return report
        report.ok(
            f"{what}: every parameter is the mean over the ranks, in place; gradients "
            "and buffers untouched"
        )
    if local_sgd_step is not None:
        _check_local_sgd(report, local_sgd_step, timeout)
    return report


def _judge(report, what, results, world) -> bool:
    for rank, (res, traffic) in enumerate(results):
        if refused_rank(report, what, rank, res, traffic,
                        "average with the kit's ok.ring_all_reduce"):  # fmt: skip
            return False
        for i, (got, want, name) in enumerate(
            zip(res["values"], res["want"], res["names"], strict=True)
        ):
            if torch.allclose(got, want, atol=1e-5):
                continue
            j = int((got - want).abs().argmax())
            g, w = got.reshape(-1)[j].item(), want.reshape(-1)[j].item()
            # averaged: now the mean, and not already the mean before (equal on every rank)
            rows = zip(res["values"], res["want"], res["own"], res["names"], strict=True)
            right = [n for v, m, o, n in rows if _close(v, m) and not _close(o, m)]
            if right:
                hint = (f" — {right[0]!r} is averaged, this one is not: is every parameter "
                        "averaged?")  # fmt: skip
            elif torch.equal(got, res["own"][i]):
                hint = (
                    " — this rank's own value, unchanged: the parameters themselves must be "
                    "averaged (not their .grad), in place"
                )
            elif torch.allclose(got, res["sums"][i], atol=1e-4):
                hint = (
                    f" — that is the sum over the {world} ranks: divide by the world size "
                    "(or op='avg')"
                )
            else:
                hint = ""
            report.fail(
                f"{what}: rank {rank}, parameter {name!r} (#{i}), element {j}: expected "
                f"the mean {w:.5f}, got {g:.5f}{hint}"
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
    return True


# --------------------------------------------------------------------------- when: local SGD

K, STEPS, LR = 3, 7, 0.1  # averaged after steps 3 and 6; step 7 drifts apart again
_KIT_REDUCTIONS = ("ring_all_reduce", "naive_all_reduce", "bucketed_all_reduce")


def _sgd_model() -> torch.nn.Module:
    """The same initial model on every rank (as after the broadcast of rank 0's)."""
    torch.manual_seed(9)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


class _SGD:
    """Plain SGD with the interface of ``torch.optim.SGD`` that a training step uses
    (``zero_grad``, ``step``, ``param_groups``, ``state``). Not torch's own: constructing
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
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        for p in group["params"]:
            if p.grad is not None:
                p.add_(p.grad, alpha=-group["lr"])
        return loss


def _batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 3, generator=gen), torch.randn(6, 1, generator=gen)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _reference(world: int, zero_grad: bool = True) -> list[list[torch.Tensor]]:
    """Local SGD on ``world`` simulated ranks: [rank][step − 1] -> flat parameters."""
    models = [_sgd_model() for _ in range(world)]
    out: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for step in range(1, STEPS + 1):
        for rank, model in enumerate(models):
            if zero_grad:
                model.zero_grad(set_to_none=True)
            x, y = _batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= LR * p.grad
        if step % K == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models), strict=True):
                    mean = sum(p.detach() for p in ps) / world
                    for p in ps:
                        p.copy_(mean)
        for rank, model in enumerate(models):
            out[rank].append(_flat(model))
    return out


@contextlib.contextmanager
def _recorded_reductions(ok, model, optimizer):
    """Record, in one list, the kit's AllReduces (with what they reduce: a parameter, a
    gradient, or another tensor) and the optimizer's steps, in the order they ran."""
    called: list[str] = []

    def what(tensor) -> str:
        if isinstance(tensor, (list, tuple)) and tensor:
            tensor = tensor[0]
        if not isinstance(tensor, torch.Tensor):
            return ""
        ptr = tensor.data_ptr()
        if any(p.grad is not None and p.grad.data_ptr() == ptr for p in model.parameters()):
            return "gradient"
        return "parameter" if any(p.data_ptr() == ptr for p in model.parameters()) else ""

    def recorder(original, name):
        def call(tensor, *args, **kwargs):
            called.append(f"ok.{name}({what(tensor)})")
            return original(tensor, *args, **kwargs)

        return call

    def step(*args, _step=optimizer.step, **kwargs):
        called.append("optimizer.step()")
        return _step(*args, **kwargs)

    saved = {name: getattr(ok, name) for name in _KIT_REDUCTIONS}
    for name, original in saved.items():
        setattr(ok, name, recorder(original, name))
    optimizer.step = step
    try:
        yield called
    finally:
        for name, original in saved.items():
            setattr(ok, name, original)


def _run_local_sgd(local_sgd_step):
    import overlapkit as ok  # noqa: PLC0415

    me, world = ok.rank(), ok.world_size()
    model = _sgd_model()
    optimizer = _SGD(model.parameters(), lr=LR)
    after, events = [], []
    with _recorded_reductions(ok, model, optimizer) as called, builtin_collectives() as builtin:
        for step in range(1, STEPS + 1):
            start = len(called)
            local_sgd_step(model, optimizer, _batch(me, step), step, K)
            events.append(list(called[start:]))
            after.append(_flat(model))
    return {
        "after": after,
        "events": events,
        "want": _reference(world)[me],
        "unzeroed": _reference(world, zero_grad=False)[me],
        "builtin": builtin,
    }


def _check_local_sgd(report: Report, local_sgd_step, timeout: float) -> None:
    for world in (2, 3):
        what = f"local_sgd_step on {world} ranks, k = {K}"
        results = run_or_report(report, what, _run_local_sgd, local_sgd_step, world_size=world,
                                timeout=timeout, link=CHECK_LINK, explain=_explain)  # fmt: skip
        if results is None or not _judge_local_sgd(report, what, results):
            return
        report.ok(
            f"{what}: each rank followed its own batches, and after steps "
            f"{', '.join(str(s) for s in range(K, STEPS + 1, K))} (and only then) every "
            "rank held the mean of the ranks' models"
        )


def _averaging(events: list[str]) -> tuple[int, int]:
    """How many kit AllReduces a step ran before and after its optimizer.step()."""
    if "optimizer.step()" not in events:
        return 0, sum(e != "optimizer.step()" for e in events)
    at = events.index("optimizer.step()")
    return len(events[:at]), sum(e != "optimizer.step()" for e in events[at + 1 :])


def _judge_local_sgd(report, what, results) -> bool:
    for rank, (res, traffic) in enumerate(results):
        if refused_rank(report, what, rank, res, traffic,
                        "average with the kit's ok.ring_all_reduce"):  # fmt: skip
            return False
    periods = ", ".join(str(s) for s in range(K, STEPS + 1, K))
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
        if agree and step % K:
            report.fail(
                f"{what}: after step {step} every rank holds the same model: rank {rank} "
                f"averaged at step {step}. Local SGD lets each rank take k = {K} steps on its "
                f"own batches, and averages after steps {periods}, … (steps count from 1)"
            )
        elif step % K == 0 and not agree:
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
                    else f": with k = {K}, average after steps {periods}, …"
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
            j = int((got - want).abs().argmax())
            hint = (
                ": the gradients of earlier steps were added in — clear them every step "
                "(optimizer.zero_grad())"
                if _close(got, res["unzeroed"][i])
                else ": one step is the mean squared error of this rank's batch, backward, "
                "and one optimizer.step()"
            )
            report.fail(
                f"{what}: after step {step}, rank {rank}'s parameters differ from local "
                f"SGD's (element {j}: expected {want[j].item():.5f}, got {got[j].item():.5f})"
                f"{hint}"
            )
        return False
    return True
