"""Student labs from solution notebooks, and the reference outputs nbval compares.

``solutions/`` is the source. In its code cells, exercise code sits between
nbgrader's markers::

    def ping_pong(nbytes, iters):            def ping_pong(nbytes, iters):
        ### BEGIN SOLUTION            ──►        # YOUR CODE HERE
        ...                                      raise NotImplementedError
        ### END SOLUTION

A region ``### BEGIN HIDDEN TESTS`` … ``### END HIDDEN TESTS`` is removed, as
are ``# NBVAL_...`` directives (meant for the test run, not for learners), and
every output. In markdown cells a solution region becomes "YOUR ANSWER HERE".

Each lab carries its identity in its metadata, so the grader knows it under any file
name: ``metadata["overlapkit"] = {"lab": "05", "name": "05_async_ops", "version": "0.1.0"}``
(the kit's version; a new version makes every lab stale until ``make labs``). Only labs
are stamped: ``solutions/`` is the source and this module never writes it (graded, a
solution is known by its file name).

Commands (``python -m overlapkit.labgen ...``)::

    generate [--check] [SOLUTIONS] [LABS]   write labs/ (or, with --check, list stale ones)
    record NOTEBOOK...                      execute solution notebooks and keep the outputs
                                            nbval compares (not those of cells marked
                                            NBVAL_IGNORE_OUTPUT or NBVAL_SKIP)
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import time
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
IGNORE_MARKS = ("NBVAL_IGNORE_OUTPUT", "NBVAL_SKIP")
_DIRECTIVE = re.compile(r"^\s*# NBVAL_[A-Z_]+\s*$")


class MarkerError(ValueError):
    """Unbalanced or nested markers in a solution notebook."""


def _strip_region(lines, begin, end, replacement, where):
    out, inside, indent = [], False, ""
    for n, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped == begin:
            if inside:
                raise MarkerError(f"{where}, line {n}: {begin!r} inside another region")
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            out.extend(indent + r for r in replacement)
        elif stripped == end:
            if not inside:
                raise MarkerError(f"{where}, line {n}: {end!r} without {begin!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise MarkerError(f"{where}: {begin!r} is never closed by {end!r}")
    return out


def lab_cell_source(source: str, cell_type: str, where: str = "cell") -> str:
    """The student's version of one cell's source."""
    lines = source.split("\n")
    if cell_type == "code":
        lines = _strip_region(lines, BEGIN_HIDDEN, END_HIDDEN, [], where)
        lines = _strip_region(
            lines, BEGIN, END, ["# YOUR CODE HERE", "raise NotImplementedError"], where
        )
        lines = [line for line in lines if not _DIRECTIVE.match(line)]
    elif cell_type == "markdown":
        lines = _strip_region(lines, BEGIN, END, ["YOUR ANSWER HERE"], where)
    return "\n".join(lines).strip("\n")


def has_exercise(source: str) -> bool:
    return any(line.strip() == BEGIN for line in source.split("\n"))


def stamp(nb: nbformat.NotebookNode, name: str) -> None:
    """Write the lab's identity into a notebook's metadata (see the module's docstring)."""
    from overlapkit import __version__  # noqa: PLC0415

    stem = Path(name).stem
    number = re.match(r"\d+", stem)
    nb.metadata["overlapkit"] = {
        "lab": number.group() if number else stem,
        "name": stem,
        "version": __version__,
    }


#: the tag of a text cell that explains an exercise's answer, to be read once its check
#: passes: the student notebook shows it collapsed (nbformat's ``jupyter.source_hidden``,
#: which JupyterLab draws as a bar to click open), the students' book leaves it out
AFTER_CHECK = "after-check"


def make_lab(solution: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The student notebook for a solution notebook (a new object; the input is untouched),
    stamped with the lab's identity (``name``: the solution's file name)."""
    lab = copy.deepcopy(solution)
    stamp(lab, name)
    for i, cell in enumerate(lab.cells):
        cell.source = lab_cell_source(cell.source, cell.cell_type, f"{name}, cell {i}")
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)
        cell.metadata.pop("overlapkit", None)  # the book's name for a figure the notes show
        if AFTER_CHECK in cell.metadata.get("tags", []):  # collapsed until the learner opens it
            cell.metadata.setdefault("jupyter", {})["source_hidden"] = True
    return lab


def _text(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def generate(solutions: Path, labs: Path, check: bool = False) -> list[Path]:
    """Write (or, with ``check``, only compare) every lab; returns the stale or written paths."""
    sources = sorted(solutions.glob("*.ipynb"))
    if not sources:
        raise FileNotFoundError(f"no notebooks in {solutions}")
    changed = []
    expected_names = set()
    for src in sources:
        lab = make_lab(nbformat.read(src, as_version=4), src.name)
        target = labs / src.name
        expected_names.add(src.name)
        text = _text(lab)
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            changed.append(target)
            if not check:
                labs.mkdir(parents=True, exist_ok=True)
                target.write_text(text, encoding="utf-8")
    strays = [p for p in labs.glob("*.ipynb") if p.name not in expected_names]
    changed += strays  # a lab without a solution is stale too
    if not check:
        for p in strays:
            p.unlink()
    return changed


def _ignored(cell) -> bool:
    return any(mark in cell.source for mark in IGNORE_MARKS)


def record(path: Path, timeout: int = 300) -> float:
    """Execute a solution notebook in place, keeping only the outputs nbval compares.

    Returns the wall time in seconds. A compared cell that draws a picture is
    an error: pictures vary, so their cells must be marked NBVAL_IGNORE_OUTPUT.
    """
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    for i, cell in enumerate(nb.cells):
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        if _ignored(cell):
            cell.outputs = []
            continue
        for out in cell.outputs:
            if out.get("output_type") == "error":
                raise RuntimeError(f"{path.name}, cell {i} raised {out['ename']}: {out['evalue']}")
            if any(k.startswith("image/") for k in out.get("data", {})):
                raise ValueError(
                    f"{path.name}, cell {i} draws a picture but its output is compared: "
                    "add '# NBVAL_IGNORE_OUTPUT' to the cell"
                )
    nbformat.write(nb, path)
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m overlapkit.labgen",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="write labs/ from solutions/")
    gen.add_argument("solutions", nargs="?", default="solutions", type=Path)
    gen.add_argument("labs", nargs="?", default="labs", type=Path)
    gen.add_argument("--check", action="store_true", help="only list stale labs; exit 1 if any")
    rec = sub.add_parser("record", help="execute solution notebooks and keep compared outputs")
    rec.add_argument("notebooks", nargs="+", type=Path)
    args = parser.parse_args(argv)

    if args.command == "generate":
        changed = generate(args.solutions, args.labs, check=args.check)
        verb = "stale" if args.check else "wrote"
        for p in changed:
            print(f"{verb} {os.path.relpath(p)}")
        if args.check and changed:
            print("run `make labs` to regenerate", file=sys.stderr)
            return 1
        if not changed:
            print("labs are up to date")
        return 0
    for nb in args.notebooks:
        print(f"{nb}: executed and recorded in {record(nb):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
