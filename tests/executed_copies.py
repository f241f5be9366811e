"""The test run's nbval kernels leave each solution notebook executed, for the course book.

nbval runs every code cell of solutions/ and keeps what the cell printed and drew
(``IPyNbCell.test_outputs``); here those outputs are put back into a copy of the notebook,
written to build/executed/ as soon as every cell of it passed, marked with the solution's SHA-256
(overlapkit.bookgen reads only copies whose mark matches). The book built after the tests
then executes nothing. The kernels draw figures as PNG and SVG: bookgen.kernel_env()'s IPython
profile, set for the whole run (a kernel started by a test inherits it; it changes nothing but
the formats a figure is sent in).
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat

from overlapkit import bookgen

#: notebook path -> {code cell number: outputs}
_outputs: dict[Path, dict[int, list]] = {}


def use_figure_formats() -> None:
    os.environ.update({"IPYTHONDIR": bookgen.kernel_env()["IPYTHONDIR"]})


def collected() -> set[str]:
    """The names of the solution notebooks this test run executes."""
    return {path.name for path in _outputs}


def failed_marker(target: Path, name: str) -> Path:
    return target / f"{name}.failed"


def watch(items, target: Path) -> None:
    """Wrap each nbval cell so that what it printed is kept once it has run, and the notebook
    written to ``target`` as soon as its last cell has passed (another worker's test of the
    book may be waiting for it)."""
    for item in items:
        if type(item).__name__ != "IPyNbCell":
            continue
        path = Path(str(item.fspath))
        _outputs.setdefault(path, {})
        item.runtest = _recording(item, item.runtest, path, target)


def _recording(item, runtest, path, target):
    def run():
        try:
            runtest()
        except BaseException:
            target.mkdir(parents=True, exist_ok=True)
            failed_marker(target, path.name).write_text(bookgen.source_key(path))
            raise
        finally:
            if item.test_outputs is not None:
                _outputs[path][item.cell_num] = item.test_outputs
        _write_when_complete(path, target)

    return run


def _write_when_complete(path: Path, target: Path) -> None:
    outputs = _outputs[path]
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    if len(outputs) != len(code) or failed_marker(target, path.name).exists():
        return
    for number, cell in enumerate(code):
        cell.outputs = [nbformat.from_dict(dict(o)) for o in outputs[number]]
    bookgen.mark_executed(nb, path, "nbval")
    target.mkdir(parents=True, exist_ok=True)
    partial = target / f".{path.name}.partial"
    nbformat.write(nb, partial)
    partial.replace(target / path.name)  # whole or not at all: a waiting reader never sees half


def forget_failures(target: Path) -> None:
    """At the start of a run: a notebook that failed in an earlier run may pass in this one."""
    for marker in target.glob("*.failed"):
        marker.unlink()
