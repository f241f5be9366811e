"""Checks for lab 00: the ping-pong measurement and the α-β fit."""

from __future__ import annotations

import math
import random
import statistics

from ..costmodel import fit_alpha_beta as reference_fit
from ..pingpong import ping_pong as reference_ping_pong
from ..sandbox import answers
from ..sandbox.sealed import seal
from .cases import Case, count_not_reached, run_cases, stop_at
from .common import human_bytes, human_seconds, plain_number, run_or_report
from .exercises import answers_of
from .report import Report

#: a reported one-way time passes when it is within this factor of a one-way statistic
#: (median or mean, with or without the first round trips as warm-up) of the very round
#: trips the learner's function made, timed by the check as they ran: the same messages,
#: so the machine's noise cancels. A round trip (2×), a total, or half a one-way time
#: lies nearer to a wrong candidate than to a right one.
PING_PONG_TOLERANCE = 1.15
#: calls of the learner's function judged; the verdict is the majority's. A call whose
#: value is near both a right and a wrong candidate (its round trips so skewed that, say,
#: half their mean is their median) decides nothing, and another call is made, up to
#: TIMING_CALLS_MAX: skewed samples neither fail an honest answer nor pass a wrong one.
TIMING_CALLS = 3
TIMING_CALLS_MAX = 6
#: one-way statistics a learner may report, and what other reports are
_RIGHT = ("median", "mean")
_WRONG = {
    "round trip": (2.0, " Did you return the round-trip time instead of half of it?"),
    "half": (0.5, " Did you halve a one-way time (time only the send, or divide by 4)?"),
    "milliseconds": (1e3, " Did you return milliseconds? Return seconds."),
    "microseconds": (1e6, " Did you return microseconds? Return seconds."),
}


_TOTAL_HINT = " Did you return the total over all iterations instead of the median of one?"


@answers.between_blocks
def _interleaved(student_fn, nbytes, iters, rounds):
    """On each rank: student, kit, student, kit... at one size; the per-round times
    (the fallback judgement when the check could not time the learner's messages)."""
    import overlapkit as ok

    student, kit = [], []
    for _ in range(rounds):
        # the learner's call under the watch (the kit's answers refuse to run), the kit's not
        with answers.running(answers_of("check_ping_pong")) as ran:
            student.append(student_fn(nbytes, iters))
        if ran:
            raise answers.AnswerRan.on(ok.rank(), ran)
        kit.append(reference_ping_pong(nbytes, iters=iters, warmup=1))
    if ok.rank() != 0:
        return None
    return student, kit


def round_trips(timed, peer: int = 1) -> list[float]:
    """Rank 0's one-way times, one per round trip: (end of the k-th receive from ``peer``
    − start of the k-th send to it) / 2, from the recorder's message times."""
    sends = [start for call, p, start, _ in timed if "send" in call and p == peer]
    ends = [end for call, p, _, end in timed if "recv" in call and p == peer]
    return [(e - s) / 2 for s, e in zip(sends, ends, strict=False) if e is not None and e > s]


def loop_spans(timed, peer: int = 1) -> list[float]:
    """One-way times of the whole loop, as a learner who times the loop once gets them:
    (end of the last receive − start of the k-th send) / (2 × the round trips after it),
    for k = 0, 1, 2 (warm-ups left out); the gaps between round trips count, as they do in
    such a learner's clock (a loaded machine makes them long)."""
    sends = [start for call, p, start, _ in timed if "send" in call and p == peer]
    ends = [end for call, p, _, end in timed if "recv" in call and p == peer and end is not None]
    if not sends or not ends:
        return []
    n = min(len(sends), len(ends))
    return [(ends[n - 1] - sends[k]) / (2 * (n - k)) for k in range(min(3, n))
            if ends[n - 1] > sends[k]]  # fmt: skip


def candidates(samples: list[float], spans: list[float] = ()) -> dict[str, float]:
    """What a right answer may be (name -> seconds), and what each mistake gives."""
    right = {f"loop{skip}": span for skip, span in enumerate(spans)}
    for skip in range(min(3, len(samples))):
        kept = samples[skip:]
        right[f"median{skip}"] = statistics.median(kept)
        right[f"mean{skip}"] = statistics.fmean(kept)
    wrong = {f"{name}:{k}": v * factor for name, (factor, _) in _WRONG.items()
             for k, v in right.items()}  # fmt: skip
    for skip in range(min(3, len(samples))):
        wrong[f"total:{skip}"] = sum(samples[skip:])
        wrong[f"total round trips:{skip}"] = 2 * sum(samples[skip:])
    return {**right, **wrong}


def judge_one_way(value: float, samples: list[float],
                  spans: list[float] = ()) -> tuple[bool | None, str]:  # fmt: skip
    """(right?, nearest candidate's name) for a reported one-way time; right? is None when
    the value is within tolerance of both a right and a wrong candidate (undecided)."""
    found = candidates(samples, spans)

    def distance(name):
        return abs(math.log(value / found[name]))

    name = min(found, key=distance)
    band = math.log(PING_PONG_TOLERANCE)
    near_right = any(distance(k) <= band for k in found if ":" not in k)
    near_wrong = any(distance(k) <= band for k in found if ":" in k)
    if near_right and near_wrong:
        return None, name
    return near_right, name


def _ratio_hint(ratio: float) -> str:
    """The mistake a ratio (learner's one-way time ÷ the right one) points to."""
    if 1.45 < ratio < 3.0:
        return _WRONG["round trip"][1]
    if 300 < ratio < 3000:
        return _WRONG["milliseconds"][1]
    if 3e5 < ratio < 3e6:
        return _WRONG["microseconds"][1]
    if 3.0 <= ratio <= 50:
        return _TOTAL_HINT
    if 0.3 < ratio < 0.7:
        return _WRONG["half"][1]
    if ratio <= 0.3:
        return " Do you time the whole round trip, both send and recv?"
    return ""


def _mistake_hint(wrong: list[str], ratio: float) -> str:
    """The hint for the mistake most calls' values sat nearest. Candidates are counted by
    kind ("round trip:median0" and "round trip:loop1" are one mistake): counted by full name,
    three calls nearest three different round-trip candidates and one nearest a total
    split the vote, and a loaded run named the total. A tie goes to the ratio's hint."""
    kinds = [name.split(":")[0] for name in wrong]
    kinds = ["total" if kind.startswith("total") else kind for kind in kinds]
    hints = {kind: _WRONG[kind][1] if kind in _WRONG else _TOTAL_HINT for kind in kinds}
    if not kinds:
        return _ratio_hint(ratio)
    most = max(map(kinds.count, kinds))
    tied = [hints[kind] for kind in dict.fromkeys(kinds) if kinds.count(kind) == most]
    return _ratio_hint(ratio) if len(tied) > 1 and _ratio_hint(ratio) in tied else tied[0]


def check_ping_pong(ping_pong, timeout: float = 10.0) -> Report:
    """Check a learner's ``ping_pong(nbytes, iters) -> one-way seconds on rank 0``.

    Runs it on 2 ranks and checks (1) the messages: each iteration sends
    ``nbytes`` from rank 0 to rank 1 and back; (2) the value: seconds, finite,
    positive, one-way; (3) it agrees with the round trips the function made, timed by
    the check as they ran (the median or mean of their halves, not twice that).
    """
    report = Report("ping_pong")
    iters = 8
    cases = [_case(report, ping_pong, nbytes, iters) for nbytes in (8, 1 << 20)]
    # the kit's ping-pong, whatever its name, refuses to run (not in the timed calls
    # below: a watch slows each Python call a little)
    if run_cases(report, "check_ping_pong", cases, timeout=timeout) is None:
        # the timing would only echo what is wrong above: not reached, it counts as failed
        count_not_reached(report, [f"{human_bytes(4 << 20)}: the one-way time"])
        return report

    # One-way, not round trip: compare with the kit, interleaved, at a size where
    # bandwidth dominates; per-round ratios, medians, and a second attempt only when
    # the first lands between the band and the next mistake.
    _check_timing(report, ping_pong, timeout)
    return report


def _case(report: Report, ping_pong, nbytes: int, iters: int) -> Case:
    """(1) the messages and (2) the value, at ``nbytes``."""

    def judge(results) -> bool:
        (value, t0), (_, t1) = results
        size = human_bytes(nbytes)
        messages_right = _check_messages(report, size, nbytes, iters, t0, t1)
        return _check_value(report, size, value) and messages_right

    return Case(f"ping_pong({nbytes}, {iters})", 2, ping_pong, (nbytes, iters), judge)


def _check_timing(report: Report, ping_pong, timeout: float) -> None:
    """Judge the reported time against the same call's own messages, timed as they ran."""
    nbytes, iters, size = 4 << 20, 8, human_bytes(4 << 20)
    verdicts, values, samples = [], [], []
    for _ in range(TIMING_CALLS_MAX):
        results = run_or_report(report, f"ping_pong({nbytes}, {iters})", ping_pong, nbytes,
                                iters, world_size=2, timeout=max(timeout, 30.0),
                                forbid=answers_of("check_ping_pong"))  # fmt: skip
        if results is None:
            return
        value, traffic = results[0]
        trips = round_trips(traffic.timed)
        if not plain_number(value) or value <= 0 or len(trips) < iters // 2:
            return _check_timing_against_kit(report, ping_pong, timeout)
        verdicts.append(judge_one_way(float(value), trips, loop_spans(traffic.timed)))
        values.append(float(value))
        samples.append(statistics.median(trips))
        if sum(right is not None for right, _ in verdicts) >= TIMING_CALLS:
            break
    decided = [(right, name) for right, name in verdicts if right is not None]
    if not decided:  # every call undecided: the nearest candidate speaks
        decided = [(":" not in name, name) for _, name in verdicts]
    verdicts = decided
    passed = sum(right for right, _ in verdicts)
    ratio = statistics.median(v / m for v, m in zip(values, samples, strict=True))
    if passed * 2 > len(verdicts):
        report.ok(f"{size}: the one-way time agrees with your own messages, timed as they ran")
        return
    hint = _mistake_hint([name for right, name in verdicts if not right], ratio)
    report.fail(
        f"{size}: your one-way time is {ratio:.2f}× the median one-way time of the round trips "
        f"your function made, as the check timed them (median of {len(values)} calls: yours "
        f"{human_seconds(statistics.median(values))}, the messages' "
        f"{human_seconds(statistics.median(samples))}).{hint}"
    )


def _check_timing_against_kit(report: Report, ping_pong, timeout: float) -> None:
    """When the learner's messages could not be timed (no send/recv the check sees):
    compare with the kit's own measurement, interleaved, per-round ratios."""
    nbytes, size = 4 << 20, human_bytes(4 << 20)
    ratios, student_times, kit_times = [], [], []
    for attempt in range(2):
        results = run_or_report(report, f"ping_pong({nbytes}, 5)", _interleaved, ping_pong,
                                nbytes, 5, 9, world_size=2,
                                timeout=max(timeout, 30.0))  # fmt: skip
        if results is None:
            return
        student, kit = results[0][0]
        student_times += student
        kit_times += kit
        ratios += [s / k for s, k in zip(student, kit, strict=True)]
        ratio = statistics.median(ratios)
        if 0.7 <= ratio <= 1.45:
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
    if not plain_number(value):  # a subclass's arithmetic could agree with any time
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


def link_scale() -> float:
    """The factor of a fit check's link: 0.6-0.9 or 1.1-1.6, drawn afresh (never near 1, so
    the lab's own 20 µs and 2 GB/s are off by 10% at least: the check wants 1%)."""
    rng = random.SystemRandom()
    return rng.uniform(0.6, 0.9) if rng.random() < 0.5 else rng.uniform(1.1, 1.6)


def _fit_inputs() -> tuple[list[int], list[float], list[float]]:
    """The sizes, and the times of the lab's link (20 µs, 2 GB/s) slowed or sped up by a
    factor drawn for this run, exact and with ±15% noise: a pair returned without fitting
    (the lab's numbers, say) cannot match them, while every fit's relative error, and so
    which mistake it shows, stays what it is at 1× (times × k give α × k and β × k)."""
    scale = link_scale()
    alpha, beta = 20e-6 * scale, scale / 2e9
    sizes = [8 * 4**k for k in range(12)]  # 8 B .. 32 MB
    exact = [alpha + beta * s for s in sizes]
    rng = random.Random(0)
    return sizes, exact, [t * rng.uniform(0.85, 1.15) for t in exact]


def check_fit_alpha_beta(fit_alpha_beta) -> Report:
    """Check a learner's ``fit_alpha_beta(sizes, times) -> (alpha_s, beta_s_per_byte)``."""
    report = Report("fit_alpha_beta")
    fit_alpha_beta = seal(fit_alpha_beta)  # called on a rank of its own, out of our reach
    sizes, exact, noisy = _fit_inputs()
    cases = [("measurements on the line", exact, 0.01), ("noisy measurements (±15%)", noisy, 0.35)]
    for k, (label, times, tol) in enumerate(cases):
        later = [name for name, _, _ in cases[k + 1 :]]  # not reached if this case fails
        try:
            with answers.running(answers_of("check_fit_alpha_beta")) as ran:
                got = fit_alpha_beta(list(sizes), list(times))
        except NotImplementedError:
            return stop_at(report, f"{label}: not implemented yet (the function still raises "
                           "NotImplementedError)", later)  # fmt: skip
        except Exception as exc:
            return stop_at(report, f"{label}: raised {type(exc).__name__}: {exc}", later)
        if ran:
            return stop_at(report, f"{label}: your function {answers.said(ran)}", later)
        # what the times come to, worked out only now (the link's α and β are nowhere in
        # this process while the learner's function runs): on the line, the link itself
        want_a, want_b = reference_fit(sizes, times)
        try:
            got_a, got_b = (float(x) for x in got)
        except (TypeError, ValueError):
            return stop_at(report, f"{label}: returned {got!r}; expected a pair (alpha, beta) "
                           "of floats", later)  # fmt: skip
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
