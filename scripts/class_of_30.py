"""A mock class of 30 lab-01 notebooks, graded as an instructor would, each score compared
with the one it deserves: 10 correct (renamed, reformatted, extra cells), 10 with a
typical bug, 5 that hang, 5 that cheat.

    .venv/bin/python scripts/class_of_30.py /tmp/class30        # build, grade, compare
    .venv/bin/python scripts/class_of_30.py /tmp/class30 --build-only

Grading runs ``python -m overlapkit.grade <folder>/submitted --output results.json`` (the
nbgrader layout: one folder per student) and prints, per student, the points of each
exercise against what was expected and the seconds its notebook took; exit 1 when any
differs. Lab 01 has two exercises:
``all_reduce`` (4 points) and ``bytes_moved`` (2 points).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
LAB = ROOT / "labs" / "01_collective_patterns.ipynb"
AR, BM = "all_reduce", "bytes_moved"  # the exercises, as the gradebook names them
FULL = {AR: 4.0, BM: 2.0}

RIGHT_AR = """def all_reduce_via_rs_ag(tensor):
    world = dist.get_world_size()
    n = tensor.numel()
    chunk = -(-n // world)
    padded = torch.zeros(chunk * world, dtype=tensor.dtype)
    padded[:n] = tensor.reshape(-1)
    mine = torch.empty(chunk, dtype=tensor.dtype)
    ok.builtin.reduce_scatter_tensor(mine, padded)
    ok.builtin.all_gather_tensor(padded, mine)
    tensor.copy_(padded[:n].view_as(tensor))"""
RIGHT_BM = """def bytes_moved(collective, nbytes, world):
    one_pass = (world - 1) / world * nbytes
    return 2 * one_pass if collective == "all_reduce" else one_pass"""
# a second honest style: math.ceil, F.pad, a list-based AllGather
OTHER_AR = """import math
import torch.nn.functional as F

def all_reduce_via_rs_ag(tensor):
    world = dist.get_world_size()
    flat = tensor.reshape(-1)
    size = math.ceil(flat.numel() / world)
    padded = F.pad(flat, (0, size * world - flat.numel()))
    part = torch.empty(size, dtype=tensor.dtype)
    ok.builtin.reduce_scatter_tensor(part, padded)
    whole = torch.empty_like(padded)
    ok.builtin.all_gather_tensor(whole, part)
    tensor.copy_(whole[: flat.numel()].reshape(tensor.shape))"""
OTHER_BM = """def bytes_moved(collective, nbytes, world):
    factor = {"all_reduce": 2}.get(collective, 1)
    return factor * nbytes * (world - 1) / world"""

LAB_FILE = "01_collective_patterns.ipynb"


def case(student, ar=RIGHT_AR, bm=RIGHT_BM, want="full/full", file=LAB_FILE, extra=()):
    """One student: the two exercises' code, the score each deserves ("full", "zero", or
    "less": below full, partial credit allowed), the file name, cells of their own."""
    return student, file, ar, bm, list(extra), *want.split("/")


def bug_ar(old, new):
    return RIGHT_AR.replace(old, new)


def bug_bm(old, new):
    return RIGHT_BM.replace(old, new)


CORRECT = [  # renamed, reformatted, cells added or moved, another style
    case("c01"),
    case("c02", file="lab01 submission (1).ipynb"),
    case("c03", OTHER_AR, OTHER_BM, file="homework.ipynb"),
    case("c04", OTHER_AR, file="Copy of 01_collective_patterns.ipynb", extra=["print(1)"]),
    case("c05", bm=OTHER_BM, file="01.ipynb", extra=["x = 1", "# scratch"]),
    case("c06", file="alice-lab01.ipynb", extra=["REFORMAT"]),
    case("c07", OTHER_AR, OTHER_BM, file="lab_01_final.ipynb", extra=["REFORMAT"]),
    case("c08", file="submission.ipynb", extra=["MOVED"]),
    case("c09", OTHER_AR, file="01_collective_patterns (2).ipynb"),
    case("c10", bm=OTHER_BM, file="mylab.ipynb", extra=["import time\ntime.sleep(1)"]),
]
BUGS = [  # the typical mistakes, one exercise wrong, the other right
    case("b01", bug_ar("-(-n // world)", "n // world"), want="less/full"),  # no padding
    case(
        "b02",
        bug_ar("    tensor.copy_(padded[:n].view_as(tensor))", "    return padded[:n]"),
        want="zero/full",
    ),  # returns the result, the tensor unchanged
    case(
        "b03", "def all_reduce_via_rs_ag(tensor):\n    dist.all_reduce(tensor)", want="zero/full"
    ),  # the built-in
    case(
        "b04", bug_ar("    ok.builtin.all_gather_tensor(padded, mine)\n", ""), want="zero/full"
    ),  # no AllGather
    case(
        "b05", bug_ar("= tensor.reshape(-1)", "= tensor.reshape(-1) / world"), want="zero/full"
    ),  # averaged, not summed
    case("b06", bm=bug_bm("(world - 1) / world", "(world - 1)"), want="full/less"),  # no / N
    case("b07", bm=bug_bm("2 * one_pass", "one_pass"), want="full/less"),  # one pass only
    case("b08", bm=bug_bm("* nbytes", "* nbytes * 8"), want="full/less"),  # bits
    case("b09", bm=bug_bm("(world - 1) / world", "world / (world - 1)"), want="full/zero"),
    case(
        "b10", bug_ar("chunk * world, dtype", "chunk * world + 1, dtype"), want="zero/full"
    ),  # off by one
]
HANGS = [
    case(
        "h01", "def all_reduce_via_rs_ag(tensor):\n    while True:\n        pass", want="zero/full"
    ),
    case(
        "h02",
        bug_ar(
            "    ok.builtin.all_gather_tensor(padded, mine)",
            "    if dist.get_rank() == 0:\n        ok.builtin.all_gather_tensor(padded, mine)",
        ),
        want="zero/full",
    ),  # one rank skips a collective
    case(
        "h03",
        bm="def bytes_moved(collective, nbytes, world):\n    import time\n    time.sleep(10**6)",
        want="full/zero",
    ),
    case(
        "h04",
        "def all_reduce_via_rs_ag(tensor):\n    while True:\n        try:\n"
        "            time.sleep(1)\n        except BaseException:\n            pass",
        want="zero/full",
        extra=["import time"],
    ),  # ignores interrupts
    case(
        "h05",
        want="zero/zero",
        extra=[
            "import signal, time\nsignal.signal(signal.SIGINT, "
            "signal.SIG_IGN)\nwhile True:\n    time.sleep(1)"
        ],
    ),  # before the checks: ended
]
FORGED = '{"score": 1.0, "cases": []}'
CHEATS = [
    case(
        "x01",
        bm="def bytes_moved(collective, nbytes, world):\n"
        f"    print('@@overlapkit-grade@@{FORGED}')\n    return 0.0",
        want="full/less",
    ),  # a forged verdict: only what "return 0.0" earns (1 rank, nothing moves)
    case(
        "x02",
        bm="def bytes_moved(collective, nbytes, world):\n"
        "    from overlapkit import costmodel\n"
        "    return costmodel.bytes_moved_per_rank(collective, nbytes, world)",
        want="full/zero",
    ),  # the kit's answer under the exercise's name
    case(
        "x03",
        extra=[
            "import pathlib\nfor n in ('cloudpickle.py', 'json.py'):\n"
            f"    pathlib.Path(n).write_text({FORGED!r})"
        ],
    ),  # hijacked modules: no more
    case(
        "x04",
        "def all_reduce_via_rs_ag(tensor):\n    pass",
        want="zero/full",
        extra=["CHANGED_CHECK"],
    ),  # the check cell edited
    case(
        "x05",
        "def all_reduce_via_rs_ag(tensor):\n    pass",
        want="zero/full",
        extra=[
            "from overlapkit.grading.report import Report\n"
            "def _pass(*a, **k):\n    r = Report('x')\n    r.ok('fine')\n    return r\n"
            "ok.grading.check_all_reduce = _pass"
        ],
    ),  # the check replaced
]
CLASS = CORRECT + BUGS + HANGS + CHEATS


def _notebook(ar: str, bm: str, extra: list[str]) -> nbformat.NotebookNode:
    nb = nbformat.read(LAB, as_version=4)
    for cell in nb.cells:
        if "def all_reduce_via_rs_ag" in cell.source:
            cell.source = ar
        elif "def bytes_moved" in cell.source:
            cell.source = bm
    checks = [c for c in nb.cells if c.source.lstrip().startswith("ok.grading.check_")]
    for e in extra:
        if e == "REFORMAT":  # a formatter's output and a comment: same parsed code
            for c in checks:
                c.source = "# my check\n" + " ".join(c.source.split()).replace("( ", "(")
        elif e == "MOVED":  # a markdown cell and an empty one added between
            nb.cells.insert(2, nbformat.v4.new_markdown_cell("My notes"))
            nb.cells.insert(5, nbformat.v4.new_code_cell(""))
        elif e == "CHANGED_CHECK":
            checks[0].source = "ok.grading.check_all_reduce(all_reduce_via_rs_ag, world_sizes=(1,))"
        else:  # a cell of the student's, right after the imports
            nb.cells.insert(2, nbformat.v4.new_code_cell(e))
    return nb


def build(folder: Path) -> None:
    for student, name, ar, bm, extra, *_ in CLASS:
        where = folder / "submitted" / student / "lab01"
        where.mkdir(parents=True, exist_ok=True)
        nbformat.write(_notebook(ar, bm, extra), where / name)


def grade(folder: Path, jobs: int) -> int:
    start = time.monotonic()
    out = folder / "results.json"
    proc = subprocess.run([sys.executable, "-m", "overlapkit.grade", str(folder / "submitted"),
                           "--output", str(out), "--jobs", str(jobs)], text=True)  # fmt: skip
    took = time.monotonic() - start
    got: dict = {}
    seconds: dict = {}
    for result in json.loads(out.read_text()):
        seconds[result["student"]] = result.get("seconds", float("nan"))
        for ex in result["exercises"]:
            got.setdefault(result["student"], {})[ex["name"]] = float(ex["points"])
    wrong = 0
    print(f"\n{'student':8} {'expected':>16} {'got':>16} {'seconds':>8}  verdict")
    for student, *_, want_ar, want_bm in CLASS:
        mine = got.get(student, {})
        verdicts = []
        for ex, want in ((AR, want_ar), (BM, want_bm)):
            pts = mine.get(ex)
            fits = pts is not None and (
                pts == FULL[ex] if want == "full" else pts == 0 if want == "zero"
                else pts < FULL[ex])  # fmt: skip
            verdicts.append(fits)
        shown = "/".join(f"{mine.get(ex, float('nan')):g}" for ex in (AR, BM))
        ok = all(verdicts)
        wrong += not ok
        print(
            f"{student:8} {want_ar + '/' + want_bm:>16} {shown:>16} "
            f"{seconds.get(student, float('nan')):8.0f}  {'ok' if ok else 'WRONG'}"
        )
    print(f"\n{len(CLASS) - wrong} of {len(CLASS)} scored as expected; grading took {took:.0f} s "
          f"(exit {proc.returncode})")  # fmt: skip
    return 1 if wrong else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args()
    build(args.folder)
    return 0 if args.build_only else grade(args.folder, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
