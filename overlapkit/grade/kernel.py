"""Run a student's notebook in a fresh kernel, within limits, and save its exercises."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import nbformat

from .labs import _is_check_cell

MARK = "@@overlapkit-grade@@"


def _harvest_code(names: list[str], folder: str, real_file: str) -> str:
    grading_file = str(Path(real_file).parent / "grading" / "__init__.py")
    return textwrap.dedent(f"""
        import json as _g_json, sys as _g_sys
        import cloudpickle as _g_cp
        _g_found = {{}}
        for _g_name in {names!r}:
            if _g_name not in globals():
                _g_found[_g_name] = "not defined"
                continue
            try:
                with open({folder!r} + "/" + _g_name + ".pkl", "wb") as _g_f:
                    _g_cp.dump(globals()[_g_name], _g_f)
                _g_found[_g_name] = "ok"
            except Exception as _g_e:
                _g_found[_g_name] = f"cannot be saved ({{type(_g_e).__name__}}: {{_g_e}})"
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
            total_limit: float, cwd: str) -> tuple[dict, list[str]]:  # fmt: skip
    """Run the student's cells, then save the exercise objects; returns (what the harvest
    found, notes on cells that failed or were skipped)."""
    from nbclient import NotebookClient  # noqa: PLC0415
    from nbclient.exceptions import CellTimeoutError, DeadKernelError  # noqa: PLC0415

    import overlapkit  # noqa: PLC0415

    nb = nbformat.v4.new_notebook(metadata=student.metadata)
    nb.cells = [c for c in student.cells if c.cell_type == "code" and not _is_check_cell(c)]
    harvest = nbformat.v4.new_code_cell(_harvest_code(names, folder, overlapkit.__file__))
    nb.cells.append(harvest)
    client = NotebookClient(nb, timeout=int(cell_limit), interrupt_on_timeout=True,
                            allow_errors=True, kernel_name="python3",
                            resources={"metadata": {"path": cwd}})  # fmt: skip
    notes, start = [], time.monotonic()
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            last = cell is harvest
            if not last and time.monotonic() - start > total_limit:
                notes.append(f"the notebook ran past its {total_limit:g} s limit: the cells "
                             "after that were not run")  # fmt: skip
                # the harvest still runs: what was defined by then is graded
                continue
            began = time.monotonic()
            try:
                client.execute_cell(cell, i)
            except (CellTimeoutError, DeadKernelError) as exc:
                notes.append(f"cell {i + 1}: {type(exc).__name__}")
                if isinstance(exc, DeadKernelError):
                    return {}, [*notes, "the kernel died"]
            if time.monotonic() - began >= cell_limit:
                notes.append(f"cell {i + 1} ran past the {cell_limit:g} s limit per cell and "
                             "was interrupted")  # fmt: skip
                continue
            error = _errors(cell)
            if error and not last:
                first = cell.source.strip().splitlines()[0][:60] if cell.source.strip() else ""
                notes.append(f"cell {i + 1} ({first!r}) raised {error}")
    text = _stream_text(harvest)
    line = next((ln for ln in text.splitlines() if ln.startswith(MARK)), None)
    return (json.loads(line[len(MARK) :]) if line else {}), notes
