"""``python -m overlapkit.grade``: the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .labs import LABS
from .layout import _notebooks
from .notebook import grade_notebook
from .output import gradescope


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m overlapkit.grade",
        description="Score student notebooks made from the kit's labs.",
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
