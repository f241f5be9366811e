"""Which lab a submission was made from, and the lab's exercises (its check cells)."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from ..grading import POINTS

LABS = Path(__file__).resolve().parent.parent.parent / "labs"


@dataclass
class Exercise:
    check: str  # e.g. "check_ping_pong"
    names: list[str]  # the notebook objects it is called with
    kwargs: dict
    source: str  # the check cell, as the lab has it
    points: float = 0.0
    earned: float = 0.0
    feedback: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.check.removeprefix("check_")


# --------------------------------------------------------------------------- reading labs


def _check_calls(source: str) -> list[tuple[str, list[str], dict]]:
    """The ``*.grading.check_*(name, ..., key=literal)`` calls of a cell."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        attr = node.func
        if not attr.attr.startswith("check_"):
            continue
        owner = attr.value
        if not (isinstance(owner, ast.Attribute) and owner.attr == "grading"):
            continue
        names = [a.id for a in node.args if isinstance(a, ast.Name)]
        kwargs = {}
        for kw in node.keywords:
            try:
                kwargs[kw.arg] = ast.literal_eval(kw.value)
            except ValueError:
                pass
        calls.append((attr.attr, names, kwargs))
    return calls


def exercises_of(lab: nbformat.NotebookNode) -> list[Exercise]:
    found = []
    for cell in lab.cells:
        if cell.cell_type != "code":
            continue
        for check, names, kwargs in _check_calls(cell.source):
            found.append(Exercise(check, names, kwargs, _normal(cell.source),
                                  points=float(POINTS.get(check, 1))))  # fmt: skip
    return found


def _normal(source: str) -> str:
    """A cell's code as the lab shows it: without nbval's directives (solutions carry
    them for the test run; labs do not)."""
    from ..labgen import _DIRECTIVE  # noqa: PLC0415

    return "\n".join(ln for ln in source.strip().splitlines() if not _DIRECTIVE.match(ln)).strip()


def _is_check_cell(cell) -> bool:
    return cell.cell_type == "code" and bool(_check_calls(cell.source))
