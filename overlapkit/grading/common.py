"""Helpers shared by the exercise checks: run a learner's function and explain failures."""

from __future__ import annotations

import math

from ..launcher import LaunchError, LaunchTimeoutError
from .report import Report
from .traffic import run_recorded


def human_bytes(n: float) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{int(n)} B"


def human_seconds(t: float) -> str:
    if not isinstance(t, (int, float)) or not math.isfinite(t):
        return repr(t)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(t) >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t * 1e9:.3g} ns"


def run_or_report(report: Report, what: str, fn, *args, world_size: int, timeout: float, **kwargs):
    """Run ``fn`` on ranks with traffic recording; on failure add one ✘ case and return None."""
    try:
        return run_recorded(fn, *args, world_size=world_size, timeout=timeout, **kwargs)
    except NotImplementedError:
        report.fail(f"{what}: not implemented yet (the function still raises NotImplementedError)")
    except LaunchTimeoutError as exc:
        report.fail(f"{what}: did not finish within {timeout:g} s. {exc}")
    except LaunchError as exc:
        report.fail(f"{what}: a rank failed: {exc}")
    except Exception as exc:  # the learner's own exception, re-raised from its rank
        rank = getattr(exc, "rank", "?")
        report.fail(f"{what}: rank {rank} raised {type(exc).__name__}: {exc}")
    return None
