"""The lab generator: solutions/ -> labs/ (markers, hidden tests, outputs, staleness)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

import overlapkit
from overlapkit import labgen

ROOT = Path(__file__).resolve().parents[1]


def test_solution_region_becomes_not_implemented_at_its_indentation():
    src = "def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\n"
    assert labgen.lab_cell_source(src, "code") == (
        "def f(x):\n    y = 1\n    # YOUR CODE HERE\n    raise NotImplementedError"
    )


def test_hidden_tests_and_nbval_directives_are_removed():
    src = (
        "# NBVAL_IGNORE_OUTPUT\nx = 1\n"
        "### BEGIN HIDDEN TESTS\nassert x == 1\n### END HIDDEN TESTS\n"
        "print(x)"
    )
    assert labgen.lab_cell_source(src, "code") == "x = 1\nprint(x)"


def test_markdown_solution_becomes_your_answer_here():
    src = "Why?\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION"
    assert labgen.lab_cell_source(src, "markdown") == "Why?\nYOUR ANSWER HERE"


@pytest.mark.parametrize(
    "src, message",
    [
        ("### BEGIN SOLUTION\nx = 1\n", "never closed"),
        ("x = 1\n### END SOLUTION\n", "without"),
        ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "inside another"),
    ],
)
def test_unbalanced_markers_are_an_error_naming_the_cell(src, message):
    with pytest.raises(labgen.MarkerError, match=message) as info:
        labgen.lab_cell_source(src, "code", "nb.ipynb, cell 3")
    assert "nb.ipynb, cell 3" in str(info.value)


def test_outputs_and_execution_counts_are_cleared_without_touching_the_solution():
    cell = new_code_cell("print(1)", execution_count=4)
    cell.outputs = [new_output("stream", name="stdout", text="1\n")]
    solution = new_notebook(cells=[cell, new_markdown_cell("text")])
    lab = labgen.make_lab(solution)
    assert lab.cells[0].outputs == [] and lab.cells[0].execution_count is None
    assert solution.cells[0].outputs and solution.cells[0].execution_count == 4


def test_an_explanation_of_the_answer_is_collapsed_in_the_lab_and_open_in_the_solution():
    tagged = new_markdown_cell("the rule", metadata={"tags": [labgen.AFTER_CHECK]})
    nb = new_notebook(cells=[tagged, new_markdown_cell("the next section")])
    lab = labgen.make_lab(nb)
    assert lab.cells[0].metadata["jupyter"] == {"source_hidden": True}
    assert lab.cells[0].source == "the rule"  # there to open once the check passes
    assert "jupyter" not in lab.cells[1].metadata and "jupyter" not in nb.cells[0].metadata


def test_generate_writes_reports_and_removes_strays(tmp_path):
    sol, labs = tmp_path / "solutions", tmp_path / "labs"
    sol.mkdir()
    nbformat.write(
        new_notebook(cells=[new_code_cell("### BEGIN SOLUTION\nx=1\n### END SOLUTION")]),
        sol / "a.ipynb",
    )
    labs.mkdir()
    (labs / "stray.ipynb").write_text("{}")
    assert labgen.generate(sol, labs, check=True) == [labs / "a.ipynb", labs / "stray.ipynb"]
    labgen.generate(sol, labs)
    assert labgen.generate(sol, labs, check=True) == []
    assert sorted(p.name for p in labs.iterdir()) == ["a.ipynb"]
    assert "raise NotImplementedError" in (labs / "a.ipynb").read_text()
    stamp = nbformat.read(labs / "a.ipynb", as_version=4).metadata["overlapkit"]
    assert stamp == {"lab": "a", "name": "a", "version": overlapkit.__version__}


def test_every_generated_lab_carries_its_identity_and_the_solutions_do_not():
    """The grader finds a lab under any file name by this stamp."""
    labs = sorted((ROOT / "labs").glob("*.ipynb"))
    assert labs
    for path in labs:
        stamp = nbformat.read(path, as_version=4).metadata.get("overlapkit")
        number = path.stem.split("_")[0]
        assert stamp == {"lab": number, "name": path.stem, "version": overlapkit.__version__}, (
            path.name
        )
        solution = nbformat.read(ROOT / "solutions" / path.name, as_version=4)
        assert "overlapkit" not in solution.metadata, path.name


def test_labs_are_what_the_generator_makes_from_solutions():
    stale = labgen.generate(ROOT / "solutions", ROOT / "labs", check=True)
    assert not stale, f"stale labs (run `make labs`): {[p.name for p in stale]}"


def test_every_solution_has_an_exercise_followed_by_a_check_cell():
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        cells = nbformat.read(path, as_version=4).cells
        exercises = [
            i
            for i, c in enumerate(cells)
            if c.cell_type == "code" and labgen.has_exercise(c.source)
        ]
        assert exercises, f"{path.name} has no exercise"
        for i in exercises:
            nxt = next(c for c in cells[i + 1 :] if c.cell_type == "code")
            assert "ok.grading.check_" in nxt.source, (
                f"{path.name}: cell {i} has no check cell after it"
            )
