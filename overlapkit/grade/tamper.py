"""Did a notebook change what the grader runs? Files compared before and after its kernel.

A student's code runs as the grader's user, so it could rewrite the kit, the lab it is
graded against, a module the judge imports, or add a ``.pth`` / ``sitecustomize.py`` that
every later Python runs. Isolation inside one machine cannot forbid that (a container or
a user of its own for the kernel can); the grader can notice it, and stop: every file of
every module loaded in the grader (the judge imports the same), the kit's folder, the labs
and the site folders' start-up files are compared by size and modification time.
"""

from __future__ import annotations

import site
import sys
from pathlib import Path


class EnvironmentChanged(RuntimeError):
    """The grader's own files changed while a notebook ran: later verdicts cannot be trusted."""


def fingerprint(labs: Path, like: dict | None = None) -> dict[str, tuple[int, int]]:
    """(size, mtime) of the files whose change would change a verdict: the modules loaded
    now (or, with ``like``, the same modules as that earlier fingerprint: modules the
    grader imports later are not the notebook's doing), the kit, the labs, the start-up
    files of the site folders."""
    import overlapkit  # noqa: PLC0415

    files = {Path(f) for f in like} if like is not None else set()
    if like is None:
        for module in list(sys.modules.values()):
            name = getattr(module, "__file__", None)
            if isinstance(name, str):
                files.add(Path(name))
        files.add(Path(sys.executable))
    files.update(Path(overlapkit.__file__).parent.rglob("*.py"))
    files.update(Path(labs).glob("*.ipynb"))
    for folder in {*site.getsitepackages(), site.getusersitepackages()}:
        for pattern in ("*.pth", "sitecustomize.py", "usercustomize.py"):
            files.update(Path(folder).glob(pattern))
    found = {}
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        found[str(f)] = (st.st_size, st.st_mtime_ns)
    return found


def changes(before: dict, after: dict) -> list[str]:
    """The files added, removed or changed between two fingerprints."""
    return sorted(
        [f"{f} (added)" for f in after.keys() - before.keys()]
        + [f"{f} (removed)" for f in before.keys() - after.keys()]
        + [f"{f} (changed)" for f in before.keys() & after.keys() if before[f] != after[f]]
    )
