"""``python -m overlapkit.grade --similarity``: copies are reported, honest work is not."""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
from pathlib import Path

import nbformat
import pytest

from overlapkit import collectives
from overlapkit.grade.cli import main

pytest.importorskip("copydetect")

ROOT = Path(__file__).resolve().parent.parent
LAB = "03_ring_allreduce"


def _with_exercise(nb, source: str):
    nb = copy.deepcopy(nb)
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and "def ring_all_reduce" in c.source]
    cell.source = source
    return nb


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A class of lab 03: alice solved it; bob handed in alice's answer with names changed
    and comments rewritten; carol left the lab as handed out; dave pasted the kit's ring;
    erin's file is not a notebook. Compared with the solutions as a reference."""
    root = tmp_path_factory.mktemp("similarity")
    solved = nbformat.read(ROOT / "solutions" / f"{LAB}.ipynb", as_version=4)
    lab = nbformat.read(ROOT / "labs" / f"{LAB}.ipynb", as_version=4)
    (answer,) = [c.source for c in solved.cells if "def ring_all_reduce" in c.source]
    renamed = answer
    names = [("flat", "buf"), ("bounds", "spans"), ("step(", "hop("), ("handles", "hs")]
    comments = [("# ReduceScatter", "# phase one"), ("# AllGather", "# phase two")]
    for old, new in names + comments:
        renamed = renamed.replace(old, new)
    ring = (collectives._ring_reduce_scatter_flat, collectives._ring_all_gather_flat)
    kit = "\n\n".join(inspect.getsource(f) for f in ring)
    pasted = kit + (
        "\n\ndef ring_all_reduce(tensor):\n    flat = tensor.view(-1)\n"
        "    bounds = ok.collectives.chunk_bounds(flat.numel(), ok.world_size())\n"
        "    _ring_reduce_scatter_flat(flat, bounds, 'sum', None)\n"
        "    _ring_all_gather_flat(flat, bounds, None)\n"
    )
    folder = root / "class"
    folder.mkdir()
    nbformat.write(solved, folder / "alice.ipynb")
    nbformat.write(_with_exercise(solved, renamed), folder / "bob.ipynb")
    nbformat.write(lab, folder / "carol.ipynb")
    nbformat.write(_with_exercise(lab, pasted), folder / "dave.ipynb")
    (folder / "erin.ipynb").write_text("not a notebook")
    out = root / "out"
    refs = root / "solutions"
    refs.mkdir()
    nbformat.write(solved, refs / f"{LAB}.ipynb")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main([str(folder), "--lab", "03", "--similarity", str(out),
                       "--reference", str(refs)])  # fmt: skip
    return status, stdout.getvalue(), stderr.getvalue(), out


def test_a_classmates_copy_with_names_changed_is_reported(report):
    status, stdout, _, _ = report
    assert status == 0
    pair = [line for line in stdout.splitlines() if "alice" in line and "bob" in line]
    assert pair, stdout
    assert "100% of" in pair[0], pair


def test_a_copy_of_the_kits_own_code_is_reported_with_the_file_it_came_from(report):
    _, stdout, _, _ = report
    assert "dave ↔ overlapkit/collectives.py (the kit)" in stdout, stdout


def test_a_copy_of_the_reference_solution_is_reported(report):
    _, stdout, _, _ = report
    assert "alice ↔ solutions (reference)" in stdout, stdout


def test_the_code_the_lab_handed_out_counts_for_nobody(report):
    _, stdout, _, out = report
    assert "carol" not in stdout, stdout
    given = out / "code" / "given" / LAB / f"{LAB}.py"
    assert (out / "code" / LAB / "carol.py").read_text() == given.read_text()


def test_a_file_that_is_not_a_notebook_is_skipped_by_name_and_the_report_is_written(report):
    _, _, stderr, out = report
    assert "skipped" in stderr and "erin.ipynb" in stderr, stderr
    assert (out / f"{LAB}.html").stat().st_size > 0
