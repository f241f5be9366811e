"""Did a notebook change what the grader runs? Files compared before and after its kernel.

A student's code runs as the grader's user, so it could rewrite the kit, the lab it is
graded against, a module the judge imports, or add a ``.pth`` / ``sitecustomize.py`` that
every later Python runs. Isolation inside one machine cannot forbid that (a container or
a user of its own for the kernel can); the grader can notice it, and stop: every file of
every module loaded in the grader (the judge imports the same) and the compiled copies
Python would load instead (``__pycache__``), the kit's folder, the labs and the site
folders' start-up files are compared by size, modification time, inode and change time
(``ctime``: ``os.utime`` can put an old modification time back, not the change time),
after the kernel and again before each judge.
"""

from __future__ import annotations

import site
import sys
from pathlib import Path


class EnvironmentChanged(RuntimeError):
    """The grader's own files changed while a notebook ran: later verdicts cannot be trusted."""


def fingerprint(labs: Path, like: dict | None = None) -> dict[str, tuple[int, ...]]:
    """(size, mtime, ctime, inode) of the files whose change would change a verdict: the
    modules loaded now (or, with ``like``, the same modules as that earlier fingerprint: modules the
    grader imports later are not the notebook's doing), the kit, the labs, the start-up
    files of the site folders."""
    import compileall  # noqa: PLC0415

    import overlapkit  # noqa: PLC0415

    kit = Path(overlapkit.__file__).parent
    if like is None:  # every kit module compiled now: a .pyc that appears later is not ours
        compileall.compile_dir(str(kit), quiet=2)
    files = {Path(f) for f in like} if like is not None else set()
    if like is None:
        for module in list(sys.modules.values()):
            name = getattr(module, "__file__", None)
            if isinstance(name, str):
                files.add(Path(name))
        files.add(Path(sys.executable))
    # a .pyc whose header matches its .py is loaded in its place: the ones that exist, and
    # any that appears, in every folder a loaded module came from
    for folder in {f.parent for f in files if f.suffix == ".py"}:
        files.update((folder / "__pycache__").glob("*.pyc"))
    files.update(kit.rglob("*.py"))
    files.update(kit.rglob("*.pyc"))
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
        found[str(f)] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    return found


def changes(before: dict, after: dict) -> list[str]:
    """The files added, removed or changed between two fingerprints."""
    return sorted(
        [f"{f} (added)" for f in after.keys() - before.keys()]
        + [f"{f} (removed)" for f in before.keys() - after.keys()]
        + [f"{f} (changed)" for f in before.keys() & after.keys() if before[f] != after[f]]
    )
