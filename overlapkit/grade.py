"""Score student notebooks: ``python -m overlapkit.grade NOTEBOOK.ipynb|FOLDER [...]``.

For each notebook:

1. Find the lab it was made from (same file name in the kit's ``labs/``, or ``--labs``)
   and read the lab's check cells there: ``ok.grading.check_NAME(fn, ...)``. Those, not
   the student's, are what is run; a check cell the student edited or deleted gives that
   exercise 0, with the reason.
2. Execute the student's cells (without the check cells) in a fresh kernel, with a time
   limit per cell (a hanging cell is interrupted; the launcher then stops its ranks) and
   one for the whole notebook; errors do not stop the run.
3. Take each exercise's function or class out of the kernel with cloudpickle and run the
   lab's original check on it in a fresh Python process (so nothing the notebook did to
   ``ok`` or ``ok.grading`` in its kernel counts), with a time limit.
4. Score: an exercise earns its points (``ok.grading.POINTS``) times the share of the
   check's cases that passed. A notebook that binds ``ok`` or ``grading`` to something
   else than the kit gets 0 for every exercise, with that reason.

Prints JSON (one object per notebook; a list for several), or with ``--format
gradescope`` writes Gradescope's ``results.json``. Exits 0 whenever grading ran,
whatever the score.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .grading import POINTS

MARK = "@@overlapkit-grade@@"
LABS = Path(__file__).resolve().parent.parent / "labs"


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
    from .labgen import _DIRECTIVE  # noqa: PLC0415

    return "\n".join(ln for ln in source.strip().splitlines() if not _DIRECTIVE.match(ln)).strip()


def _is_check_cell(cell) -> bool:
    return cell.cell_type == "code" and bool(_check_calls(cell.source))


# --------------------------------------------------------------------------- executing


def _harvest_code(names: list[str], folder: str, real_file: str) -> str:
    grading_file = str(Path(real_file).parent / "grading" / "__init__.py")
    return textwrap.dedent(f"""
        import json as _g_json, sys as _g_sys
        import cloudpickle as _g_cp
        _g_found = {{}}
        for _g_name in {names!r}:
            if _g_name not in globals():
                _g_found[_g_name] = "not defined"
                continue
            try:
                with open({folder!r} + "/" + _g_name + ".pkl", "wb") as _g_f:
                    _g_cp.dump(globals()[_g_name], _g_f)
                _g_found[_g_name] = "ok"
            except Exception as _g_e:
                _g_found[_g_name] = f"cannot be saved ({{type(_g_e).__name__}}: {{_g_e}})"
        _g_ok = globals().get("ok")
        _g_found["__ok__"] = _g_ok is None or (getattr(_g_ok, "__file__", None) == {real_file!r})
        _g_gr = globals().get("grading")
        _g_found["__grading__"] = _g_gr is None or (
            getattr(_g_gr, "__file__", None) == {grading_file!r})
        print({MARK!r} + _g_json.dumps(_g_found))
    """)


def _stream_text(cell) -> str:
    return "".join(
        o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream"
    )


def _errors(cell) -> str | None:
    for o in cell.get("outputs", []):
        if o.get("output_type") == "error":
            return f"{o.get('ename')}: {o.get('evalue')}"[:300]
    return None


def execute(student: nbformat.NotebookNode, names: list[str], folder: str, cell_limit: float,
            total_limit: float, cwd: str) -> tuple[dict, list[str]]:  # fmt: skip
    """Run the student's cells, then save the exercise objects; returns (what the harvest
    found, notes on cells that failed or were skipped)."""
    from nbclient import NotebookClient  # noqa: PLC0415
    from nbclient.exceptions import CellTimeoutError, DeadKernelError  # noqa: PLC0415

    import overlapkit  # noqa: PLC0415

    nb = nbformat.v4.new_notebook(metadata=student.metadata)
    nb.cells = [c for c in student.cells if c.cell_type == "code" and not _is_check_cell(c)]
    harvest = nbformat.v4.new_code_cell(_harvest_code(names, folder, overlapkit.__file__))
    nb.cells.append(harvest)
    client = NotebookClient(nb, timeout=int(cell_limit), interrupt_on_timeout=True,
                            allow_errors=True, kernel_name="python3",
                            resources={"metadata": {"path": cwd}})  # fmt: skip
    notes, start = [], time.monotonic()
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            last = cell is harvest
            if not last and time.monotonic() - start > total_limit:
                notes.append(f"the notebook ran past its {total_limit:g} s limit: the cells "
                             "after that were not run")  # fmt: skip
                # the harvest still runs: what was defined by then is graded
                continue
            began = time.monotonic()
            try:
                client.execute_cell(cell, i)
            except (CellTimeoutError, DeadKernelError) as exc:
                notes.append(f"cell {i + 1}: {type(exc).__name__}")
                if isinstance(exc, DeadKernelError):
                    return {}, [*notes, "the kernel died"]
            if time.monotonic() - began >= cell_limit:
                notes.append(f"cell {i + 1} ran past the {cell_limit:g} s limit per cell and "
                             "was interrupted")  # fmt: skip
                continue
            error = _errors(cell)
            if error and not last:
                first = cell.source.strip().splitlines()[0][:60] if cell.source.strip() else ""
                notes.append(f"cell {i + 1} ({first!r}) raised {error}")
    text = _stream_text(harvest)
    line = next((ln for ln in text.splitlines() if ln.startswith(MARK)), None)
    return (json.loads(line[len(MARK) :]) if line else {}), notes


# --------------------------------------------------------------------------- checking

_RUNNER = f"""
import json, sys
import cloudpickle
import overlapkit as ok
check, folder = sys.argv[1], sys.argv[2]
names, kwargs = json.loads(sys.argv[3]), json.loads(sys.argv[4])
objs = []
for n in names:
    with open(folder + "/" + n + ".pkl", "rb") as f:
        objs.append(cloudpickle.load(f))
report = getattr(ok.grading, check)(*objs, **kwargs)
print({MARK!r} + json.dumps(report.to_dict()))
"""


def run_check(ex: Exercise, folder: str, limit: float, cwd: str) -> dict | str:
    """The lab's check on the saved objects, in a fresh process: its report, or why not."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _RUNNER, ex.check, folder, json.dumps(ex.names),
             json.dumps(ex.kwargs)],
            capture_output=True, text=True, timeout=limit, cwd=cwd,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"the check did not finish within {limit:g} s"
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith(MARK)), None)
    if line is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"the check could not run: {tail[0][:300]}"
    return json.loads(line[len(MARK) :])


# --------------------------------------------------------------------------- one notebook


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


# --------------------------------------------------------------------------- command


def gradescope(results: list[dict]) -> dict:
    """Gradescope's results.json: one test per exercise."""
    tests = []
    for r in results:
        name = Path(r["notebook"]).stem
        if r.get("error"):
            tests.append({"name": name, "score": 0, "max_score": 0, "output": r["error"]})
        for ex in r["exercises"]:
            tests.append({"name": f"{name}: {ex['name']}", "score": ex["points"],
                          "max_score": ex["max_points"], "output": ex["feedback"]})  # fmt: skip
    return {"score": round(sum(r["score"] for r in results), 4), "tests": tests}


def _notebooks(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.glob("*.ipynb") if not q.name.startswith("."))
        else:
            out.append(p)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m overlapkit.grade", description=__doc__.split("\n")[0]
    )
    parser.add_argument("paths", nargs="+", help="notebooks, or folders of notebooks")
    parser.add_argument("--format", choices=["json", "gradescope"], default="json")
    parser.add_argument("--output", help="write here instead of stdout (gradescope: results.json)")
    parser.add_argument("--labs", default=str(LABS), help="folder of the original labs")
    parser.add_argument("--cell-timeout", type=float, default=120.0, help="seconds per cell")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per notebook")
    parser.add_argument("--check-timeout", type=float, default=300.0, help="seconds per check")
    args = parser.parse_args(argv)
    notebooks = _notebooks(args.paths)
    if not notebooks:
        parser.error(f"no notebooks in {' '.join(args.paths)}")
    results = []
    for nb in notebooks:
        print(f"grading {nb} …", file=sys.stderr, flush=True)
        results.append(grade_notebook(nb, Path(args.labs), args.cell_timeout, args.timeout,
                                      args.check_timeout))  # fmt: skip
        r = results[-1]
        print(f"  {r['score']:g} / {r['max_score']:g}", file=sys.stderr, flush=True)
    if args.format == "gradescope":
        out = gradescope(results)
        path = args.output or "results.json"
        Path(path).write_text(json.dumps(out, indent=2, ensure_ascii=False))
        print(f"wrote {path}", file=sys.stderr)
        return 0
    text = json.dumps(results[0] if len(results) == 1 else results, indent=2, ensure_ascii=False)
    if args.output:
        Path(args.output).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    sys.exit(main())
