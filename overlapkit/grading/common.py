"""Helpers shared by the exercise checks: run a learner's function and explain failures."""

from __future__ import annotations

import contextlib
import math
import os
import re

from ..launcher import LaunchError, LaunchTimeoutError
from ..sandbox import answers
from ..sandbox.sealed import recorded_calls
from .mistakes import WAIT_FOR_EVERY_ONE, never_waited, not_over_the_link
from .report import Report
from .traffic import group_ops, run_recorded


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{int(n)} B"


_NUMPY_SCALARS = ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8")


def plain_number(value) -> bool:
    """An int or float itself (not bool), or one of NumPy's own scalar types: no subclass,
    whose arithmetic and comparisons could be made to agree with any right answer."""
    kind = type(value)
    return kind in (int, float) or (kind.__module__ == "numpy" and kind.__name__ in _NUMPY_SCALARS)


def human_seconds(t: float) -> str:
    if not isinstance(t, (int, float)) or not math.isfinite(t):
        return repr(t)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(t) >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t * 1e9:.3g} ns"


def run_or_report(report: Report, what: str, fn, *args, world_size: int, timeout: float,
                  link=None, explain=None, **kwargs):  # fmt: skip
    """Run ``fn`` on ranks with traffic recording; on failure add one ✘ case and return None.

    ``explain(text) -> str`` turns a rank's error (or a crashed rank's last words)
    into a sentence in the exercise's terms, appended to the ✘ line.
    """
    try:
        return run_recorded(fn, *args, world_size=world_size, timeout=timeout, link=link,
                            **kwargs)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - every failure becomes one ✘ line
        report_failure(report, what, exc, timeout, explain)
    return None


def sealed_rank_hint(text: str) -> str:
    """For an error a refused socket (``sandbox.nosockets``) or a hidden file
    (``sandbox.nofiles``) caused: why, and what to use."""
    if "Permission denied" in text:
        return (" — a check's ranks share no file while your code runs: the process "
                "group's store and the other ranks' files can be neither read nor written "
                "(your rank's own temporary folder can). Move the data with ok.p2p and the "
                "kit's collectives")  # fmt: skip
    if "Operation not permitted" not in text:
        return ""
    if "Operation not permitted: '" in text:  # a path: a program that was to start
        return (" — a check's process starts no program (a fresh interpreter would run "
                "outside the check): write the exercise in the function itself")  # fmt: skip
    return (" — a check's ranks open no new connections: a process group of your own (or "
            "any socket between ranks) is refused. Move the data with ok.p2p and the kit's "
            "collectives")  # fmt: skip


def report_failure(report: Report, what: str, exc: BaseException, timeout: float,
                   explain=None) -> None:  # fmt: skip
    """One ✘ line for a launch that failed: unfinished, hung, crashed, or raised."""
    given = explain or (lambda text: "")

    def explain(text: str) -> str:
        return sealed_rank_hint(text) or given(text)

    if isinstance(exc, answers.AnswerRan):
        report.fail(f"{what}: {exc}")
    elif isinstance(exc, NotImplementedError):
        frames = re.findall(r", in (\w+)\n", str(exc.__cause__ or ""))
        where = f"{frames[-1]} still raises" if frames else "the function still raises"
        report.fail(f"{what}: not implemented yet ({where} NotImplementedError)")
    elif isinstance(exc, LaunchTimeoutError):
        report.fail(f"{what}: did not finish within {timeout:g} s. {exc}{_all_blocked(str(exc))}")
    elif isinstance(exc, LaunchError):
        report.fail(f"{what}: a rank failed: {exc}{explain(str(exc))}")
    else:  # the learner's own exception, re-raised from its rank
        rank = getattr(exc, "rank", "?")
        text = f"{type(exc).__name__}: {exc}"
        report.fail(f"{what}: rank {rank} raised {text}{_learner_line(exc)}{explain(text)}")


def _learner_line(exc: BaseException) -> str:
    """Where in the learner's code a rank's exception came from: the last frame of its
    remote traceback outside the kit and its libraries (" (at file:line, in fn: code)")."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n {4}(.*)', str(exc.__cause__ or ""))
    mine = [f for f in frames if not _library_file(f[0])]
    if not mine:
        return ""
    path, line, fn, code = mine[-1]
    return f" (at {os.path.basename(path)}:{line}, in {fn}: {code.strip()})"


def _library_file(path: str) -> bool:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # overlapkit/
    return path.startswith(here) or "site-packages" in path or path.startswith("<frozen")


def _all_blocked(text: str) -> str:
    """A hint (on its own line) when every hung rank waits in a send, or every one in a
    receive: nobody posted the other half."""
    blocks = re.split(r"^rank \d+ was here.*$", text, flags=re.M)[1:]
    lines = [re.findall(r"^ {4}(\S.*)$", block, flags=re.M) for block in blocks]
    learner = [next((ln for ln in block if "send(" in ln or "recv(" in ln), "") for block in lines]
    if learner and all("send(" in ln and "recv(" not in ln for ln in learner):
        return (
            "\nEvery rank is blocked in a send that waits for its receiver, and no rank is "
            "receiving: post the send and the receive first (isend + irecv), then wait."
        )
    if learner and all("recv(" in ln and "send(" not in ln for ln in learner):
        return (
            "\nEvery rank waits in a receive, and no rank has posted the send it waits for: "
            "post the send and the receive first (isend + irecv), then wait."
        )
    return ""


def worst_element(diff, tol: float = 1e-5) -> int | None:
    """The flat index where ``diff`` (an absolute difference) is largest, when it exceeds
    ``tol`` — a NaN counts as the largest (``diff.max() > tol`` is False for NaN, and a
    tensor read before its wait() holds NaN under the read guard); None when all is close."""
    flat = diff.reshape(-1)
    if flat.numel() == 0:
        return None
    nan = flat.isnan()
    if nan.any():
        return int(nan.nonzero()[0])
    i = int(flat.argmax())
    return i if flat[i] > tol else None


class Unfinished(Exception):
    """Raised by :func:`call_or_report` when the exercise still raises NotImplementedError."""


def call_or_report(report: Report, what: str, fn, *args, forbid=None):
    """Call a learner's single-process function; a crash becomes one ✘ line (and None),
    an unfinished exercise raises :class:`Unfinished` after its ✘ line (stop checking).
    ``forbid``: the kit's own answers (dotted names, ``exercises.ANSWERS``); the call fails
    (and checking stops) when their code runs during the learner's call, under whatever
    name it was reached."""
    ran: list[str] = []
    try:
        with answers.running(forbid or ()) as ran:
            value = fn(*args)
    except NotImplementedError:
        report.fail(f"{what}: not implemented yet (still raises NotImplementedError)")
        raise Unfinished from None
    except Exception as exc:  # noqa: BLE001 - a crash is one ✘ line
        if ran or isinstance(exc, answers.AnswerRan):  # the kit's answer ran, and refused
            report.fail(f"{what}: your function {answers.said(ran)}" if ran else f"{what}: {exc}")
            raise Unfinished from None
        report.fail(f"{what}: raised {type(exc).__name__}: {exc}{sealed_rank_hint(str(exc))}")
        return False, None
    if ran:
        report.fail(f"{what}: your function {answers.said(ran)}")
        raise Unfinished
    return True, value


# the *_single names exist from torch 2.13 on
_BUILTINS = ("all_gather_into_tensor", "all_gather_single", "all_gather", "all_to_all_single",
             "all_to_all", "all_reduce", "reduce_scatter_tensor", "reduce_scatter_single",
             "broadcast")  # fmt: skip


@contextlib.contextmanager
def builtin_collectives():
    """Record torch.distributed's collectives the learner ran, however reached: the calls of
    their names on ``torch.distributed`` and on ``distributed_c10d``, and then what torch's
    process groups themselves counted (their sequence numbers: a group's own ``allreduce``,
    a collective through any alias), less the kit's own messages on those groups. Yields
    the list of what was found, complete when the block ends."""
    import torch.distributed as dist  # noqa: PLC0415
    import torch.distributed.distributed_c10d as c10d  # noqa: PLC0415

    from .. import p2p  # noqa: PLC0415

    found = []
    before, kit_before = group_ops(), p2p.stats().user_group_messages
    with (
        recorded_calls(dist, [n for n in _BUILTINS if hasattr(dist, n)],
                       prefix="torch.distributed.") as named,
        recorded_calls(c10d, [n for n in _BUILTINS if hasattr(c10d, n)],
                       prefix="torch.distributed.distributed_c10d.") as named_c10d,
    ):  # fmt: skip
        try:
            yield found
        finally:
            after = group_ops()
            ops = sum(n - before.get(g, 0) for g, n in after.items())
            kit = p2p.stats().user_group_messages - kit_before
            unnamed = ops - kit - len(named) - len(named_c10d)
            found += named + named_c10d
            if unnamed > 0:
                found.append(f"{unnamed} more operation(s) on torch's process groups, not "
                             "through the kit (a group's own allreduce, send, …)")  # fmt: skip


def refused_rank(report: Report, what: str, rank: int, res: dict, traffic, advice: str) -> bool:
    """The ✘ line for a rank that called a built-in collective (``advice``: what to use
    instead) or left an operation unwaited; True when it was refused."""
    direct = sorted(set(traffic.direct) | set(res.get("builtin", ())))
    if direct:
        report.fail(f"{what}: " + not_over_the_link(rank, ", ".join(direct), advice))
        return True
    if res.get("unwaited"):
        report.fail(never_waited(what, rank, res["unwaited"], WAIT_FOR_EVERY_ONE))
        return True
    return False


def wait_unless_stuck(wait, stuck, step_s: float = 0.05):
    """``wait(timeout=step_s)`` until it returns; after each step ``stuck()`` may raise
    (the wait can never end), so a wait nobody can answer ends at once, not at the check's
    timeout."""
    while True:
        try:
            return wait(timeout=step_s)
        except TimeoutError:
            stuck()


def judge_against_one_process(report: Report, what: str, results, tol: float = 1e-5) -> None:
    """The verdict on a plan trained on ranks: ``results`` holds each rank's error message
    (a str: the first one fails) or its largest parameter difference from one process's
    training on the whole batch (every one within ``tol`` passes)."""
    bad = next((r for r in results if isinstance(r, str)), None)
    if bad is not None:
        report.fail(f"{what}: {bad}")
        return
    gap = max(results)
    report.check(gap <= tol,
                 f"{what}: the parameters equal one process's training on the whole batch",
                 f"{what}: the parameters differ from one process's by {gap:.3g}")  # fmt: skip
