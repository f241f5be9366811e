"""Did a notebook change what the grader runs? Files compared before and after its kernel.

A student's code runs as the grader's user, so it could rewrite the kit, the lab it is
graded against, a module the judge imports, or add a ``.pth`` / ``sitecustomize.py`` that
every later Python runs. Isolation inside one machine cannot forbid that (a container or
a user of its own for the kernel can); the grader can notice it, and stop: every file of
every module loaded in the grader (the judge imports the same) and the compiled copies
Python would load instead (``__pycache__``), the kit's folder, the labs and the site
folders' start-up files are compared by size, modification time, inode and change time
(``ctime``: ``os.utime`` can put an old modification time back, not the change time),
after the kernel and again before each judge. A file *added* anywhere Python imports from
(a package of the student's dropped into ``site-packages``, a torch plug-in's
``*.dist-info``, ``numpy/_distributor_init_local``: red team, session 16) changes the
folder it was added to: every folder under the import roots is compared too (walked once,
then only stat'ed). The modules the judge and its ranks load (torch's lazy start-up among
them) are loaded here first, so that their files are among those compared.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
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
        _load_what_the_judge_loads()
    files = {Path(f) for f in like if not f.endswith(os.sep)} if like is not None else set()
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
    folders = [f for f in like if f.endswith(os.sep)] if like is not None else _folders()
    found = {}
    for f in (*map(str, files), *folders):
        try:
            st = os.stat(f)
        except OSError:
            continue
        found[f] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    return found


def import_roots() -> list[str]:
    """The folders Python imports installed code from (the site folders, the standard
    library's), each ending in a separator, the outermost only."""
    roots = {*site.getsitepackages(), site.getusersitepackages(),
             sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}  # fmt: skip
    roots = sorted(os.path.join(os.path.realpath(r), "") for r in roots if r and os.path.isdir(r))
    return [r for r in roots if not any(r != o and r.startswith(o) for o in roots)]


def _folders() -> list[str]:
    """Every folder under the import roots, ending in a separator (a fingerprint's key for a
    folder): an entry added, removed or renamed in one changes its change time."""
    return [os.path.join(folder, "") for root in import_roots() for folder, _, _ in os.walk(root)]


def _load_what_the_judge_loads() -> None:
    """Import here what a judge and its ranks import (every check's module, torch's lazy
    start-up: ``overlapkit.warmup``), so that the files they load are fingerprinted."""
    import overlapkit.grading  # noqa: F401, PLC0415
    from overlapkit import warmup  # noqa: PLC0415

    warmup.warm_torch()


def changes(before: dict, after: dict) -> list[str]:
    """The files added, removed or changed between two fingerprints (in a folder that
    changed, what in it changed since: what was added there, by name)."""
    changed = [f for f in before.keys() & after.keys() if before[f] != after[f]]
    return sorted(
        [f"{f} (added)" for f in after.keys() - before.keys()]
        + [f"{f} (removed)" for f in before.keys() - after.keys()]
        + [f"{f} (changed)" for f in changed if not f.endswith(os.sep)]
        + [what for f in changed if f.endswith(os.sep) for what in _in_folder(f, before[f][2])]
    )


def _in_folder(folder: str, since_ns: int) -> list[str]:
    """A changed folder's entries changed since ``since_ns`` (its own change time then)."""
    try:
        entries = [e for e in os.scandir(folder)
                   if e.stat(follow_symlinks=False).st_ctime_ns > since_ns]  # fmt: skip
    except OSError:
        entries = []
    found = [f"{e.path} (added or changed)" for e in entries]
    return found or [f"{folder} (an entry removed or renamed)"]
