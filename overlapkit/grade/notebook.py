"""Grade one notebook: run it, then judge each exercise with the lab's own check."""

from __future__ import annotations

import tempfile
from pathlib import Path

import nbformat

from ..grading.exercises import WITNESSED
from .judge import run_check
from .kernel import execute
from .labs import LABS, Exercise, check_calls, check_cell_problem, exercises_of, identify
from .tamper import EnvironmentChanged, changes, fingerprint


def grade_notebook(path: Path, labs: Path = LABS, cell_limit: float = 120.0,
                   total_limit: float = 600.0, check_limit: float = 300.0,
                   lab: str | int | None = None) -> dict:  # fmt: skip
    """Grade the notebook at ``path`` against the lab it was made from, found in ``labs``
    by ``lab`` (the CLI's ``--lab NN``), else its overlapkit metadata, else its file name
    (see ``labs.identify``)."""
    path = Path(path)
    result = {"notebook": str(path), "score": 0.0, "max_score": 0.0, "exercises": []}
    try:
        student, unreadable = nbformat.read(path, as_version=4), None
    except Exception as exc:  # noqa: BLE001 - an unreadable file scores 0, with its reason
        student, unreadable = None, exc
    identity = identify(path, labs, student.metadata if student is not None else {}, lab)
    if identity.error:
        result["error"] = identity.error
        if unreadable is not None:
            result["error"] += f" (and the notebook could not be read: {unreadable})"
        return result
    result["lab"], result["lab_from"] = identity.path.stem, identity.how
    exercises = exercises_of(nbformat.read(identity.path, as_version=4))
    result["max_score"] = sum(ex.points for ex in exercises)
    if unreadable is not None:
        for ex in exercises:
            ex.feedback.append(f"the notebook could not be read: {unreadable}")
        result["exercises"] = [_entry(ex) for ex in exercises]
        return result
    kept = check_calls(student)
    names = sorted({n for ex in exercises for n in ex.names})
    with tempfile.TemporaryDirectory(prefix="overlapkit-grade-") as folder:
        before = fingerprint(labs)
        measures = tuple(sorted({WITNESSED[ex.check] for ex in exercises if ex.check in WITNESSED}))
        found, notes = execute(student, names, folder, cell_limit, total_limit, measures)
        for ex in exercises:
            _unchanged(path, labs, before)  # after the kernel, and after every judge's ranks
            _grade_one(ex, found, kept, folder, check_limit)
        _unchanged(path, labs, before)
    result["exercises"] = [_entry(ex) for ex in exercises]
    result["score"] = round(sum(ex.earned for ex in exercises), 4)
    notes = identity.notes + notes
    if notes:
        result["notes"] = notes
    return result


def _unchanged(path: Path, labs: Path, before: dict) -> None:
    """Raise :class:`EnvironmentChanged` when the grader's files differ from ``before``: the
    judge would import or read what the notebook (or a process it left) wrote."""
    changed = changes(before, fingerprint(labs, like=before))
    if changed:
        raise EnvironmentChanged(
            f"grading {path} changed the grader's own files, so no verdict from here on "
            f"can be trusted: {', '.join(changed[:5])}{' …' if len(changed) > 5 else ''}. "
            "Restore them (reinstall the kit, regenerate labs/) and grade that notebook "
            "where its kernel cannot write them (a container, a user of its own)"
        )


def _grade_one(ex: Exercise, found: dict, kept: list, folder: str, limit: float):
    problem = check_cell_problem(ex, kept)  # the lab's check call, compared by its parsed code
    if problem:
        ex.feedback.append(problem)
        return
    if found and not found.get("__ok__", True):
        ex.feedback.append("the notebook binds `ok` to something else than the overlapkit "
                           "module: every exercise scores 0")  # fmt: skip
        return
    if found and not found.get("__grading__", True):
        ex.feedback.append("the notebook defines its own `grading`: every exercise scores 0")
        return
    missing = [f"{n} ({found.get(n, 'not reached')})" for n in ex.names if found.get(n) != "ok"]
    if missing:
        ex.feedback.append(f"not graded: {', '.join(missing)}")
        return
    shown = found.get("__shown__")
    report = run_check(ex, folder, limit, shown=shown if isinstance(shown, dict) else None)
    if isinstance(report, str):
        ex.feedback.append(report)
        return
    ex.earned = round(ex.points * report["score"], 4)
    ex.feedback += [("✔ " if c["passed"] else "✘ ") + c["message"] for c in report["cases"]]
    if not report["cases"]:
        ex.feedback.append("the check ran no case")


def _entry(ex: Exercise) -> dict:
    return {"name": ex.name, "points": ex.earned, "max_points": ex.points,
            "feedback": "\n".join(ex.feedback)}  # fmt: skip
