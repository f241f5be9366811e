"""Shared fixtures: every test that starts ranks must leave none behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest
import torch

from overlapkit import launcher
from tests import executed_copies

INFRASTRUCTURE = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")

# A check's ranks unpickle a test's function by reference, so each one imported this
# package (pytest, psutil, this file) before the call: ~0.5 s of a core per rank, thousands
# of ranks a run. The forkserver imports them once, and every rank it forks has them.
for _module in ("pytest", "psutil", "tests.conftest"):
    launcher.preload(_module)


def _execd_cmdline(root: psutil.Process, child: psutil.Process, limit_s: float = 2.0) -> list[str]:
    """``child``'s command line once it differs from ``root``'s (a fork exec's within
    milliseconds; one that never does is judged by the copy it shows)."""
    mine, end = root.cmdline(), time.monotonic() + limit_s
    while (line := child.cmdline()) == mine and time.monotonic() < end:
        time.sleep(0.01)
    return line


def descendants_except_infrastructure(root: psutil.Process) -> list[psutil.Process]:
    """Live descendants of ``root`` other than its forkserver and resource tracker.

    Ranks are forked *from* the forkserver, so they carry its command line:
    only the direct children of ``root`` are judged by command line, and only once they
    have exec'd (a forkserver forked but not yet exec'd shows ``root``'s own command line:
    test_launch's rank count once took one for a rank).
    """
    infrastructure = set()
    for child in root.children():
        try:
            if any(name in " ".join(_execd_cmdline(root, child)) for name in INFRASTRUCTURE):
                infrastructure.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    found = []
    for proc in root.children(recursive=True):
        try:
            if proc.pid in infrastructure or proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.NoSuchProcess:
            continue
        found.append(proc)
    return found


def rank_processes() -> list[psutil.Process]:
    return descendants_except_infrastructure(psutil.Process())


def wait_for_no_ranks(limit_s: float = 5.0) -> list[psutil.Process]:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        left = rank_processes()
        if not left:
            return []
        time.sleep(0.05)
    return rank_processes()


@pytest.fixture
def no_leftover_ranks():
    yield
    left = wait_for_no_ranks()
    assert not left, f"processes left running: {[p.cmdline() for p in left]}"


#: test files whose tests share a module-scoped fixture (a JupyterLab server, a measured
#: sweep): under pytest-xdist they stay on one worker, as each notebook's nbval cells do
#: (they share its kernel); every other test goes to whichever worker is free
KEEP_TOGETHER = ("test_browser.py", "test_grading_lab10.py")


def _scope(nodeid: str) -> str:
    """What must run on one worker: a notebook's cells, a KEEP_TOGETHER file; else the test."""
    path = nodeid.split("::", 1)[0]
    return path if path.endswith(".ipynb") or path.rsplit("/", 1)[-1] in KEEP_TOGETHER else nodeid


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: none without it
def pytest_xdist_make_scheduler(config, log):
    """`make test`'s scheduling (pytest -n N): pytest-xdist's load-by-scope, with the scopes
    above (its own scopes are whole files: a file of twelve notebooks' tests ran last, alone)."""
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415

    class Scheduler(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return _scope(nodeid)

    return Scheduler(config, log)


#: files of tests that each run a whole notebook, a grader or a subprocess of the kit
#: (20-90 s each): started first, with the notebooks' nbval cells, so that under
#: pytest-xdist the short tests fill the workers at the end instead of one long test
#: running alone there (the scheduler hands scopes out in the order of the items)
LONG_FIRST = ("test_browser.py", "test_notebooks.py", "test_grade.py", "test_grade_isolation.py",
              "test_grade_identity.py", "test_grade_layouts.py", "test_cli.py")  # fmt: skip


#: tests that read what the whole run produced (the book is built from the executed notebooks)
LAST = ("test_book.py::test_every_page_of_the_book",)


def _start_order(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    if path.endswith(".ipynb"):
        return 0
    if any(last in item.nodeid for last in LAST):
        return 2 + len(LONG_FIRST)
    return 1 + LONG_FIRST.index(name) if name in LONG_FIRST else 1 + len(LONG_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_start_order)  # stable: within a file, its own order
    executed_copies.watch(items, EXECUTED)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run scripts/gpu_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def failed_with(report, *words):
    """``report`` failed, and its failed lines hold every one of ``words``."""
    assert not report.all_passed, report.cases
    text = " ".join(m for passed, m in report.cases if not passed)
    for word in words:
        assert word in text, text


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Agreeable(float):
    """A reported number whose arithmetic and comparisons agree with any right answer (what
    a student who reads the checks might return): checks must refuse it as not a plain float."""

    def __sub__(self, other):
        return 0.0

    def __truediv__(self, other):
        return 1.0

    def __rtruediv__(self, other):
        return 1.0

    def __eq__(self, other):
        return True

    __hash__ = float.__hash__


def soak_runs(in_ci: int, soak: int = 20) -> int:
    """How often a verdict that must hold every time is repeated: ``soak`` times when
    OVERLAPKIT_SOAK=1 (``make soak``: 20 of 20 runs must hold), else
    ``in_ci`` times, so that the test suite stays within its time on 2 cores."""
    return soak if _soaking() else in_ci


def _soaking() -> bool:
    return os.environ.get("OVERLAPKIT_SOAK", "") not in ("", "0")


def already_loaded() -> bool:
    """More processes running or waiting for a core than a spinning process adds to an idle
    machine: over the last minute, at least one more runnable process than there are cores
    (``make test``'s workers on 2 cores: a load of 4-8)."""
    return os.getloadavg()[0] >= (os.cpu_count() or 1) + 1


@pytest.fixture
def cpu_hog():
    """The test runs on a machine at least as loaded as by a process spinning on one core:
    one is started unless the machine is already that loaded (``make test``'s own workers
    are: a spinning process there only took ~150 s of the cores from the rest of the
    suite). ``make soak`` always starts it. Yields the hog, or None where none was needed."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    if not _soaking() and already_loaded():
        yield None
        return
    hog = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    yield hog
    hog.kill()
    hog.wait()


@pytest.fixture
def labs(tmp_path):
    """A labs folder with the grader tests' tiny lab (tests/tinylab.py), both exercises
    unfinished."""
    from tests.tinylab import write_lab  # noqa: PLC0415

    return write_lab(tmp_path / "labs")


#: where the solution notebooks land executed, for the course book (tests/executed_copies.py)
EXECUTED = Path(__file__).resolve().parent.parent / "build" / "executed"


def pytest_configure(config):
    executed_copies.use_figure_formats()
    if not hasattr(config, "workerinput"):  # once, in the process that starts the workers
        executed_copies.forget_failures(EXECUTED)
