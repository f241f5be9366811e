"""Several learners on one machine: N copies of one solution notebook executed at once,
each in its own folder and kernel (``nbconvert`` standing in for each JupyterLab server),
as a shared server would run them. Prints each copy's wall time, return code and the ✔/✘
lines its checks printed, and the peak PSS of all their processes together.

    .venv/bin/python scripts/learners_at_once.py 06_layerwise_hooks 4 [/tmp/class]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def _pss(pid: int) -> int:
    """The PSS of a process and its children, in bytes (0 once it has ended)."""
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def _marks(notebook: Path) -> tuple[int, int]:
    """How many ✔ and ✘ lines the executed notebook's outputs hold."""
    if not notebook.exists():
        return 0, 0
    text = "".join(
        "".join(out.get("text", ""))
        for cell in json.loads(notebook.read_text())["cells"]
        for out in cell.get("outputs", [])
    )
    return text.count("✔"), text.count("✘")


def main(lab: str, n: int, root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    jupyter = Path(sys.executable).with_name("jupyter")
    runs = []
    for k in range(n):
        folder = root / f"learner{k}"
        folder.mkdir(parents=True)
        shutil.copy(ROOT / "solutions" / f"{lab}.ipynb", folder)
        cmd = [str(jupyter), "nbconvert", "--to", "notebook", "--execute", f"{lab}.ipynb",
               "--output", "out.ipynb", "--ExecutePreprocessor.timeout=600"]  # fmt: skip
        runs.append((time.monotonic(), subprocess.Popen(
            cmd, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))  # fmt: skip
    start, peak, loads, ended = time.monotonic(), 0, [], {}
    while len(ended) < n:
        peak = max(peak, sum(_pss(p.pid) for k, (_, p) in enumerate(runs) if k not in ended))
        loads.append(os.getloadavg()[0])
        for k, (began, proc) in enumerate(runs):
            if k not in ended and proc.poll() is not None:
                ended[k] = (time.monotonic() - began, proc.returncode)
        time.sleep(0.3)
    for k in range(n):
        wall, rc = ended[k]
        oks, fails = _marks(root / f"learner{k}" / "out.ipynb")
        print(f"learner {k}: {wall:.0f} s, exit {rc}, ✔ {oks}, ✘ {fails}")
    print(f"{n} at once: all done in {time.monotonic() - start:.0f} s; peak PSS together "
          f"{peak / 2**30:.2f} GiB; load average {min(loads):.1f}-{max(loads):.1f}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3] if len(sys.argv) > 3 else "/tmp/class"))
