"""Checks for lab 09: local SGD — what its averaging averages, and when it runs."""

from __future__ import annotations

from .cases import Case, private_seeds, run_cases, seeded
from .lab03_collectives import CHECK_LINK
from .lab09_mean import _add_wants, _judge, _run
from .lab09_periods import _add_local_sgd_wants, _judge_local_sgd, _run_local_sgd, _steps
from .report import Report

WORLDS = (2, 3)  # average_parameters: 2 ranks, then 3 (a divisor of 2 shows there)
LOCAL_CASES = ((2, 3), (3, 2))  # local_sgd_step: (ranks, k) — two k, so a fixed period shows


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
        _add_wants(results, seeds)
        return _judge(report, what, results, world)

    passed = ("every parameter is the mean over the ranks, in place; gradients and "
              "buffers untouched")  # fmt: skip
    return Case(what, world, _run, (average_parameters,), judge, seeded(seeds), passed)


def _local_sgd_case(report: Report, local_sgd_step, world: int, k: int) -> Case:
    what, seeds = f"local_sgd_step on {world} ranks, k = {k}", private_seeds(world, 40)

    def judge(results) -> bool:
        _add_local_sgd_wants(results, seeds, k)
        return _judge_local_sgd(report, what, results, k)

    passed = (f"each rank followed its own batches, and after steps "
              f"{', '.join(map(str, _steps(k)))} (and only then) every rank held the "
              "mean of the ranks' models")  # fmt: skip
    return Case(what, world, _run_local_sgd, (local_sgd_step, k), judge, seeded(seeds), passed)
