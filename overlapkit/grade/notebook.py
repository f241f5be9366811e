"""Grade one notebook: run it, then judge each exercise with the lab's own check."""

from __future__ import annotations

import tempfile
from pathlib import Path

import nbformat

from .judge import run_check
from .kernel import execute
from .labs import LABS, Exercise, _normal, exercises_of


def grade_notebook(path: Path, labs: Path = LABS, cell_limit: float = 120.0,
                   total_limit: float = 600.0, check_limit: float = 300.0) -> dict:  # fmt: skip
    lab_path = labs / path.name
    result = {"notebook": str(path), "score": 0.0, "max_score": 0.0, "exercises": []}
    if not lab_path.exists():
        result["error"] = f"no lab named {path.name} in {labs}: not a lab of this kit"
        return result
    lab = nbformat.read(lab_path, as_version=4)
    exercises = exercises_of(lab)
    result["max_score"] = sum(ex.points for ex in exercises)
    try:
        student = nbformat.read(path, as_version=4)
    except Exception as exc:  # noqa: BLE001 - an unreadable file scores 0, with its reason
        for ex in exercises:
            ex.feedback.append(f"the notebook could not be read: {exc}")
        result["exercises"] = [_entry(ex) for ex in exercises]
        return result
    kept = {_normal(c.source) for c in student.cells if c.cell_type == "code"}
    names = sorted({n for ex in exercises for n in ex.names})
    cwd = str(path.parent.resolve())
    with tempfile.TemporaryDirectory(prefix="overlapkit-grade-") as folder:
        found, notes = execute(student, names, folder, cell_limit, total_limit, cwd)
        for ex in exercises:
            _grade_one(ex, found, kept, folder, check_limit, cwd)
    result["exercises"] = [_entry(ex) for ex in exercises]
    result["score"] = round(sum(ex.earned for ex in exercises), 4)
    if notes:
        result["notes"] = notes
    return result


def _grade_one(ex: Exercise, found: dict, kept: set, folder: str, limit: float, cwd: str):
    if ex.source not in kept:
        ex.feedback.append(f"the check cell `{ex.source}` was edited or deleted: the exercise "
                           "scores 0 (restore the cell as the lab has it)")  # fmt: skip
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
    report = run_check(ex, folder, limit, cwd)
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
