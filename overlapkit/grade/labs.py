"""Which lab a submission was made from, and the lab's exercises (its check cells).

Which lab (``identify``)
------------------------
Tried in this order; the first that names exactly one lab of the labs folder wins:

1. ``lab=`` (the command line's ``--lab NN``; ``"03"``, ``3`` or ``"03_ring_allreduce"``).
2. The notebook's metadata, ``metadata["overlapkit"] = {"lab": "03", "name":
   "03_ring_allreduce", "version": ...}``, stamped by ``make labs`` (``overlapkit.labgen``).
   It survives the renaming that learning platforms do as a matter of course.
3. The file name: the lab's own name ("03_ring_allreduce.ipynb"), else a lab's name inside
   it ("03_ring_allreduce-jsmith", "ring_allreduce-Copy1"), else a number after "lab"
   ("Lab 3", "lab03 submission (1)"), else the only lab number in it ("hw3"); copy marks
   ("(1)", "-Copy1", "copy 2") are not numbers of labs. A name that points at two labs
   says nothing.

An explicit lab comes first because it is the instructor's word and the one thing the
student cannot change. An instructor grading a folder with ``--lab 03`` fills lab 3's
column; a student who handed in lab 5 there must not get lab 5's points in it: graded as
lab 3, the notebook lacks lab 3's check cells and scores 0 with that reason. Without
``lab=``, metadata (the kit wrote it) comes before the file name (anyone renames files).
When the sources disagree, the result carries a note saying so. A notebook none of them
identifies is an error naming all three ways.

Check cells (``check_cell_problem``)
------------------------------------
An exercise is the lab's check call ``ok.grading.check_NAME(fn, ..., key=literal)``. It is
present in a student's notebook when some code cell holds a call with the same parsed code
(``ast.dump`` of the call, keyword arguments in any order): formatting, quotes, comments,
parentheses, trailing commas, where the cell is, cells added and outputs left in do not
matter, and IPython magic lines (``%%time``) are left out. Code around the call in the same
cell (``r = ok.grading.check_x(f)``, a ``print`` around it) is allowed, as long as the call
itself is unchanged: the grader never runs the student's check cells (``kernel.py`` drops
every cell holding a check call, by the same parse) but the lab's own call. A call of the
check with other arguments, or no call of it, scores 0 and names both calls.
"""

from __future__ import annotations

import ast
import copy
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from ..grading.exercises import POINTS

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
    call: str = ""  # the check call's parsed code (what a student's cell must hold)
    shown: str = ""  # the check call, as code

    @property
    def name(self) -> str:
        return self.check.removeprefix("check_")


# --------------------------------------------------------------------------- check calls

_MAGIC = re.compile(r"^\s*[%!]")


def _parse(source: str) -> ast.Module | None:
    """A cell's code, parsed; IPython magic and shell lines left out; None if not Python."""
    for text in (source, "\n".join(ln for ln in source.splitlines() if not _MAGIC.match(ln))):
        try:
            return ast.parse(text)
        except SyntaxError:
            continue
    return None


def _check_nodes(source: str) -> list[ast.Call]:
    """The ``*.grading.check_*(...)`` calls of a cell, in order."""
    tree = _parse(source)
    if tree is None:
        return []
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        attr = node.func
        if not attr.attr.startswith("check_"):
            continue
        owner = attr.value
        if isinstance(owner, ast.Attribute) and owner.attr == "grading":
            calls.append(node)
    return sorted(calls, key=lambda n: (n.lineno, n.col_offset))


def _key(call: ast.Call) -> str:
    """A call's meaning: its parsed code without positions, keyword arguments sorted."""
    call = copy.deepcopy(call)
    call.keywords.sort(key=lambda kw: kw.arg or "")
    return ast.dump(call)


def _parts(node: ast.Call) -> tuple[str, list[str], dict]:
    """A check call's check, the notebook objects it passes and its literal keywords."""
    names = [a.id for a in node.args if isinstance(a, ast.Name)]
    kwargs = {}
    for kw in node.keywords:
        try:
            kwargs[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            pass
    return node.func.attr, names, kwargs


def _check_calls(source: str) -> list[tuple[str, list[str], dict]]:
    """The ``*.grading.check_*(name, ..., key=literal)`` calls of a cell."""
    return [_parts(node) for node in _check_nodes(source)]


def exercises_of(lab: nbformat.NotebookNode) -> list[Exercise]:
    found = []
    for cell in lab.cells:
        if cell.cell_type != "code":
            continue
        for node in _check_nodes(cell.source):
            check, names, kwargs = _parts(node)
            found.append(
                Exercise(
                    check,
                    names,
                    kwargs,
                    _normal(cell.source),
                    points=float(POINTS.get(check, 1)),
                    call=_key(node),
                    shown=ast.unparse(node),
                )
            )
    return found


def check_calls(nb: nbformat.NotebookNode) -> list[tuple[str, str, str]]:
    """Every check call in a notebook's code cells: (check, parsed code, code)."""
    return [(node.func.attr, _key(node), ast.unparse(node))
            for cell in nb.cells if cell.cell_type == "code"
            for node in _check_nodes(cell.source)]  # fmt: skip


def check_cell_problem(ex: Exercise, calls: list[tuple[str, str, str]]) -> str | None:
    """Why the exercise's check cell does not count (None when some cell holds its call)."""
    if any(key == ex.call for _, key, _ in calls):
        return None
    same = [shown for check, key, shown in calls if check == ex.check]
    if same:  # the one most like the lab's, should the lab call this check twice
        shown = max(same, key=lambda s: difflib.SequenceMatcher(None, s, ex.shown).ratio())
        return (f"the check cell was edited or deleted: it calls `{shown}`, the lab's calls "
                f"`{ex.shown}`; the exercise scores 0 (restore the lab's call)")  # fmt: skip
    return (f"the check cell `{ex.shown}` was edited or deleted: no cell calls "
            f"{ex.check}; the exercise scores 0 (restore the cell as the lab has it)")  # fmt: skip


def _normal(source: str) -> str:
    """A cell's code as the lab shows it: without nbval's directives (solutions carry
    them for the test run; labs do not)."""
    from ..labgen import _DIRECTIVE  # noqa: PLC0415

    return "\n".join(ln for ln in source.strip().splitlines() if not _DIRECTIVE.match(ln)).strip()


def _is_check_cell(cell) -> bool:
    """A cell holding a check call, however formatted: never run by the grader."""
    return cell.cell_type == "code" and bool(_check_nodes(cell.source))


# --------------------------------------------------------------------------- which lab


@dataclass
class Identity:
    """The lab a submission was made from (``path``), or why none (``error``)."""

    path: Path | None = None
    how: str = ""  # "--lab", "metadata" or "file name"
    notes: list[str] = field(default_factory=list)
    error: str = ""


def lab_index(labs: Path) -> dict[str, Path]:
    """The labs of a folder by name (file name without .ipynb)."""
    return {p.stem: p for p in sorted(labs.glob("*.ipynb")) if not p.name.startswith(".")}


def _number(stem: str) -> int | None:
    m = re.match(r"\d+", stem)
    return int(m.group()) if m else None


def _lab_id(stem: str) -> str:
    m = re.match(r"\d+", stem)
    return m.group() if m else stem


def _resolve(ref, index: dict[str, Path]) -> set[str]:
    """The labs a reference names: a lab's name (with or without .ipynb) or its number."""
    ref = str(ref).strip().removesuffix(".ipynb")
    if ref in index:
        return {ref}
    if ref.isdigit():
        return {s for s in index if _number(s) == int(ref)}
    return set()


_COPY = re.compile(r"\(\d+\)|[-_ ]?copy[-_ ]?\d*", re.IGNORECASE)


def _from_name(filename: str, index: dict[str, Path]) -> set[str]:
    """The labs a file name points at (see the module's docstring)."""
    stem = filename.removesuffix(".ipynb")
    if stem in index:
        return {stem}
    plain = _COPY.sub(" ", stem).lower()
    words = "_" + re.sub(r"[^a-z0-9]+", "_", plain).strip("_") + "_"
    named = set()
    for s in index:  # a lab's name, or the part after its number, between word breaks
        slug = re.sub(r"[^a-z0-9]+", "_", s.lower()).strip("_")
        rest = re.sub(r"^\d+_", "", slug)
        if f"_{slug}_" in words or (rest and rest != slug and f"_{rest}_" in words):
            named.add(s)
    after_lab = {s for n in re.findall(r"(?<![a-z])lab[\s_\-.#]*(\d+)", plain)
                 for s in index if _number(s) == int(n)}  # fmt: skip
    if named or after_lab:
        return named | after_lab
    # a number on its own ("7 - jsmith"), not glued to a word ("rank0", "hw7": a homework's
    # number need not be the lab's) nor a year
    numbers = {int(n) for n in re.findall(r"(?<![a-z0-9])(\d{1,2})(?![a-z0-9])", plain)}
    return {s for s in index if _number(s) in numbers}


def _ids(index: dict[str, Path]) -> str:
    return ", ".join(_lab_id(s) for s in index) or "none"


def identify(path: Path, labs: Path, metadata: dict | None = None, lab=None) -> Identity:
    """Which lab of ``labs`` the notebook at ``path`` was made from (module docstring)."""
    index = lab_index(labs)
    ids = _ids(index)
    found = Identity()
    meta = (metadata or {}).get("overlapkit")
    meta = meta if isinstance(meta, dict) else None
    by_meta: set[str] = set()
    if meta is not None:
        for ref in (meta.get("name"), meta.get("lab")):
            if ref is not None and len(by_meta := _resolve(ref, index)) == 1:
                break
    by_name = _from_name(path.name, index)

    if lab is not None:
        chosen = _resolve(lab, index)
        if len(chosen) != 1:
            found.error = (f"--lab {lab} names {'no' if not chosen else 'more than one'} lab "
                           f"in {labs}; lab ids: {ids}")  # fmt: skip
            return found
        found.how = "--lab"
    elif len(by_meta) == 1:
        chosen, found.how = by_meta, "metadata"
    elif len(by_name) == 1:
        chosen, found.how = by_name, "file name"
    else:
        if meta is None:
            why_meta = "no overlapkit lab metadata"
        else:
            why_meta = (f"overlapkit metadata naming lab {meta.get('name') or meta.get('lab')!r}, "
                        f"which is not one of these labs")  # fmt: skip
        if by_name:
            why_name = (f"a file name {path.name!r} that points at several labs "
                        f"({', '.join(_lab_id(s) for s in sorted(by_name))})")  # fmt: skip
        else:
            why_name = f"no lab number in the file name {path.name!r}"
        found.error = (f"cannot tell which lab {path.name!r} was made from (not a lab of this "
                       f"kit?): {why_meta}, {why_name}, and no --lab given; lab ids in {labs}: "
                       f"{ids}")  # fmt: skip
        return found

    (stem,) = chosen
    found.path = index[stem]
    for source, hits in (("metadata", by_meta), ("file name", by_name)):
        if source != found.how and len(hits) == 1 and hits != chosen:
            (other,) = hits
            found.notes.append(f"graded as {stem} (from the {found.how}); the notebook's "
                               f"{source} says {other}")  # fmt: skip
    if meta is not None and meta.get("version") not in (None, _version()):
        found.notes.append(f"the notebook was made from the labs of overlapkit "
                           f"{meta.get('version')}; graded with {_version()}")  # fmt: skip
    return found


def _version() -> str:
    from .. import __version__  # noqa: PLC0415

    return __version__
