"""Checks for lab 00: the ping-pong measurement and the α-β fit."""

from __future__ import annotations

import math
import random
import statistics

from ..costmodel import fit_alpha_beta as reference_fit
from ..pingpong import ping_pong as reference_ping_pong
from .common import human_bytes, human_seconds, run_or_report
from .report import Report

#: one-way times within this band of the kit's own measurement pass; a round-trip
#: time (2×), a total over all iterations (≥ 5×) or half of a one-way time (0.5×) do
#: not. The ratio is the median of per-round ratios, each round timing the learner's
#: function and the kit's back to back, so that the machine's drift cancels.
PING_PONG_BAND = (0.7, 1.45)
#: rounds per attempt; a ratio between the band and the next mistake gets a second attempt
TIMING_ROUNDS = 9


def _interleaved(student_fn, nbytes, iters, rounds):
    """On each rank: student, kit, student, kit... at one size; the per-round times."""
    import overlapkit as ok

    student, kit = [], []
    for _ in range(rounds):
        student.append(student_fn(nbytes, iters))
        kit.append(reference_ping_pong(nbytes, iters=iters, warmup=1))
    if ok.rank() != 0:
        return None
    return student, kit


def _ratio_hint(ratio: float) -> str:
    """The mistake a ratio (learner's one-way time ÷ the kit's) points to."""
    if 1.45 < ratio < 3.0:
        return " Did you return the round-trip time instead of half of it?"
    if 300 < ratio < 3000:
        return " Did you return milliseconds? Return seconds."
    if 3e5 < ratio < 3e6:
        return " Did you return microseconds? Return seconds."
    if 3.0 <= ratio <= 50:
        return " Did you return the total over all iterations instead of the median of one?"
    if 0.3 < ratio < 0.7:
        return " Did you halve a one-way time (time only the send, or divide by 4)?"
    if ratio <= 0.3:
        return " Do you time the whole round trip, both send and recv?"
    return ""


def check_ping_pong(ping_pong, timeout: float = 10.0) -> Report:
    """Check a learner's ``ping_pong(nbytes, iters) -> one-way seconds on rank 0``.

    Runs it on 2 ranks and checks (1) the messages: each iteration sends
    ``nbytes`` from rank 0 to rank 1 and back; (2) the value: seconds, finite,
    positive, one-way; (3) it agrees with the kit's own measurement.
    """
    report = Report("ping_pong")
    iters = 8
    for nbytes in (8, 1 << 20):
        results = run_or_report(
            report,
            f"ping_pong({nbytes}, {iters})",
            ping_pong,
            nbytes,
            iters,
            world_size=2,
            timeout=timeout,
        )
        if results is None:
            return report
        (value, t0), (_, t1) = results
        size = human_bytes(nbytes)
        messages_right = _check_messages(report, size, nbytes, iters, t0, t1)
        if not _check_value(report, size, value) or not messages_right:
            return report  # the timing would only echo what is wrong above

    # One-way, not round trip: compare with the kit, interleaved, at a size where
    # bandwidth dominates; per-round ratios, medians, and a second attempt only when
    # the first lands between the band and the next mistake.
    _check_timing(report, ping_pong, timeout)
    return report


def _check_timing(report: Report, ping_pong, timeout: float) -> None:
    nbytes, size = 4 << 20, human_bytes(4 << 20)
    ratios, student_times, kit_times = [], [], []
    for attempt in range(2):
        results = run_or_report(report, f"ping_pong({nbytes}, 5)", _interleaved, ping_pong,
                                nbytes, 5, TIMING_ROUNDS, world_size=2,
                                timeout=max(timeout, 30.0))  # fmt: skip
        if results is None:
            return
        student, kit = results[0][0]
        student_times += student
        kit_times += kit
        ratios += [s / k for s, k in zip(student, kit, strict=True)]
        ratio = statistics.median(ratios)
        low, high = PING_PONG_BAND
        if low <= ratio <= high:
            report.ok(f"{size}: the one-way time agrees with the kit's own measurement")
            return
        if ratio >= 1.6 or ratio <= 0.6 or attempt == 1:
            break
    report.fail(
        f"{size}: your one-way time is {ratio:.2f}× the kit's measurement (the median of "
        f"{len(ratios)} rounds, each timing yours and the kit's back to back; medians of the "
        f"times themselves: yours {human_seconds(statistics.median(student_times))}, kit "
        f"{human_seconds(statistics.median(kit_times))}).{_ratio_hint(ratio)}"
    )


def _check_messages(report, size, nbytes, iters, t0, t1) -> bool:
    """✔/✘ per rank for the messages it moved; True when all were right."""
    failed_before = report.total - report.passed
    expected = f"at least {iters} messages of {nbytes} bytes"
    for me, peer, traffic in ((0, 1, t0), (1, 0, t1)):
        sent, got = traffic.sent_to(peer), traffic.received_from(peer)
        wrong = sorted({n for n in sent + got if n != nbytes})
        if wrong:
            report.fail(
                f"{size}: rank {me} moved messages of {', '.join(map(str, wrong))} bytes; "
                f"every message should have {nbytes} bytes (a uint8 tensor of nbytes elements)"
            )
        elif len(sent) < iters or len(got) < iters:
            report.fail(
                f"{size}: rank {me} sent {len(sent)} and received {len(got)} messages to/from "
                f"rank {peer}; expected {expected} each way (one round trip per iteration)"
            )
        else:
            report.ok(f"{size}: rank {me} sent and received {expected} to/from rank {peer}")
        if traffic.collectives:
            report.fail(
                f"{size}: rank {me} called {', '.join(sorted(set(traffic.collectives)))}; "
                "a ping-pong needs only send and recv"
            )
    return report.total - report.passed == failed_before


def _check_value(report, size, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        item = " (a tensor: return t.item())" if hasattr(value, "item") else ""
        report.fail(
            f"{size}: rank 0 returned {value!r} ({type(value).__name__}); "
            f"expected a float in seconds{item}"
        )
        return False
    if not math.isfinite(value) or value <= 0:
        report.fail(f"{size}: rank 0 returned {value!r}; a time must be positive and finite")
        return False
    if value > 1.0:
        report.fail(
            f"{size}: rank 0 returned {value:g}; a one-way time of {size} on this machine is "
            "far below a second: did you return milliseconds or microseconds?"
        )
        return False
    report.ok(f"{size}: rank 0 returned a time in seconds")
    return True


def check_fit_alpha_beta(fit_alpha_beta) -> Report:
    """Check a learner's ``fit_alpha_beta(sizes, times) -> (alpha_s, beta_s_per_byte)``."""
    report = Report("fit_alpha_beta")
    alpha, beta = 20e-6, 1 / 2e9  # 20 µs, 2 GB/s
    sizes = [8 * 4**k for k in range(12)]  # 8 B .. 32 MB
    exact = [alpha + beta * s for s in sizes]
    rng = random.Random(0)
    noisy = [t * rng.uniform(0.85, 1.15) for t in exact]
    ref_alpha, ref_beta = reference_fit(sizes, noisy)

    cases = [
        ("measurements on the line", exact, alpha, beta, 0.01),
        ("noisy measurements (±15%)", noisy, ref_alpha, ref_beta, 0.35),
    ]
    for label, times, want_a, want_b, tol in cases:
        try:
            got = fit_alpha_beta(list(sizes), list(times))
        except NotImplementedError:
            report.fail(
                f"{label}: not implemented yet (the function still raises NotImplementedError)"
            )
            return report
        except Exception as exc:
            report.fail(f"{label}: raised {type(exc).__name__}: {exc}")
            return report
        try:
            got_a, got_b = (float(x) for x in got)
        except (TypeError, ValueError):
            report.fail(f"{label}: returned {got!r}; expected a pair (alpha, beta) of floats")
            return report
        a_ok = math.isclose(got_a, want_a, rel_tol=tol)
        b_ok = math.isclose(got_b, want_b, rel_tol=tol)
        if a_ok and b_ok:
            report.ok(f"{label}: α and β recovered")
            continue
        hints = []
        swapped = math.isclose(got_a, want_b, rel_tol=tol) and math.isclose(
            got_b, want_a, rel_tol=tol
        )
        bandwidth = bool(got_b) and 0.3 < abs(got_b * want_b) < 3
        if swapped:
            hints.append("You returned (β, α): return (alpha, beta), in that order.")
        elif got_a and 1e2 < abs(got_a / want_a) < 1e7:
            hints.append("Your α looks like µs or ms: return seconds.")
        if swapped:
            pass
        elif bandwidth and a_ok:
            hints.append("Your β is a bandwidth (bytes per second): return β = 1 / bandwidth.")
        elif bandwidth:
            hints.append(
                "Your β is a bandwidth (bytes per second): did you fit sizes against times? "
                "Each row is t = α + β·S divided by t: [1/t, S/t] with right-hand side 1, "
                "which gives α in seconds and β in seconds per byte."
            )
        elif got_b and abs(got_b / want_b) > 1e2:
            hints.append("β is seconds per byte (1 / bandwidth in bytes/s).")
        if not a_ok and b_ok and label.startswith("noisy") and not hints:
            hints.append(
                "The largest messages dominate a plain least-squares fit: weight each "
                "point by 1/t to minimise relative error."
            )
        if not hints:
            hints.append(
                "Each row of the design matrix is [1/t, S/t] and its right-hand side is 1 "
                "(t = α + β·S, divided by t); the solution is (α, β)."
            )
        report.fail(
            f"{label}: got α = {human_seconds(got_a)}, β = {got_b:.3g} s/B; expected "
            f"α ≈ {human_seconds(want_a)}, β ≈ {want_b:.3g} s/B (within {tol:.0%})."
            + "".join(" " + h for h in hints)
        )
    return report
