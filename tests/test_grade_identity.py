"""The grader knows a submission's lab under any file name, and its check cells by meaning.

Which lab: ``lab=`` (``--lab``), else the metadata ``make labs`` stamps, else the file name.
Check cells: the lab's check call must be in some cell, compared by its parsed code.
The end-to-end tests grade a tiny lab of two single-process exercises (as test_grade.py),
made by the lab generator from a solution notebook, so its metadata is the real stamp.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

import overlapkit
from overlapkit import labgen
from overlapkit.grade import grade_notebook
from overlapkit.grade.labs import (
    _is_check_cell,
    check_calls,
    check_cell_problem,
    exercises_of,
    identify,
)
from tests.tinylab import ASSIGN, CHECK_1F1B, CHECK_BUCKETS, LAB, ONE_F_ONE_B

ROOT = Path(__file__).resolve().parents[1]


def _marked(code: str) -> str:
    """A solution cell: the function's body between the solution markers."""
    head, body = code.split("\n", 1)
    return f"{head}\n    ### BEGIN SOLUTION\n{body}\n    ### END SOLUTION"


@pytest.fixture
def labs(tmp_path):
    """A labs folder made by the generator from a two-exercise solution notebook."""
    solution = new_notebook(
        cells=[
            new_markdown_cell("# a lab"),
            new_code_cell("import overlapkit as ok"),
            new_code_cell(_marked(ONE_F_ONE_B)),
            new_code_cell(CHECK_1F1B),
            new_code_cell(_marked(ASSIGN)),
            new_code_cell(CHECK_BUCKETS),
        ]
    )
    solution.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}  # fmt: skip
    (tmp_path / "solutions").mkdir()
    nbformat.write(solution, tmp_path / "solutions" / f"{LAB}.ipynb")
    labgen.generate(tmp_path / "solutions", tmp_path / "labs")
    return tmp_path / "labs"


def _solved(labs: Path) -> nbformat.NotebookNode:
    """The lab as a student hands it in: the exercises done, everything else as generated."""
    nb = nbformat.read(labs / f"{LAB}.ipynb", as_version=4)
    for cell in nb.cells:
        for code in (ONE_F_ONE_B, ASSIGN):
            if cell.source.startswith(code.split("\n", 1)[0]):
                cell.source = code
    return nb


def _hand_in(tmp_path, nb, name) -> Path:
    folder = tmp_path / "students"
    folder.mkdir(exist_ok=True)
    nbformat.write(nb, folder / name)
    return folder / name


def _by_name(result):
    return {e["name"]: e for e in result["exercises"]}


# ------------------------------------------------------------------ graded end to end


def test_a_renamed_reformatted_notebook_with_extra_cells_and_outputs_gets_full_marks(
    tmp_path, labs
):
    nb = _solved(labs)
    assert nb.metadata["overlapkit"]["lab"] == "99"  # the generator's stamp, kept by Jupyter
    cells = [c for c in nb.cells if c.source not in (CHECK_1F1B, CHECK_BUCKETS)]
    for cell in cells:
        if cell.cell_type == "code":
            cell.execution_count = 7
            cell.outputs = [new_output("stream", name="stdout", text="left in\n")]
    first = new_code_cell(
        "# my check, black-formatted\nok.grading.check_1f1b_schedule(\n    (one_f_one_b),\n)"
    )
    first.outputs = [new_output("stream", name="stdout", text="✔ 3 stages\n")]
    second = new_code_cell(
        "%%time\nresult = ok.grading.check_assign_buckets( assign_buckets )  # keep\nresult"
    )
    nb.cells = [second, *cells, new_markdown_cell("my notes"), new_code_cell("x = 1"), first]
    result = grade_notebook(_hand_in(tmp_path, nb, "lab99 submission (1).ipynb"), labs)
    assert "error" not in result, result
    assert (result["lab"], result["lab_from"]) == (LAB, "metadata")
    assert result["score"] == result["max_score"] == 6.0, result


def test_without_metadata_the_file_name_finds_the_lab_and_a_changed_call_scores_zero(
    tmp_path, labs
):
    nb = _solved(labs)
    del nb.metadata["overlapkit"]
    for cell in nb.cells:
        if cell.source == CHECK_1F1B:
            cell.source = "ok.grading.check_1f1b_schedule(assign_buckets)"
    result = grade_notebook(_hand_in(tmp_path, nb, "Lab 99 - jsmith.ipynb"), labs)
    assert (result["lab"], result["lab_from"]) == (LAB, "file name")
    ex = _by_name(result)
    assert ex["1f1b_schedule"]["points"] == 0
    assert (
        "it calls `ok.grading.check_1f1b_schedule(assign_buckets)`, the lab's calls "
        "`ok.grading.check_1f1b_schedule(one_f_one_b)`" in ex["1f1b_schedule"]["feedback"]
    )
    assert ex["assign_buckets"]["points"] == 3.0


def test_lab_given_grades_a_notebook_neither_metadata_nor_name_identifies(tmp_path, labs):
    nb = _solved(labs)
    del nb.metadata["overlapkit"]
    path = _hand_in(tmp_path, nb, "submission.ipynb")
    result = grade_notebook(path, labs, lab="99")
    assert (result["lab"], result["lab_from"]) == (LAB, "--lab")
    assert result["score"] == result["max_score"] == 6.0, result


def test_a_notebook_nothing_identifies_is_an_error_naming_the_three_ways(tmp_path, labs):
    nb = _solved(labs)
    del nb.metadata["overlapkit"]
    result = grade_notebook(_hand_in(tmp_path, nb, "submission.ipynb"), labs)
    assert result["score"] == 0 and result["exercises"] == []
    error = result["error"]
    for part in ("no overlapkit lab metadata", "no lab number in the file name "
                 "'submission.ipynb'", "no --lab given", "lab ids in", ": 99"):  # fmt: skip
        assert part in error, error
    unknown = grade_notebook(_hand_in(tmp_path, nb, "submission.ipynb"), labs, lab="42")
    assert "--lab 42 names no lab" in unknown["error"] and "lab ids" in unknown["error"]


# ------------------------------------------------------------------ which lab, by name


@pytest.fixture
def kit_labs(tmp_path):
    """A folder with the kit's lab names (identification reads only the names)."""
    folder = tmp_path / "kit_labs"
    folder.mkdir()
    for path in sorted((ROOT / "labs").glob("*.ipynb")):
        (folder / path.name).write_text("{}")
    return folder


@pytest.mark.parametrize(
    "name, lab",
    [
        ("03_ring_allreduce.ipynb", "03_ring_allreduce"),
        ("lab03 submission (1).ipynb", "03_ring_allreduce"),
        ("03_ring_allreduce-jsmith.ipynb", "03_ring_allreduce"),
        ("Lab 3.ipynb", "03_ring_allreduce"),
        ("ring_allreduce-Copy1.ipynb", "03_ring_allreduce"),
        ("Copy of 05_async_ops (2).ipynb", "05_async_ops"),
        ("2024_jsmith_lab_11.ipynb", "11_tensor_expert_parallel"),
        ("7 - jsmith.ipynb", "07_bucketing"),
    ],
)
def test_the_file_name_finds_the_lab(kit_labs, name, lab):
    found = identify(Path(name), kit_labs)
    assert found.path == kit_labs / f"{lab}.ipynb" and found.how == "file name", found


@pytest.mark.parametrize("name", ["rank0.ipynb", "hw7.ipynb", "2024 final.ipynb"])
def test_a_number_glued_to_a_word_or_a_year_names_no_lab(kit_labs, name):
    found = identify(Path(name), kit_labs)
    assert found.path is None and "no lab number in the file name" in found.error, found


@pytest.mark.parametrize(
    "name, says",
    [
        ("jsmith 3 2.ipynb", "points at several labs (02, 03)"),
        ("lab04_ring_allreduce.ipynb", "points at several labs (03, 04)"),
        ("final.ipynb", "no lab number in the file name 'final.ipynb'"),
        ("lab 42.ipynb", "no lab number in the file name 'lab 42.ipynb'"),
    ],
)
def test_a_file_name_naming_no_lab_or_two_says_so(kit_labs, name, says):
    found = identify(Path(name), kit_labs)
    assert found.path is None and says in found.error, found.error
    assert "lab ids in" in found.error and "00, 01, 02" in found.error


def test_every_lab_of_the_kit_is_found_by_its_metadata_under_any_name():
    for path in sorted((ROOT / "labs").glob("*.ipynb")):
        meta = nbformat.read(path, as_version=4).metadata
        found = identify(Path("submission.ipynb"), ROOT / "labs", meta)
        assert (found.path, found.how, found.notes) == (path, "metadata", []), path.name


def test_lab_given_wins_over_metadata_which_wins_over_the_name_each_with_a_note(kit_labs):
    meta = {"overlapkit": {"lab": "05", "name": "05_async_ops", "version": overlapkit.__version__}}
    by_meta = identify(Path("lab03.ipynb"), kit_labs, meta)
    assert by_meta.path.stem == "05_async_ops" and by_meta.how == "metadata"
    assert by_meta.notes == [
        "graded as 05_async_ops (from the metadata); the notebook's file name says "
        "03_ring_allreduce"
    ]
    told = identify(Path("lab03.ipynb"), kit_labs, meta, lab=4)
    assert told.path.stem == "04_sharded_optimizer" and told.how == "--lab"
    assert len(told.notes) == 2 and "metadata says 05_async_ops" in told.notes[0]


def test_metadata_of_an_unknown_lab_or_another_version_is_said(kit_labs):
    alien = identify(Path("x.ipynb"), kit_labs, {"overlapkit": {"lab": "42", "name": "42_x"}})
    assert "overlapkit metadata naming lab '42_x', which is not one of these labs" in alien.error
    old = {"overlapkit": {"lab": "03", "name": "03_ring_allreduce", "version": "0.0.1"}}
    found = identify(Path("x.ipynb"), kit_labs, old)
    assert found.path.stem == "03_ring_allreduce"
    assert found.notes == [
        f"the notebook was made from the labs of overlapkit 0.0.1; graded with "
        f"{overlapkit.__version__}"
    ]


# ------------------------------------------------------------------ check cells by meaning

LAB01 = (  # lab 01's check cell, as the lab has it
    "ok.grading.check_all_reduce(\n    all_reduce_via_rs_ag, from_scratch=False, "
    'made_of=("reduce_scatter", "all_gather")\n)'
)


def _exercise():
    (ex,) = exercises_of(new_notebook(cells=[new_code_cell(LAB01)]))
    return ex


@pytest.mark.parametrize(
    "cell",
    [
        LAB01,
        "ok.grading.check_all_reduce(all_reduce_via_rs_ag, from_scratch=False, "
        "made_of=('reduce_scatter', 'all_gather'))",
        "# the check\nok.grading.check_all_reduce(\n    all_reduce_via_rs_ag,\n"
        "    from_scratch=False,\n    made_of=(\n        'reduce_scatter',\n"
        "        'all_gather',\n    ),\n)  # done",
        "ok.grading.check_all_reduce((all_reduce_via_rs_ag), made_of=('reduce_scatter', "
        "'all_gather'), from_scratch=(False))",
        "r = ok.grading.check_all_reduce(all_reduce_via_rs_ag, from_scratch=False, "
        "made_of=('reduce_scatter', 'all_gather'))\nprint(r)",
        "%%time\nok.grading.check_all_reduce(all_reduce_via_rs_ag, from_scratch=False, "
        "made_of=('reduce_scatter', 'all_gather'))",
    ],
    ids=["as-is", "one-line", "black-style", "reordered", "wrapped", "magic"],
)
def test_a_check_cell_however_formatted_is_present_and_never_run(cell):
    nb = new_notebook(cells=[new_code_cell("x = 1"), new_code_cell(cell)])
    assert check_cell_problem(_exercise(), check_calls(nb)) is None
    assert _is_check_cell(nb.cells[1]) and not _is_check_cell(nb.cells[0])


@pytest.mark.parametrize(
    "cell, says",
    [
        ("ok.grading.check_all_reduce(my_all_reduce, from_scratch=False, "
         "made_of=('reduce_scatter', 'all_gather'))", "it calls `ok.grading.check_all_reduce("
         "my_all_reduce, from_scratch=False, made_of=('reduce_scatter', 'all_gather'))`"),
        ("ok.grading.check_all_reduce(all_reduce_via_rs_ag)", "it calls `ok.grading."
         "check_all_reduce(all_reduce_via_rs_ag)`, the lab's calls `ok.grading.check_all_reduce("
         "all_reduce_via_rs_ag, from_scratch=False, made_of=('reduce_scatter', 'all_gather'))`"),
        ("ok.grading.check_bytes_moved(all_reduce_via_rs_ag)", "no cell calls check_all_reduce"),
        ("# ok.grading.check_all_reduce(all_reduce_via_rs_ag, from_scratch=False, "
         "made_of=('reduce_scatter', 'all_gather'))", "no cell calls check_all_reduce"),
    ],
    ids=["other-function", "kwargs-dropped", "other-check", "commented-out"],
)  # fmt: skip
def test_a_changed_check_call_is_named_with_the_labs(cell, says):
    nb = new_notebook(cells=[new_code_cell(cell)])
    problem = check_cell_problem(_exercise(), check_calls(nb))
    assert problem and says in problem and "was edited or deleted" in problem, problem
