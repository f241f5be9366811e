"""Checks for lab 07: a bucketer (``assign_buckets``), and a bucketed data-parallel wrapper
trained as lab 06's is (:mod:`.lab06_ddp`), its buckets and their AllReduces in order."""

from __future__ import annotations

import io

from ..costmodel import ddp_buckets
from ..sandbox.sealed import seal
from .cases import not_reached
from .common import Unfinished, call_or_report
from .exercises import answers_of
from .lab06_ddp import (
    TIMEOUT_S,
    WORLD,
    _builtins,
    _check_communication,
    _compare,
    _loop_hint,
    _net,
    _report_unwaited,
    _run,
)
from .report import Report

BUCKET_CASES = [
    ("four 1 MiB gradients, 2 MiB buckets", [2**20] * 4, 2),
    ("a gradient larger than a bucket", [100, 3 * 2**20, 100, 100], 1),
    ("buckets smaller than every gradient", [4096, 4096, 4096], 0.001),
    ("one bucket for everything (bucket_mb=None), 60 MiB", [20 * 2**20] * 3, None),
    ("an exact fit, then one more byte", [2**19, 2**19, 1], 1),
    ("uneven sizes", [300_000, 500_000, 200_000, 900_000, 100_000, 50_000], 1),
    ("1 020 000 bytes in a 1 MiB bucket", [600_000, 420_000, 100_000], 1),
]


def _size(n: int) -> str:
    """Bytes in binary units, as the lab counts them (1 MiB = 2**20 bytes)."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def check_assign_buckets(assign_buckets) -> Report:
    """Check ``assign_buckets(sizes, bucket_mb) -> list[list[int]]`` (lab 07).

    ``sizes``: each gradient's bytes, in the order they become ready; a bucket holds
    consecutive gradients, at most ``bucket_mb`` MiB; a gradient larger than a bucket
    gets one of its own; ``None`` means one bucket.
    """
    report = Report("assign_buckets")
    assign_buckets = seal(assign_buckets)  # called on a rank of its own, out of our reach
    lines: list = []  # (passed, text) or (what, sizes, mb, got): printed once all answered
    for k, (what, sizes, mb) in enumerate(BUCKET_CASES):
        quiet = Report(report.exercise, file=io.StringIO())
        try:
            ran, got = call_or_report(quiet, what, assign_buckets, list(sizes), mb,
                                      forbid=answers_of("check_assign_buckets"))  # fmt: skip
        except Unfinished:  # the cases after it are not reached: each counts as failed
            lines.append(quiet.cases[-1])
            lines += [(False, not_reached(case[0])) for case in BUCKET_CASES[k + 1 :]]
            break
        if not ran:
            lines.append(quiet.cases[-1])
            continue
        if isinstance(got, tuple):
            got = list(got)
        if isinstance(got, list) and all(isinstance(b, (list, tuple)) for b in got):
            got = [list(b) for b in got]
        lines.append((what, sizes, mb, got))
    # a limit read as KiB shows only across the cases: on one, 2 KiB and 2 × 10**6 bytes
    # may cut the same buckets
    answered = [line for line in lines if len(line) == 4 and line[2] is not None]
    kib = bool(answered) and all(got == _kib(sizes, mb) for _, sizes, mb, got in answered)
    for line in lines:
        if len(line) == 2:
            (report.ok if line[0] else report.fail)(line[1])
            continue
        what, sizes, mb, got = line
        want = ddp_buckets(sizes, mb)  # after the calls: nothing on their stack holds it
        if got == want:
            report.ok(f"{what}: {_show(want, sizes)}")
        else:
            hint = _bucket_hint(got, want, sizes, mb, kib)
            report.fail(f"{what}, bucket_mb={mb}: got {got!r}; expected {want}.{hint}")
    return report


def _kib(sizes, mb):
    """The buckets of a bucketer that reads ``bucket_mb`` as KiB (× 2**10 bytes)."""
    return ddp_buckets(sizes, mb * 2**10 / 2**20)


def _show(buckets, sizes) -> str:
    return " | ".join(f"{b} ({_size(sum(sizes[i] for i in b))})" for b in buckets)


def _strict(sizes, mb):
    """The buckets of a bucketer that closes a bucket when its total *reaches* the limit:
    for whole bytes, total < limit is total ≤ limit − 1."""
    return ddp_buckets(sizes, (mb * 2**20 - 1) / 2**20)


def _bucket_hint(got, want, sizes, mb, kib: bool = False) -> str:
    """Why ``got`` differs from ``want``; ``kib``: the answers of every case are what a
    limit read as KiB gives."""
    if not isinstance(got, list) or not all(isinstance(b, list) for b in got):
        return (
            f" Return a list of buckets, each a list of gradient indices (got a "
            f"{type(got).__name__}"
            + (
                f" whose items are {type(got[0]).__name__}s"
                if isinstance(got, list) and got
                else ""
            )
            + ")."
        )
    if any(not b for b in got):
        k = next(k for k, b in enumerate(got) if not b)
        first = (
            " (it was closed at the very first gradient, before anything went in)" if k == 0 else ""
        )
        return (
            f" Bucket {k} is empty{first}: close the current bucket only when it holds "
            "something — a gradient larger than the limit then starts a bucket of its own."
        )
    flat = [i for b in got for i in b]
    if sorted(flat) != list(range(len(sizes))):
        return " Every gradient index must be in exactly one bucket."
    if flat != list(range(len(sizes))):
        return (
            " Buckets hold consecutive gradients in the order given (the order they become "
            "ready), so that a bucket fills while backward runs."
        )
    if mb is None:
        return " bucket_mb=None means no limit: one bucket holds every gradient."
    if kib and got == _kib(sizes, mb):  # every case's buckets are those of a KiB limit
        return (
            f" These are buckets of {mb:g} KiB ({mb:g} × 2**10 = {mb * 2**10:g} bytes): "
            "bucket_mb counts MiB, 1 MiB = 2**20 = 1048576 bytes, 1024 times as many."
        )
    decimal = got in (ddp_buckets(sizes, mb * 10**6 / 2**20),
                      ddp_buckets(sizes, mb * 1000 * 1024 / 2**20))  # fmt: skip
    strict = got == _strict(sizes, mb)
    units = f"buckets of {mb} × 10**6 bytes? bucket_mb counts MiB, 1 MiB = 2**20 = 1048576 bytes"
    less = (
        "a gradient still joins the current bucket when the total then equals the limit "
        "exactly (≤, not <)"
    )
    if decimal and strict:
        return f" Two mistakes give these buckets: {units}; or {less}."
    if decimal:
        return f" Are these {units}."
    if strict:
        return f" You close a bucket when its total reaches the limit: {less}."
    limit = mb * 2**20
    for b in got:
        total = sum(sizes[i] for i in b)
        if total > limit and len(b) > 1:
            return (
                f" Bucket {b} holds {total} bytes, more than bucket_mb = {mb} MiB = "
                f"{int(limit)} bytes (1 MiB = 2**20 bytes)."
            )
    return ""


#: lab 07's check: buckets of 400 bytes cut the test model's 8 gradients into 6, one of
#: them an exact fit, and one full before an earlier one
CHECK_BUCKET_MB = 400 / 2**20


def check_bucketed_ddp(wrapper_cls, bucket_mb: float = CHECK_BUCKET_MB, world_size: int = WORLD,
                       timeout: float = TIMEOUT_S) -> Report:  # fmt: skip
    """Check a bucketed wrapper ``wrapper_cls(module, bucket_mb)`` (lab 07): its buckets,
    the weights of 5 steps against one process, one async AllReduce per bucket launched
    during backward in bucket order, every handle waited."""
    report = Report("bucketed_ddp")
    order = list(reversed([p for p in _net().parameters() if p.requires_grad]))
    want = ddp_buckets([p.numel() * p.element_size() for p in order], bucket_mb)
    expect = [sum(order[i].numel() for i in b) for b in want]
    what = f"{wrapper_cls.__name__}(bucket_mb={bucket_mb:.3g}) on {world_size} ranks"
    results = _run(report, "check_bucketed_ddp", what, wrapper_cls, (bucket_mb,), world_size,
                   timeout)  # fmt: skip
    if results is None:
        _loop_hint(report)
        return report
    got = results[0][0]["buckets"]
    if got is not None and got != want:
        report.fail(
            f"self.buckets is {got}; with buckets of {_size(round(bucket_mb * 2**20))} the "
            f"gradients (in reverse parameter order) make {want}: check assign_buckets first "
            "(ok.grading.check_assign_buckets)"
        )
    builtin = _builtins(results)
    if builtin:
        report.fail(builtin)
    if _compare(report, results, world_size, expect) and not builtin:
        _check_communication(report, results, expect=expect)
    elif not builtin:
        _report_unwaited(report, results)
    return report
