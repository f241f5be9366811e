"""Checks for lab 09: local SGD's parameter averaging."""

from __future__ import annotations

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
        return (" — a parameter was changed in place where autograd records it: do it under "
                "torch.no_grad() (or on p.data)")  # fmt: skip
    return ""


def check_average_parameters(average_parameters, timeout: float = 20.0) -> Report:
    """Check ``average_parameters(model)`` (every parameter replaced, in place, by its
    mean over the ranks; gradients and buffers untouched) on 2 and 3 ranks."""
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
