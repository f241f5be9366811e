"""``python -m overlapkit.grade``: the command line."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm

from . import layout, similar
from .labs import LABS
from .notebook import grade_notebook
from .output import summary, write_csv, write_gradescope
from .processes import adopt_orphans, undumpable
from .tamper import EnvironmentChanged

PROG = "python -m overlapkit.grade"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Score student notebooks made from the kit's labs. PATH is a notebook, "
        "a folder of notebooks (one student each, named by the file), a folder of "
        "per-student folders, or nbgrader's submitted/<student>/<assignment>/.",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="notebooks or folders")
    parser.add_argument(
        "--format",
        choices=["json", "gradescope", "csv"],
        default="json",
        help="json (default: stdout or --output), gradescope (results.json "
        "per submission), csv (a gradebook: student, lab, exercise, points, "
        "max_points, notebook, note; a 'total' row per student and lab)",
    )
    parser.add_argument(
        "--output",
        help="a file (json, csv; gradescope with one student: "
        "default results.json) or, for gradescope with several students, "
        "a folder: OUTPUT/<student>/results.json (default results/)",
    )
    parser.add_argument("--labs", default=str(LABS), help="folder of the original labs")
    parser.add_argument("--lab", help="grade every notebook as this lab (03 or 03_ring_allreduce)")
    parser.add_argument(
        "--student",
        help="every notebook found is this student's (one "
        "submission, e.g. Gradescope's /autograder/submission/)",
    )
    parser.add_argument(
        "--cell-timeout",
        type=float,
        default=120.0,
        help="seconds per cell (after a cell had to be interrupted: 10)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per notebook")
    parser.add_argument("--check-timeout", type=float, default=300.0, help="seconds per check")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="notebooks graded at once "
        "(default 1: timing checks need a quiet machine; more is unsafe for "
        "the timing labs on a small machine)",
    )
    parser.add_argument(
        "--similarity",
        metavar="FOLDER",
        help="grade nothing: compare the exercise code of the submissions with each other "
        "and with the kit's own code (copydetect), write FOLDER/<lab>.html and print "
        "the pairs that look copied",
    )
    parser.add_argument(
        "--reference",
        metavar="PATH",
        help="with --similarity: notebooks to compare with too (the solutions, last "
        "term's submissions)",
    )
    return parser


def _grade(sub: layout.Submission, args) -> dict:
    """One submission's result: ``student`` first, its layout notes first among notes."""
    adopt_orphans()  # in a --jobs worker too: what a notebook detaches is still ours to end
    extra = {"lab": args.lab} if args.lab else {}
    start = time.monotonic()
    result = grade_notebook(
        sub.path, Path(args.labs), args.cell_timeout, args.timeout, args.check_timeout, **extra
    )
    result = {"student": sub.student, **result, "seconds": round(time.monotonic() - start, 1)}
    if sub.notes:
        result["notes"] = sub.notes + result.get("notes", [])
    return result


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    labs = Path(args.labs)
    try:
        subs = layout.find(args.paths, labs, args.lab, args.student)
    except layout.NothingFound as exc:
        return _error(str(exc))
    if args.similarity:
        return _similarity(subs, args)
    students = sorted({s.student for s in subs})
    several = len(students) > 1
    output = Path(args.output) if args.output else None
    if args.format == "gradescope" and several and output and output.suffix == ".json":
        more = ", …" if len(students) > 5 else ""
        return _error(
            f"{len(students)} students ({', '.join(students[:5])}{more}) in"
            f" {' '.join(args.paths)}: Gradescope takes one results.json per submission, so "
            f"give --output a folder (OUTPUT/<student>/results.json), or --student NAME if "
            f"these notebooks are one submission"
        )
    undumpable()
    stopped: list[EnvironmentChanged] = []
    results = _grade_all(subs, args, stopped)
    status = _write(results, args, several, output)
    if stopped:  # every later verdict would be suspect; the ones before stand, and are written
        print(f"{PROG}: stopped after {len(results)} of {len(subs)} notebooks: {stopped[0]}",
              file=sys.stderr)  # fmt: skip
        return 3
    return status


def _similarity(subs: list[layout.Submission], args) -> int:
    """``--similarity``: export every submission's exercise code, compare it per lab, print
    the pairs that look copied; no notebook is run."""
    folder = Path(args.similarity)
    code = folder / "code"
    for ours in (code, folder / "reference"):  # a run before this one left its files here
        shutil.rmtree(ours, ignore_errors=True)
    written = similar.export(subs, Path(args.labs), code, args.lab)
    references = None
    if args.reference:
        try:
            refs = layout.find([args.reference], Path(args.labs))  # each by its own lab
        except layout.NothingFound as exc:
            return _error(str(exc))
        references = folder / "reference"
        similar.export(refs, Path(args.labs), references)
    for lab in sorted(written):
        report = folder / f"{lab}.html"
        pairs = similar.compare(code, lab, references, report)
        found = similar.lines(pairs) or [f"{lab}: no pair above {similar.THRESHOLD:.0%}"]
        print("\n".join(found))
        print(f"wrote {report} ({len(written[lab])} submissions)", file=sys.stderr)
    return 0


def _write(results: list[dict], args, several: bool, output: Path | None) -> int:
    if len(results) > 1:
        print(summary(results), file=sys.stderr)
    if args.format == "gradescope":
        default = Path("results") if several else Path("results.json")
        for path in write_gradescope(results, output or default, folder=several):
            print(f"wrote {path}", file=sys.stderr)
        return 0
    if args.format == "csv":
        buffer = io.StringIO()
        write_csv(results, buffer)
        text = buffer.getvalue()
    else:
        data = results[0] if len(results) == 1 else results
        text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    if output:
        output.write_text(text, encoding="utf-8")
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _grade_all(subs: list[layout.Submission], args, stopped: list) -> list[dict]:
    """Grade every submission (``--jobs`` at once), with a progress bar on stderr; a
    notebook that changed the grader's files ends it (``stopped`` gets why)."""
    adopt_orphans()
    bar = tqdm(
        total=len(subs), file=sys.stderr, unit="notebook", disable=len(subs) < 2, dynamic_ncols=True
    )

    def done(result: dict) -> None:
        bar.update()
        score = f"{result['score']:g} / {result['max_score']:g}"
        why = f"  (not graded: {result['error']})" if result.get("error") else ""
        bar.write(
            f"{result['student']}: {Path(result['notebook']).name}: {score}{why}", file=sys.stderr
        )

    results = []
    if args.jobs <= 1:
        for sub in subs:
            bar.set_description(f"{sub.student}: {sub.path.name}")
            if len(subs) < 2:
                print(f"grading {sub.path} …", file=sys.stderr, flush=True)
            try:
                results.append(_grade(sub, args))
            except EnvironmentChanged as exc:
                stopped.append(exc)
                break
            done(results[-1])
    else:
        bar.set_description(f"{args.jobs} at once")
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = {pool.submit(_grade, sub, args): i for i, sub in enumerate(subs)}
            by_index = {}
            for future in as_completed(futures):
                try:
                    by_index[futures[future]] = future.result()
                except EnvironmentChanged as exc:
                    stopped.append(exc)
                    for other in futures:
                        other.cancel()
                    continue
                done(by_index[futures[future]])
        results = [by_index[i] for i in sorted(by_index)]
    bar.close()
    return results
