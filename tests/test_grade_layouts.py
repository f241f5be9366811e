"""``python -m overlapkit.grade`` on a class: course layouts, one result per student and lab,
Gradescope's results.json per submission, a CSV gradebook, the summary of a class.

Layouts are found without running a notebook; the outputs are checked on made-up results
(the grading itself is tests/test_grade.py's); one test grades two real notebooks of the
tiny lab of tests/tinylab.py end to end.
"""

import csv
import io
import json
import multiprocessing
import os
import subprocess
import sys

import nbformat
import pytest

from overlapkit.grade import cli, layout
from tests.tinylab import ASSIGN, LAB, ONE_F_ONE_B, UNFINISHED, notebook


def _write(path, solved=True, mtime=None):
    """A student's notebook of the tiny lab (stamped with the lab's identity, as `make
    labs` stamps them), solved or not."""
    first = ONE_F_ONE_B if solved else UNFINISHED.format(name="one_f_one_b")
    nb = notebook(first, ASSIGN)
    nb.metadata["overlapkit"] = {"lab": "99", "name": LAB}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def _found(paths, labs, **kw):
    return [
        (s.student, s.path.name, s.layout) for s in layout.find(list(map(str, paths)), labs, **kw)
    ]


# --------------------------------------------------------------------------- layouts


def test_a_folder_per_student_gives_each_notebook_its_folders_name(tmp_path, labs):
    for student in ("alice", "bob"):
        _write(tmp_path / "submissions" / student / f"{LAB}.ipynb")
    found = _found([tmp_path / "submissions"], labs)
    assert found == [
        ("alice", f"{LAB}.ipynb", "per-student"),
        ("bob", f"{LAB}.ipynb", "per-student"),
    ]


def test_nbgraders_submitted_layout_is_read_from_the_course_folder(tmp_path, labs):
    course = tmp_path / "course"
    _write(course / "submitted" / "alice" / "ps1" / f"{LAB}.ipynb")
    _write(course / "submitted" / "bob" / "ps1" / f"{LAB}.ipynb")
    _write(course / "source" / "ps1" / f"{LAB}.ipynb")  # the instructor's: not a student's
    expected = [("alice", f"{LAB}.ipynb", "nbgrader"), ("bob", f"{LAB}.ipynb", "nbgrader")]
    assert _found([course], labs) == expected
    assert _found([course / "submitted"], labs) == expected


def test_a_flat_folder_names_students_by_file_and_lab_named_files_by_folder(tmp_path, labs):
    flat = tmp_path / "week3"
    _write(flat / "alice.ipynb")
    _write(flat / "bob.ipynb")
    assert _found([flat], labs) == [("alice", "alice.ipynb", "flat"), ("bob", "bob.ipynb", "flat")]
    # a notebook named as the lab names no student: it is its folder's (Gradescope's case)
    one = _write(tmp_path / "submission" / f"{LAB} (1).ipynb")
    assert _found([one.parent], labs) == [("submission", one.name, "flat")]
    assert _found([one], labs) == [("submission", one.name, "file")]
    assert _found([one], labs, student="s42") == [("s42", one.name, "file")]


def test_checkpoints_and_hidden_files_are_skipped(tmp_path, labs):
    sub = tmp_path / "submissions"
    _write(sub / "alice" / f"{LAB}.ipynb")
    _write(sub / "alice" / ".ipynb_checkpoints" / f"{LAB}-checkpoint.ipynb")
    _write(sub / "alice" / f".~{LAB}.ipynb")
    _write(sub / ".hidden" / f"{LAB}.ipynb")
    _write(sub / "__MACOSX" / "alice" / f"{LAB}.ipynb")
    assert _found([sub], labs) == [("alice", f"{LAB}.ipynb", "per-student")]


def test_two_notebooks_of_one_lab_grade_the_newest_and_say_so(tmp_path, labs):
    old = _write(tmp_path / "s" / "alice" / f"{LAB}.ipynb", mtime=1_700_000_000)
    new = _write(tmp_path / "s" / "alice" / f"{LAB} (1).ipynb", mtime=1_700_000_500)
    _write(tmp_path / "s" / "bob" / f"{LAB}.ipynb")
    subs = layout.find([str(tmp_path / "s")], labs)
    assert [(s.student, s.path) for s in subs] == [("alice", new), ("bob", subs[1].path)]
    (note,) = subs[0].notes
    assert "alice handed in 2 notebooks" in note and f"graded the newest, {new}" in note
    assert str(old) in note and not subs[1].notes


def test_nothing_found_exits_2_naming_the_path(tmp_path, labs, capsys):
    empty = tmp_path / "empty"
    (empty / "alice" / ".ipynb_checkpoints").mkdir(parents=True)
    _write(empty / "alice" / ".ipynb_checkpoints" / f"{LAB}-checkpoint.ipynb")
    assert cli.main([str(empty), "--labs", str(labs)]) == 2
    assert f"no notebooks in {empty}" in capsys.readouterr().err
    assert cli.main([str(tmp_path / "nope"), "--labs", str(labs)]) == 2
    assert f"{tmp_path / 'nope'}: no such file or folder" in capsys.readouterr().err


# --------------------------------------------------------------------------- outputs


@pytest.fixture
def fake_grading(monkeypatch):
    """grade_notebook replaced by made-up results: a notebook whose path holds "bad" fails
    one case of the 1F1B exercise; every call is recorded."""
    calls = []

    def grade(path, labs, cell_limit, total_limit, check_limit, **kw):
        calls.append((path, kw))
        bad = "bad" in str(path)
        fb = "✔ 2 stages\n✘ 3 stages, 4 micro-batches, stage 0: F1 before B0" if bad else "✔ all"
        exercises = [
            {
                "name": "1f1b_schedule",
                "points": 1.5 if bad else 3.0,
                "max_points": 3.0,
                "feedback": fb,
            },
            {"name": "assign_buckets", "points": 3.0, "max_points": 3.0, "feedback": "✔ all"},
        ]
        score = sum(e["points"] for e in exercises)
        return {
            "notebook": str(path),
            "score": score,
            "max_score": 6.0,
            "exercises": exercises,
            "lab": LAB,
        }

    monkeypatch.setattr(cli, "grade_notebook", grade)
    return calls


def _class(tmp_path, students=("alice", "bad_bob", "carol")):
    for student in students:
        _write(tmp_path / "submissions" / student / f"{LAB}.ipynb")
    return tmp_path / "submissions"


# the keys https://gradescope-autograders.readthedocs.io/en/latest/specs/ documents
GRADESCOPE_TOP = {"score", "execution_time", "output", "output_format", "test_output_format",
                  "test_name_format", "visibility", "stdout_visibility", "extra_data", "tests",
                  "leaderboard"}  # fmt: skip
GRADESCOPE_TEST = {"score", "max_score", "status", "name", "name_format", "number", "output",
                   "output_format", "tags", "visibility", "extra_data"}  # fmt: skip


def _assert_gradescope(data):
    """Gradescope's documented results.json (only documented keys, scores that add up)."""
    assert set(data) <= GRADESCOPE_TOP and {"score", "tests"} <= set(data)
    for test in data["tests"]:
        assert set(test) <= GRADESCOPE_TEST and {"name", "score", "max_score"} <= set(test)
        assert isinstance(test["name"], str) and isinstance(test["output"], str)
        assert isinstance(test["score"], float) and isinstance(test["max_score"], float)
    assert data["score"] == sum(t["score"] for t in data["tests"])
    assert isinstance(data["execution_time"], int)


def test_gradescope_writes_one_results_json_per_student(tmp_path, labs, fake_grading):
    out = tmp_path / "gradescope"
    argv = [
        str(_class(tmp_path)),
        "--labs",
        str(labs),
        "--format",
        "gradescope",
        "--output",
        str(out),
    ]
    assert cli.main(argv) == 0
    assert sorted(p.parent.name for p in out.glob("*/results.json")) == [
        "alice",
        "bad_bob",
        "carol",
    ]
    for student in ("alice", "bad_bob", "carol"):
        data = json.loads((out / student / "results.json").read_text())
        _assert_gradescope(data)
        assert [t["name"] for t in data["tests"]] == ["1f1b_schedule", "assign_buckets"]
    bob = json.loads((out / "bad_bob" / "results.json").read_text())
    assert bob["score"] == 4.5 and bob["tests"][0]["score"] == 1.5
    assert "✘ 3 stages" in bob["tests"][0]["output"]
    # several students into one file would merge submissions: refused, with the way out
    argv[-1] = str(tmp_path / "results.json")
    assert cli.main(argv) == 2 and not (tmp_path / "results.json").exists()


def test_gradescope_one_submission_writes_one_results_json(tmp_path, labs, fake_grading):
    nb = _write(tmp_path / "submission" / f"{LAB}.ipynb")
    out = tmp_path / "results" / "results.json"
    assert (
        cli.main(
            [str(nb.parent), "--labs", str(labs), "--format", "gradescope", "--output", str(out)]
        )
        == 0
    )
    data = json.loads(out.read_text())
    _assert_gradescope(data)
    assert data["score"] == 6.0 and len(data["tests"]) == 2


def test_csv_gradebook_has_a_row_per_exercise_and_a_total_per_student_and_lab(
    tmp_path, labs, fake_grading, capsys
):
    assert cli.main([str(_class(tmp_path)), "--labs", str(labs), "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert list(rows[0]) == [
        "student",
        "lab",
        "exercise",
        "points",
        "max_points",
        "notebook",
        "note",
    ]
    assert [(r["student"], r["exercise"], r["points"]) for r in rows] == [
        ("alice", "1f1b_schedule", "3.0"),
        ("alice", "assign_buckets", "3.0"),
        ("alice", "total", "6.0"),
        ("bad_bob", "1f1b_schedule", "1.5"),
        ("bad_bob", "assign_buckets", "3.0"),
        ("bad_bob", "total", "4.5"),
        ("carol", "1f1b_schedule", "3.0"),
        ("carol", "assign_buckets", "3.0"),
        ("carol", "total", "6.0"),
    ]
    assert {r["lab"] for r in rows} == {LAB} and rows[5]["max_points"] == "6.0"
    assert rows[3]["note"] == "✘ 3 stages, 4 micro-batches, stage 0: F1 before B0"


def test_a_class_ends_with_a_summary_and_every_result_names_its_student(
    tmp_path, labs, fake_grading, capsys
):
    assert cli.main([str(_class(tmp_path)), "--labs", str(labs), "--lab", "99"]) == 0
    out, err = capsys.readouterr()
    results = json.loads(out)
    assert [r["student"] for r in results] == ["alice", "bad_bob", "carol"]
    assert all(kw == {"lab": "99"} for _, kw in fake_grading)  # --lab reaches the grader
    summary = err[err.index("summary:") :].splitlines()
    assert summary[0] == "summary: 3 notebooks, 3 students"
    assert summary[1].split()[:7] == ["lab", "exercise", "n", "mean", "min", "max", "of"]
    row = next(ln for ln in summary if "1f1b_schedule" in ln)
    assert row.split()[:7] == [LAB, "1f1b_schedule", "3", "2.50", "1.5", "3", "3"]
    assert row.endswith("(1/3) ✘ 3 stages, 4 micro-batches, stage 0: F1 before B0")
    assert "bad_bob: " in err  # a line per notebook as it is graded


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_grading_nbgraders_layout_end_to_end_into_a_gradebook(tmp_path, labs):
    course = tmp_path / "course"
    _write(course / "submitted" / "alice" / "ps1" / "anything.ipynb")  # known by its metadata
    _write(course / "submitted" / "bob" / "ps1" / f"{LAB}.ipynb", solved=False)
    out = tmp_path / "grades.csv"
    cmd = [sys.executable, "-m", "overlapkit.grade", str(course), "--labs", str(labs)]
    done = subprocess.run([*cmd, "--format", "csv", "--output", str(out)], capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr
    totals = {
        r["student"]: r["points"] for r in csv.DictReader(out.open()) if r["exercise"] == "total"
    }
    assert totals == {"alice": "6.0", "bob": "3.0"}
    assert "summary: 2 notebooks, 2 students" in done.stderr


def test_jobs_grade_several_notebooks_at_once_and_keep_the_order(
    tmp_path, labs, fake_grading, capsys
):
    if multiprocessing.get_start_method() != "fork":
        pytest.skip("the made-up grader reaches the workers only when they are forked")
    students = ("alice", "bad_bob", "carol", "dan")
    assert cli.main([str(_class(tmp_path, students)), "--labs", str(labs), "--jobs", "2"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [(r["student"], r["score"]) for r in results] == [
        ("alice", 6.0),
        ("bad_bob", 4.5),
        ("carol", 6.0),
        ("dan", 6.0),
    ]
