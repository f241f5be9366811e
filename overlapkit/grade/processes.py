"""The grader's processes: what a notebook or a judge started is ended when it is done,
and no other process of the user may look into the grader's (Linux; elsewhere a no-op).
"""

from __future__ import annotations

import contextlib


def descendants() -> set:
    """This process's descendants now, as (pid, start time): a pid alone may be reused."""
    import psutil  # noqa: PLC0415

    found = set()
    for p in _children(psutil.Process()):
        with contextlib.suppress(psutil.Error):  # a child may end while we list them
            found.add((p.pid, p.create_time()))
    return found


def _children(proc) -> list:
    import psutil  # noqa: PLC0415

    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def end_new_processes(before: set, spare: int | None = None, rounds: int = 50) -> None:
    """Kill every process this one has gained since ``before`` (the kernel's ranks, servers,
    anything the notebook left running), and reap them. Processes that left our tree
    (setsid + double fork) come back to it where :func:`adopt_orphans` was called.

    Listed again until none is new: a process that forks while the others are killed
    leaves a child the first list never held, which the next judge's ``before`` would
    then spare (a survivor outside the judge's sandbox may trace its ranks). Each round
    stops them all before killing any (a stopped process forks no more)."""
    import signal  # noqa: PLC0415

    import psutil  # noqa: PLC0415

    for _ in range(rounds):
        new = []
        for p in _children(psutil.Process()):
            with contextlib.suppress(psutil.Error):
                # (a zombie runs nothing, and one whose parent is spared, the kernel, is not
                # ours to reap: waiting for it each round took minutes)
                if (
                    (p.pid, p.create_time()) not in before
                    and p.pid != spare
                    and (p.status() != psutil.STATUS_ZOMBIE)
                ):
                    new.append(p)
        if not new:
            break
        for p in new:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGSTOP)
        for p in new:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(new, timeout=5)
    # the zombies that are ours to reap (a child that ended while we listed)
    me = psutil.Process()
    with contextlib.suppress(psutil.Error):
        psutil.wait_procs([p for p in me.children() if (p.pid, p.create_time()) not in before
                           and p.pid != spare], timeout=0)  # fmt: skip


def adopt_orphans() -> None:
    """Make this process the reaper of its orphaned descendants (Linux), so that a process
    a notebook detached from its kernel is still found, and ended, when it is done."""
    _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER


def undumpable() -> None:
    """PR_SET_DUMPABLE 0: no other process of this user may open this one's descriptors
    (the judges' report pipes) or read its memory (root is not held off by it)."""
    _prctl(4, 0)


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(Exception):  # not Linux: nothing to do
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
