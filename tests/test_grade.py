"""``python -m overlapkit.grade``: scores, reasons, limits, tampering, formats.

They grade the tiny lab of tests/tinylab.py (two single-process exercises, fast); the
real labs are graded by the same code.
"""

import json
import subprocess
import sys

import nbformat
from nbformat.v4 import new_code_cell

from overlapkit.grade import grade_notebook
from overlapkit.grade.output import write_gradescope
from tests.tinylab import (
    ASSIGN,
    CHECK_1F1B,
    CHECK_BUCKETS,
    ONE_F_ONE_B,
    UNFINISHED,
    notebook,
)


def _student(tmp_path, nb, name="99_grading_test.ipynb"):
    folder = tmp_path / "students"
    folder.mkdir(exist_ok=True)
    path = folder / name
    nbformat.write(nb, path)
    return path


def _by_name(result):
    return {e["name"]: e for e in result["exercises"]}


def test_one_broken_exercise_gives_partial_marks_with_its_reason(tmp_path, labs):
    broken = ONE_F_ONE_B.replace("warm = min(stages - s - 1, micro_batches)", "warm = 0")
    result = grade_notebook(_student(tmp_path, notebook(broken, ASSIGN)), labs)
    ex = _by_name(result)
    assert ex["assign_buckets"]["points"] == 3.0
    assert ex["1f1b_schedule"]["points"] < 3.0
    assert "✘ 3 stages, 4 micro-batches, stage 0" in ex["1f1b_schedule"]["feedback"]
    assert 3.0 <= result["score"] < 6.0


def test_a_hanging_cell_and_a_hanging_exercise_are_scored_within_the_limits(tmp_path, labs):
    # a hang that sleeps: the judge is ended at its limit all the same, and a spinning one
    # would take a core from the suite's other workers for the whole 45 s
    hang = (
        "def one_f_one_b(stages, micro_batches):\n    import time\n\n"
        "    while True:\n        time.sleep(1)"
    )
    nb = notebook(hang, ASSIGN, extra=["import time\ntime.sleep(600)"])
    # limits long enough for a loaded machine to import torch in the kernel and the judge
    # (2-6 s) and check the honest exercise (each of its 7 cases on a rank of its own: over
    # 20 s at load 8, twice), while the hanging one's judge is ended at its limit
    result = grade_notebook(_student(tmp_path, nb), labs, cell_limit=15, check_limit=45)
    ex = _by_name(result)
    feedback = ex["1f1b_schedule"]["feedback"]
    assert "did not finish within 45 s" in feedback, feedback
    assert ex["assign_buckets"]["points"] == 3.0  # the rest still scores
    assert any("ran past the 15 s limit per cell" in n for n in result["notes"])


def test_an_edited_check_cell_scores_zero_and_does_not_raise_the_score(tmp_path, labs):
    tampered = (CHECK_1F1B.replace("check_1f1b_schedule(one_f_one_b)", "check_1f1b_schedule(x)"),
                CHECK_BUCKETS)  # fmt: skip
    nb = notebook(UNFINISHED.format(name="one_f_one_b"), ASSIGN, checks=tampered)
    nb.cells.append(new_code_cell('print("✔ all good")'))
    ex = _by_name(grade_notebook(_student(tmp_path, nb), labs))
    assert ex["1f1b_schedule"]["points"] == 0
    assert "was edited or deleted" in ex["1f1b_schedule"]["feedback"]


def test_a_notebook_with_its_own_ok_scores_zero_with_the_reason(tmp_path, labs):
    fake = (
        "class ok:\n    class grading:\n        @staticmethod\n"
        "        def check_1f1b_schedule(f):\n            print('✔')"
    )
    nb = notebook(ONE_F_ONE_B, ASSIGN, extra=[fake])
    result = grade_notebook(_student(tmp_path, nb), labs)
    assert result["score"] == 0
    assert "binds `ok` to something else" in result["exercises"][0]["feedback"]


def test_grading_a_folder_gives_the_lab_itself_zero_a_solved_one_full_marks_and_gradescope_json(
    tmp_path, labs
):
    # each notebook takes a kernel and two judges: ~30 s on a busy machine
    (tmp_path / "students").mkdir()
    blank = tmp_path / "students" / "student0.ipynb"  # the lab as handed out, unchanged
    blank.write_text((labs / "99_grading_test.ipynb").read_text())
    _student(tmp_path, notebook(ONE_F_ONE_B, ASSIGN), "student1.ipynb")
    # the graded notebooks are named as the lab they come from
    for i in range(2):
        (labs / f"student{i}.ipynb").write_text((labs / "99_grading_test.ipynb").read_text())
    cmd = [
        sys.executable,
        "-m",
        "overlapkit.grade",
        str(tmp_path / "students"),
        "--labs",
        str(labs),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert [r["score"] for r in results] == [0.0, 6.0]
    assert all(r["max_score"] == 6.0 for r in results)
    assert "not implemented yet" in _by_name(results[0])["1f1b_schedule"]["feedback"]
    assert all(e["points"] == e["max_points"] for e in results[1]["exercises"])
    out = tmp_path / "results.json"  # the same results as one Gradescope submission
    write_gradescope(results, out, folder=False)
    data = json.loads(out.read_text())
    assert data["score"] == 6.0 and len(data["tests"]) == 4
    assert set(data["tests"][0]) == {"name", "score", "max_score", "output"}


def test_a_notebook_that_is_not_a_lab_is_reported_not_crashed(tmp_path, labs):
    path = _student(tmp_path, notebook(ONE_F_ONE_B, ASSIGN), "unknown.ipynb")
    result = grade_notebook(path, labs)
    assert "not a lab of this kit" in result["error"] and result["score"] == 0
