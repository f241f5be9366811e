"""The core of the kit knows nothing of its checks: no core module imports them, a plain
``import overlapkit`` loads none of them, and a plain launch's ranks preload none."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import overlapkit

KIT = pathlib.Path(overlapkit.__file__).parent
#: the packages that build on the core (the checks, the grader, the sandbox, the benches)
ABOVE_THE_CORE = ("grading", "grade", "sandbox", "bench")


def _core_modules() -> list[pathlib.Path]:
    return [p for p in KIT.rglob("*.py") if p.relative_to(KIT).parts[0] not in ABOVE_THE_CORE]


def _imported(path: pathlib.Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in the file names, made absolute."""
    package = ".".join(("overlapkit", *path.relative_to(KIT).parent.parts))
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_no_core_module_imports_the_checks_the_grader_or_the_sandbox():
    found = {
        str(p.relative_to(KIT)): sorted(
            n
            for n in _imported(p)
            if n.startswith(("overlapkit.grading", "overlapkit.grade", "overlapkit.sandbox"))
        )
        for p in _core_modules()
    }
    assert {k: v for k, v in found.items() if v} == {}


def test_the_static_import_walk_sees_an_import_of_the_checks(tmp_path):
    # the test above would pass on a walk that sees nothing: this one shows it sees them
    assert "overlapkit.launcher.LaunchError" in _imported(KIT / "grading" / "common.py")
    assert "overlapkit.handles" in _imported(KIT / "grading" / "peers.py")


_PLAIN = """
import sys
import overlapkit as ok
CHECKS = ("overlapkit.grad", "overlapkit.sandbox")
print("after import:", sorted(m for m in sys.modules if m.startswith(CHECKS)))
def loaded():
    import sys
    return sorted(m for m in sys.modules if m.startswith(("overlapkit.grad", "overlapkit.sandbox")))
print("plain ranks:", ok.launch(loaded, world_size=2, quiet=True))
ok.grading  # the checks, first used
print("after use:", sorted(m for m in sys.modules if m == "overlapkit.grading"))
values = ok.launch(loaded, world_size=2, quiet=True)
print("checks' ranks:", ["overlapkit.grading.preload" in m for m in values])
"""


def test_a_plain_import_and_launch_load_nothing_of_the_checks_until_they_are_used():
    out = subprocess.run(
        [sys.executable, "-c", _PLAIN], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "after import: []",
        "plain ranks: [[], []]",
        "after use: ['overlapkit.grading']",
        "checks' ranks: [True, True]",
    ]
