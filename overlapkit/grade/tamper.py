"""Did a notebook change what the grader runs? Files compared before and after its kernel.

A student's code runs as the grader's user, so it could rewrite the kit, the lab it is
graded against, a module the judge imports, or add a ``.pth`` / ``sitecustomize.py`` that
every later Python runs. Isolation inside one machine cannot forbid that (a container or
a user of its own for the kernel can); the grader can notice it, and stop. Compared by
size, modification time, change time and inode (``ctime``: ``os.utime`` can put an old
modification time back, not the change time), after the kernel and again before each
judge:

* every file and folder under the folders Python imports installed code from (the site
  folders, the standard library): a file edited in place, one of a module only the judge
  or its ranks load among them (a ``.pyc`` of ``torch.load``'s
  rewritten, header kept), and a package added (a folder's change time changes when an
  entry is added: a torch plug-in's ``*.dist-info``, ``numpy/_distributor_init_local``);
* the interpreter: its executable, ``pyvenv.cfg`` (its ``home`` chooses the standard
  library every later Python runs), each ``sys.path`` entry, there
  or not (``python311.zip`` is looked for first), and the folder holding it;
* every module loaded here (the judge's and its ranks' modules are loaded first: every
  check, torch's lazy start-up), with its folder and ``__pycache__``; the kit; the labs.

A fingerprint of ~90,000 files takes ~0.3 s of one core (0.4 s more for the first, which
walks the folders); only the first looks for files, the later ones stat the same names
(what is added shows in its folder).
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
from pathlib import Path

#: the fingerprint of a path that is not there (yet)
ABSENT = (-1, -1, -1, -1)


class EnvironmentChanged(RuntimeError):
    """The grader's own files changed while a notebook ran: later verdicts cannot be trusted."""


def fingerprint(labs: Path, like: dict | None = None) -> dict[str, tuple[int, ...]]:
    """(size, mtime, ctime, inode) of each path whose change would change a verdict (see
    the module's docstring); a folder's key ends in a separator. With ``like``, the same
    paths as that earlier fingerprint."""
    if like is not None:
        return {path: _stat(path) for path in like}
    import compileall  # noqa: PLC0415

    import overlapkit  # noqa: PLC0415

    kit = os.path.dirname(os.path.realpath(overlapkit.__file__))
    compileall.compile_dir(kit, quiet=2)  # a .pyc that appears later is not ours
    _load_what_the_judge_loads()
    paths = set(_interpreter())
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        if isinstance(name, str) and os.path.isabs(name):  # (not torch.ops' "_ops.py")
            folder = os.path.dirname(name)
            paths.update((name, _folder(folder), _folder(os.path.join(folder, "__pycache__"))))
    for root in (kit, *import_roots()):
        paths.update(_tree(root))
    # the labs' notebooks (not their folder: lab 10's traces are written beside them)
    paths.update(str(p) for p in Path(labs).glob("*.ipynb"))
    return {path: _stat(path) for path in paths}


def import_roots() -> list[str]:
    """The folders Python imports installed code from (the site folders, the standard
    library's), each ending in a separator, the outermost only."""
    roots = {*site.getsitepackages(), site.getusersitepackages(),
             sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}  # fmt: skip
    roots = sorted(_folder(os.path.realpath(r)) for r in roots if r and os.path.isdir(r))
    return [r for r in roots if not any(r != o and r.startswith(o) for o in roots)]


def _interpreter() -> list[str]:
    """What chooses the code a Python started later runs, present or not."""
    found = [sys.executable, os.path.realpath(sys.executable),
             os.path.join(sys.prefix, "pyvenv.cfg"), site.getusersitepackages()]  # fmt: skip
    # the judge's sys.path (``python -I``): the interpreter's own entries, not the folder
    # the grader was started from (nor /tmp above it, where every process writes)
    bases = (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)
    prefixes = tuple({_folder(os.path.realpath(p)) for p in bases})
    for entry in (os.path.realpath(p) for p in sys.path if p):
        if not entry.startswith(prefixes):
            continue
        found += [
            _folder(entry) if os.path.isdir(entry) else entry,
            _folder(os.path.dirname(entry)),
        ]
    return found


def _tree(root: str) -> list[str]:
    """Every folder (ending in a separator) and file under ``root``."""
    found = []
    for folder, _, files in os.walk(root):
        found.append(_folder(folder))
        found.extend(os.path.join(folder, f) for f in files)
    return found


def _folder(path: str) -> str:
    return os.path.join(path, "")


def _stat(path: str) -> tuple[int, ...]:
    try:
        st = os.stat(path)
    except OSError:
        return ABSENT
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def _load_what_the_judge_loads() -> None:
    """Import here what a judge and its ranks import (every check's module, torch's lazy
    start-up: ``overlapkit.warmup``), so that their modules' folders are fingerprinted."""
    import overlapkit.grading  # noqa: F401, PLC0415
    from overlapkit import warmup  # noqa: PLC0415

    warmup.warm_torch()


def changes(before: dict, after: dict) -> list[str]:
    """The paths added, removed or changed between two fingerprints (in a folder that
    changed, what in it changed since: what was added there, by name)."""
    found = [f"{f} (added)" for f in after.keys() - before.keys()]
    found += [f"{f} (removed)" for f in before.keys() - after.keys()]
    for f in before.keys() & after.keys():
        was, now = before[f], after[f]
        if was == now:
            continue
        if was == ABSENT:
            found.append(f"{f} (added)")
        elif now == ABSENT:
            found.append(f"{f} (removed)")
        elif f.endswith(os.sep):
            found += _in_folder(f, was[2])
        else:
            found.append(f"{f} (changed)")
    return sorted(set(found))


def _in_folder(folder: str, since_ns: int) -> list[str]:
    """A changed folder's entries changed since ``since_ns`` (its own change time then)."""
    try:
        entries = [e for e in os.scandir(folder)
                   if e.stat(follow_symlinks=False).st_ctime_ns > since_ns]  # fmt: skip
    except OSError:
        entries = []
    found = [f"{e.path} (added or changed)" for e in entries]
    return found or [f"{folder} (an entry removed or renamed)"]
