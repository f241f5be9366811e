"""Run a student's notebook in a fresh kernel, within limits, and save its exercises.

The kernel runs in a folder of its own (nothing it writes lands beside the submission or
on the judge's import path). Limits hold whatever the notebook does: a cell past its limit
is interrupted, and a kernel that does not stop within :data:`GRACE_S` of the interrupt
(a loop that catches ``KeyboardInterrupt``, a handler that ignores SIGINT) is ended with
its whole process group; the notebook's own limit is watched inside cells too. Whatever
the notebook started (ranks, servers, daemons) is ended when it is done.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import signal
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import nbformat

from ..sandbox.witness import NOTES, Witness
from .labs import _is_check_cell
from .processes import descendants, end_new_processes

MARK = "@@overlapkit-grade@@"
GRACE_S = 15.0  # after an interrupt, before the kernel's process group is killed (a loaded
# machine can take seconds to deliver it: an import in C code does not see it)
AFTER_HANG_S = 10.0  # the limit of every cell after one that had to be interrupted


def _harvest_code(names: list[str], folder: str, real_file: str) -> str:
    grading_file = str(Path(real_file).parent / "grading" / "__init__.py")
    return textwrap.dedent(f"""
        import json as _g_json, sys as _g_sys
        from overlapkit.launcher import dumps_keeping_filenames as _g_dumps
        _g_found = {{"__shown__": {{}}}}
        for _g_name in {names!r}:
            if _g_name not in globals():
                _g_found[_g_name] = "not defined"
                continue
            _g_obj = globals()[_g_name]
            try:
                with open({folder!r} + "/" + _g_name + ".pkl", "wb") as _g_f:
                    _g_f.write(_g_dumps(_g_obj))
                _g_found[_g_name] = "ok"
                _g_found["__shown__"][_g_name] = str(getattr(_g_obj, "__name__", _g_name))
            except Exception as _g_e:
                _g_found[_g_name] = f"cannot be saved ({{type(_g_e).__name__}}: {{_g_e}})"
            if not callable(_g_obj):  # data (a table, a configuration): the judge reads it as such
                try:
                    import torch as _g_torch
                    _g_torch.save(_g_obj, {folder!r} + "/" + _g_name + ".pt")
                except Exception:
                    pass
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
            total_limit: float, measures: tuple[str, ...] = ()
            ) -> tuple[dict, list[str]]:  # fmt: skip
    """Run the student's cells (in a fresh folder of their own), then save the exercise
    objects; returns (what the harvest found, notes on cells that failed or were skipped).
    ``measures``: the modules whose measurements the grader's witness takes, outside the
    kernel (the lab's checks ask what was measured); none, no witness."""
    import overlapkit  # noqa: PLC0415

    nb = nbformat.v4.new_notebook(metadata=student.metadata)
    code = [c for c in student.cells if c.cell_type == "code"]
    # what a check judges is the state at its cell: the cells after the last check cell
    # and the last cell that defines an exercise's name (measurements, pictures) cannot
    # change it, so they are not run (nor wait out a hang there)
    needed = [i for i, c in enumerate(code) if _is_check_cell(c) or _defines(c, names)]
    last = max(needed) + 1 if needed else len(code)
    nb.cells = [c for c in code[:last] if not _is_check_cell(c)]
    position = {id(c): k + 1 for k, c in enumerate(student.cells)}
    labels = [_label(position[id(c)], c) for c in nb.cells]
    harvest = nbformat.v4.new_code_cell(_harvest_code(names, folder, overlapkit.__file__))
    nb.cells.append(harvest)
    labels.append("the grader's last cell (it saves the exercises)")
    # the lab's measurements are taken by the grader's witness, outside the kernel: what
    # the judge reads as measured is what the witness saw, never notes the kernel wrote
    with Witness(measures) if measures else contextlib.nullcontext() as witness:
        env = witness.env() if witness else {}
        found, notes = _execute(nb, harvest, labels, folder, cell_limit, total_limit, env)
        if witness:
            import torch  # noqa: PLC0415

            torch.save(witness.notes(), os.path.join(folder, NOTES))
    if last < len(code) and not (notes and notes[-1].startswith("the kernel")):
        notes.append(f"{len(code) - last} code cell(s) after the last check were not run: "
                     "they cannot change what is graded")  # fmt: skip
    return found, notes


def _execute(nb, harvest, labels, folder, cell_limit, total_limit, env):
    """execute()'s kernel: the cells under their limits, then the harvest's findings."""
    from jupyter_client.manager import AsyncKernelManager  # noqa: PLC0415
    from nbclient import NotebookClient  # noqa: PLC0415

    before = descendants()
    with tempfile.TemporaryDirectory(prefix="overlapkit-kernel-") as home:
        # the kernel talks to us over Unix sockets in its own folder, not over TCP: nothing
        # else on the machine can connect to it (and ipykernel has no plain-TCP warning to
        # print); the path is absolute, as kernel and client resolve it from other folders.
        # An async manager, as nbclient's own: a blocking client's wait for a reply would
        # hold the event loop, and with it the check that notices a kernel ended
        km = AsyncKernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(home, "k"))
        # no timeout of nbclient's own: the watchdog interrupts, then ends the kernel (after
        # its first timeout nbclient stops watching whether the kernel lives, and a killed
        # kernel was noticed only when its wait for a reply ran out a second time)
        client = NotebookClient(nb, km=km, timeout=None, allow_errors=True, kernel_name="python3",
                                resources={"metadata": {"path": home}})  # fmt: skip
        try:
            with client.setup_kernel(env={**os.environ, **env}):
                try:
                    notes = _run_cells(client, nb, harvest, cell_limit, total_limit, labels)
                finally:  # while the kernel lives, what it started is still in our tree
                    end_new_processes(before, spare=_kernel_pid(client))
        finally:
            end_new_processes(before)  # and what left it, where adopt_orphans() was called
    if notes and notes[-1].startswith("the kernel"):
        return {}, notes
    text = _stream_text(harvest)
    line = next((ln for ln in text.splitlines() if ln.startswith(MARK)), None)
    try:
        found = json.loads(line[len(MARK) :]) if line else {}
    except ValueError:
        found = {}
    return (found if isinstance(found, dict) else {}), notes


def _defines(cell, names: list[str]) -> bool:
    """Whether the cell binds one of ``names`` (def, class, assignment, import)."""
    try:
        tree = ast.parse(cell.source)
    except SyntaxError:
        return any(n in cell.source for n in names)  # cannot tell: keep it
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound = [(a.asname or a.name).split(".")[0] for a in node.names]
        else:
            continue
        if set(bound) & set(names):
            return True
    return False


def _label(number: int, cell) -> str:
    """How a note names a cell: its place in the notebook and its first line."""
    first = cell.source.strip().splitlines()[0][:60] if cell.source.strip() else ""
    return f"cell {number} ({first!r})"


def _run_cells(client, nb, harvest, cell_limit: float, total_limit: float,
               labels: list[str]) -> list[str]:  # fmt: skip
    """Each cell under a watchdog; returns the notes (the last one says so if the kernel
    had to be ended: nothing can be harvested then)."""
    from nbclient.exceptions import DeadKernelError  # noqa: PLC0415

    notes, start, limit = [], time.monotonic(), cell_limit
    for i, cell in enumerate(nb.cells):
        last = cell is harvest
        left = total_limit - (time.monotonic() - start)
        if not last and left <= 0:
            notes.append(f"the notebook ran past its {total_limit:g} s limit: the cells "
                         "after that were not run")  # fmt: skip
            continue  # the harvest still runs: what was defined by then is graded
        this = limit if last else max(1.0, min(limit, left))
        began = time.monotonic()
        with _watchdog(client, this) as killed:
            try:
                client.execute_cell(cell, i)
            except DeadKernelError:
                if killed:
                    why = f"past its {this:g} s limit"
                    return [*notes, f"the kernel ignored the interrupt at {labels[i]} ({why}) "
                            "and was ended: nothing could be graded"]  # fmt: skip
                return [*notes, f"the kernel died in {labels[i]}: nothing could be graded"]
        if time.monotonic() - began >= this:
            why = "per cell" if this >= limit else "left for the notebook"
            notes.append(f"{labels[i]} ran past the {this:g} s limit {why} and was interrupted")
            limit = min(limit, AFTER_HANG_S)  # one hang is enough to wait for
            continue
        error = _errors(cell)
        if error and not last:
            notes.append(f"{labels[i]} raised {error}")
    return notes


@contextlib.contextmanager
def _watchdog(client, limit: float):
    """Interrupts the kernel when a cell runs past ``limit`` (a KeyboardInterrupt in the
    cell), and ends its process group ``GRACE_S`` later if the cell still runs (a kernel
    that ignores the interrupt would be waited for forever). Yields a list that holds True
    once it had to end the kernel."""
    killed, done = [], threading.Event()

    def watch():
        if done.wait(limit):
            return
        pid = _kernel_pid(client)
        with contextlib.suppress(ProcessLookupError, PermissionError, OSError, TypeError):
            os.kill(pid, signal.SIGINT)  # what Jupyter's interrupt does to a local kernel
        if done.wait(GRACE_S):
            return
        killed.append(True)
        _kill_kernel(client)

    thread = threading.Thread(target=watch, name="overlapkit-grade-watchdog", daemon=True)
    thread.start()
    try:
        yield killed
    finally:
        done.set()
        thread.join()


def _kill_kernel(client) -> None:
    provisioner = getattr(getattr(client, "km", None), "provisioner", None)
    pgid = getattr(provisioner, "pgid", None)
    process = getattr(provisioner, "process", None)
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        if pgid:
            os.killpg(pgid, signal.SIGKILL)
        elif process is not None:
            process.kill()


def _kernel_pid(client) -> int | None:
    process = getattr(getattr(getattr(client, "km", None), "provisioner", None), "process", None)
    return getattr(process, "pid", None)
