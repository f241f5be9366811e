"""Run a lab's original check on a student's saved exercise, in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys

from .kernel import MARK
from .labs import Exercise

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
