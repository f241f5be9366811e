"""A check's cases on ranks, run one way: each rank's private inputs drawn by the check,
the kit's answers the exercise forbids watched, the verdict given in the checking process.

A check declares its cases (:class:`Case`: what runs on how many ranks, with which private
inputs, and how the ranks' results are judged) and :func:`run_cases` runs them in order::

    seeds = private_seeds(world)                  # drawn here, each sent to its rank alone
    Case(what, world, _run, (fn,), rank_kwargs=seeded(seeds),
         judge=lambda results: _judge(report, what, results, seeds))

The judge works out what the ranks should hold where every seed is known (here, never on a
rank), prints its ✘ line when they do not, and says whether they did. The first failure
ends the check; the cases after it count as failed ("not reached").
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from .common import run_or_report
from .exercises import answers_of
from .report import Report

#: the ✘ text of a case after the first failure, where a check counts every case
NOT_REACHED = "not reached: the check stops at its first failure (above)"


def not_reached(what: str) -> str:
    """The ✘ text of the case ``what`` (its name), after a check's first failure."""
    return f"{what}: {NOT_REACHED}"


def count_not_reached(report: Report, whats) -> None:
    """A ✘ line for each case of ``whats`` (their names) after a check's first failure: a
    check that stops there scores out of every case, not only of those it ran."""
    for what in whats:
        report.fail(not_reached(what))


def stop_at(report: Report, text: str, later) -> Report:
    """``report`` of a check that stops at a failed case: its ✘ ``text``, then each case of
    ``later`` (their names) as not reached."""
    report.fail(text)
    count_not_reached(report, later)
    return report


def private_seeds(world: int, bits: int = 62) -> list[int]:
    """One seed per rank, drawn by the checking process: a rank that gets only its own
    cannot rebuild another's data and skip the communication."""
    return [secrets.randbits(bits) for _ in range(world)]


def seeded(seeds: list[int]) -> list[dict]:
    """Each rank's keyword arguments: its own seed."""
    return [{"seed": seed} for seed in seeds]


@dataclass(frozen=True)
class Case:
    """One case of a check: ``run(*args)`` on ``world`` ranks, then ``judge(results)``."""

    what: str  # the case, first on its ✔/✘ lines
    world: int
    run: Callable  # what each rank runs (the learner's function among ``args``)
    args: tuple
    #: (the ranks' [(value, Traffic)]) -> right; prints the ✘ line of what is wrong
    judge: Callable[[list], bool]
    rank_kwargs: list[dict] | None = None  # each rank's private inputs
    passed: str | None = None  # the ✔ line's text after "what: "; None: the judge says it
    #: where the ✘ line of a run that failed goes (a report that adds a hint); the check's
    #: report when None
    failures: object = None


def run_cases(report: Report, check: str, cases, *, timeout: float, link=None, explain=None,
              not_reached: bool = True) -> list | None:  # fmt: skip
    """Run ``cases`` in order for the exercise of ``check`` (its name in ok.grading) and
    return the last one's results, or None at the first failure (a run that failed: its
    ✘ line; a judge that said wrong). The exercise's answers (``exercises.answers_of``)
    refuse to run meanwhile. ``not_reached`` (the default): the cases after a failure count
    as failed, each on a ✘ line of its own, so the check scores out of every case."""
    forbid = answers_of(check)
    results = None
    for n, case in enumerate(cases):
        results = run_or_report(case.failures or report, case.what, case.run, *case.args,
                                world_size=case.world, timeout=timeout, link=link,
                                explain=explain, forbid=forbid,
                                rank_kwargs=case.rank_kwargs)  # fmt: skip
        if results is None or not case.judge(results):
            if not_reached:
                count_not_reached(report, [later.what for later in cases[n + 1 :]])
            return None
        if case.passed is not None:
            report.ok(f"{case.what}: {case.passed}")
    return results
