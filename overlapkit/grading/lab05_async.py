"""Checks for lab 05: an AllReduce overlapped with independent compute, and its timeline.

The learner's step runs on 2 ranks over an emulated link, so that the AllReduce
takes measurable time (about 20 ms for the check's 4 MiB gradient, far more on
a loaded machine). The check hands it a ``compute`` that really computes (matrix
products) for at least ``COMPUTE_S`` and, when it is called while the learner's
AllReduce is in flight, on until that AllReduce has ended and ``MARGIN_S`` more,
whatever the load. So all of it can hide, and a ``wait()`` after ``compute()``
always returns well after the AllReduce's true end. The check watches from the
outside::

    issue ─┬─ RS step ─ AG step ─┐ done            (the kit's own spans: the true end)
           └─ compute() ────────────── margin ─┘ wait()   (the check's compute, the wait)

From those times it says which mistake broke the overlap: ``wait()`` before
``compute()`` (the serial step), the AllReduce started after ``compute()``, a
blocking call (no ``async_op=True``), a handle never waited, the built-in
``dist.all_reduce`` where the kit's op is asked, a gradient reduced twice, or
the wrong thing returned; and, for the timed step, a comm span that does not
end where the AllReduce did (one that runs to ``wait()`` ends after
``compute()``, never at the op's end, also under load).
"""

from __future__ import annotations

from .cases import Case, run_cases
from .lab05_step import COMPUTE_S, LINK, TIMEOUT_S, WORLD, _run
from .mistakes import bypasses_the_link
from .report import Report
from .traffic import shown


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f} ms"


# --------------------------------------------------------------------------- the cases


def _explain(text: str) -> str:
    """A rank's error in the exercise's terms."""
    sep = " " if text.rstrip().endswith((".", "!", "?")) else ". "
    if "'NoneType' object has no attribute 'wait'" in text:
        return sep + (
            "ok.ring_all_reduce returned None: without async_op=True it runs to the end "
            "and returns nothing. Start it with handle = ok.ring_all_reduce(grad, "
            "async_op=True)."
        )
    if "TimeoutError" in text and "wait(timeout" in text:
        return sep + (
            "wait(timeout=...) gave up while the AllReduce was still running (it raises "
            "TimeoutError, the op goes on): call handle.wait() without a timeout here."
        )
    return ""


def _builtin_problem(rank: int, traffic) -> str | None:
    builtins = sorted({c for c in traffic.collectives if not c.startswith("ok.")})
    builtins += sorted(set(traffic.direct))
    if builtins:
        called = ", ".join(shown(name) for name in builtins)
        use = "the kit's op, handle = ok.ring_all_reduce(grad, async_op=True)"
        so = " (and the kit's worker), so there is no AllReduce on the link to overlap or to time"
        return bypasses_the_link(rank, called, use, so)
    others = sorted(
        {c for c in traffic.collectives if c.startswith("ok.")} - {"ok.ring_all_reduce"}
    )
    if others:
        return (
            f"rank {rank} called {', '.join(others)}: this step uses ok.ring_all_reduce(grad, "
            "async_op=True), the kit op that returns a handle"
        )
    return None


def _handle_case(report: Report, results, name: str) -> None:
    """Case 1: the kit op, once, asynchronously, and its handle waited."""
    for rank, (seen, traffic) in enumerate(results):
        problem = _builtin_problem(rank, traffic)
        if problem:
            report.fail(problem)
            return
        calls = seen["calls"]
        if not calls:
            report.fail(
                f"rank {rank} never called ok.ring_all_reduce: start the AllReduce with "
                "handle = ok.ring_all_reduce(grad, async_op=True) before compute()"
            )
            return
        if len(calls) > 1:
            report.fail(
                f"rank {rank} called ok.ring_all_reduce {len(calls)} times: all-reduce the "
                "gradient once (a second AllReduce sums the sums again)"
            )
            return
        if seen["unprobed"] > 0:
            report.fail(
                f"rank {rank} ran {seen['unprobed']} kit collective(s) besides its "
                "ok.ring_all_reduce call, under another name (another module's import of it, "
                "an alias): all-reduce the gradient once, with handle = "
                "ok.ring_all_reduce(grad, async_op=True)"
            )
            return
        call = calls[0]
        if not call["on_grad"]:
            report.fail(
                f"rank {rank} started ok.ring_all_reduce on a tensor that is not grad (a copy, "
                "a part of it, or another tensor): the AllReduce to overlap is the gradient's "
                "own, ok.ring_all_reduce(grad, async_op=True), in place"
            )
            return
        if not call["async"]:
            report.fail(
                f"rank {rank} called ok.ring_all_reduce without async_op=True: it blocked "
                f"for the whole AllReduce ({_ms(call['done'] - call['issued'])}) and returned "
                "None, so nothing could overlap with it. Pass async_op=True and keep the handle"
            )
            return
        if not call["waits"] and call["polled"]:
            report.fail(
                f"rank {rank}: you polled the handle's is_completed() but returned before it "
                f"said True (started at {call['site']}): poll until it does, or call "
                "handle.wait() after compute() and before returning"
            )
            return
        if not call["waits"]:
            state = (
                "was still running: grad did not hold the sum yet"
                if call["running_at_return"]
                else "had ended, but only because this check's compute() goes on until it "
                "has: nothing made the rank wait for it, and after a shorter compute() grad "
                "would not hold the sum yet"
            )
            report.fail(
                f"rank {rank}: you never called wait() on the handle ok.ring_all_reduce "
                f"returned (started at {call['site']}). When {name} returned, the AllReduce "
                f"{state} (the values below are read after the check waited for it itself; "
                "your caller would not). Call handle.wait() after compute() and before "
                "returning (handle.wait without parentheses does not call it)"
            )
            return
    report.ok(
        "each rank started ok.ring_all_reduce(grad, async_op=True) once and waited on its handle"
    )


def _values_case(report: Report, results, name: str) -> None:
    """Case 2: grad holds the sum over ranks; the step returns compute()'s result."""
    for rank, (seen, _) in enumerate(results):
        if seen["grad"] is not None:
            i, want, got, kind = seen["grad"]
            hint = {
                "own": (
                    " grad is still this rank's own gradient everywhere: the AllReduce never "
                    "wrote into it (did it run on a copy, such as grad.clone()?)"
                ),
                "twice": (f" That is {WORLD}× the sum: the gradient was all-reduced twice."),
                "avg": (
                    f" That is the sum divided by {WORLD}: you averaged (op='avg', or a "
                    "division by N); this step keeps the sum (the default op)."
                ),
            }.get(kind, "")
            report.fail(
                f"rank {rank}, element {i} of grad after {name}: expected the sum over ranks "
                f"{want:g}, got {got:g}.{hint}"
            )
            return
    for rank, (seen, _) in enumerate(results):
        runs = len(seen["compute"])
        if runs != 1:
            report.fail(
                f"rank {rank} ran compute() {runs} times: run it exactly once, between "
                "starting the AllReduce and waiting for it"
                if runs
                else f"rank {rank} never called compute(): run it between starting the "
                "AllReduce and waiting for it, and return its result"
            )
            return
        what = seen["returned"]
        if what is not None:
            hint = {
                "None": " Did you forget `return`?",
                "grad": " The AllReduce leaves the sum in grad itself; the step returns the "
                "other result, the one computed while the gradient was on the link.",
                "a Handle": " Wait on the handle; do not return it.",
                "a _TrackedWork": " Wait on the handle; do not return it.",
            }.get(what, "")
            report.fail(
                f"rank {rank}: {name} returned {what}; return the tensor compute() returned." + hint
            )
            return
    report.ok("every rank's grad holds the sum over ranks, and the step returns compute()'s result")


def _overlap_case(report: Report, results, name: str) -> None:
    """Case 3: the AllReduce was in flight while compute() ran."""
    for rank, (seen, _) in enumerate(results):
        calls, runs = seen["calls"], seen["compute"]
        if len(calls) != 1 or not runs:
            what = "no ok.ring_all_reduce" if not calls else f"{len(calls)} ok.ring_all_reduce"
            if not runs:
                what = "no compute()"
            report.fail(f"overlap not measured: rank {rank} ran {what} (see above)")
            return
        call, (c_start, c_end) = calls[0], runs[0]
        issued, done = call["issued"], call["done"]
        if done is None:
            report.fail(f"overlap not measured: rank {rank}'s AllReduce never ran to its end")
            return
        where = (
            f" (rank {rank}: AllReduce {_ms(issued)}–{_ms(done)}, compute() "
            f"{_ms(c_start)}–{_ms(c_end)} after the step began)"
        )
        if not call["async"]:
            report.fail(
                "no overlap: the AllReduce ran synchronously (no async_op=True), so compute() "
                "could only start after it ended" + where
            )
            return
        early = [t for t in call["waits"] if t < c_start]
        if early and call["polled"]:
            report.fail(
                "no overlap: your loop on is_completed() ran before compute(), so the rank "
                f"waited for the whole AllReduce and only then computed: the serial step{where}. "
                "Start the AllReduce, then compute(), then wait (or poll)"
            )
            return
        if early:
            report.fail(
                "no overlap: you called wait() before compute(), so the rank sat idle for the "
                f"whole AllReduce and only then computed: the serial step{where}. Start the "
                "AllReduce, then compute(), then wait()"
            )
            return
        if issued >= c_end:
            report.fail(
                "no overlap: you started the AllReduce after compute() had finished, so "
                f"there was nothing left to hide it behind{where}. Start it first (async_op="
                "True), then compute(), then wait()"
            )
            return
        # No verdict from the share of time the two ran together: every way to serialise
        # them (a blocking call, a wait or a poll before compute(), the issue after it) is
        # named above from the order of events, while on a loaded machine an honest step's
        # AllReduce may end before its compute() begins (the issuing thread got the CPU
        # late) or outlast it many times.
    report.ok("on every rank the AllReduce was in flight while compute() ran")


def _timeline_case(report: Report, results) -> None:
    """Case 4 (timed step): the learner's timeline shows the AllReduce and compute() as
    they really were."""
    for rank, (seen, _) in enumerate(results):
        spans = seen["spans"]
        if spans is None:
            report.fail(f"rank {rank}: the timeline has no spans list (was it replaced?)")
            return
        comm = [(a, b) for _, lane, a, b in spans if lane == "comm"]
        comp = [(a, b) for _, lane, a, b in spans if lane == "compute"]
        if not comm:
            report.fail(
                f"rank {rank}: no span on the 'comm' lane. Record the AllReduce with "
                "handle = timeline.track('all-reduce', ok.ring_all_reduce(grad, async_op=True))"
            )
            return
        if not comp:
            report.fail(
                f"rank {rank}: no span on the 'compute' lane. Put compute() in "
                "`with timeline.span('compute'):`"
            )
            return
        calls, runs = seen["calls"], seen["compute"]
        if len(calls) != 1 or len(runs) != 1 or calls[0]["done"] is None:
            report.fail(f"timeline not judged: rank {rank}'s step is not right yet (see above)")
            return
        call, (c_start, c_end) = calls[0], runs[0]
        issued, done = call["issued"], call["done"]
        tol = 0.003 + 0.1 * (done - issued)
        s_start, s_end = min(a for a, _ in comp), max(b for _, b in comp)
        if s_start > c_start + tol or s_end < c_end - tol or s_start < c_start - 10 * tol:
            report.fail(
                f"rank {rank}: your compute span ({_ms(s_start)}–{_ms(s_end)}) is not where "
                f"compute() ran ({_ms(c_start)}–{_ms(c_end)}): put "
                "`with timeline.span('compute'):` right around the call"
            )
            return
        waits = call["waits"]
        if waits and any(a < waits[0] < b for a, b in comp):
            report.fail(
                f"rank {rank}: you called wait() inside `with timeline.span('compute'):` "
                f"(at {_ms(waits[0])}, in the compute span {_ms(s_start)}–{_ms(s_end)}): the "
                "span then also holds the wait for the AllReduce, so the table counts waiting "
                "as computing and the AllReduce looks hidden even when it is not. Call "
                "handle.wait() after the with block"
            )
            return
        m_start, m_end = min(a for a, _ in comm), max(b for _, b in comm)
        # the kit's own spans (timeline=) begin when the op began on its worker (set
        # whenever "done" is: both come from the op's steps)
        copy_s, copy_back_s = call["guard_s"]
        # the learner tracks the handle once the call has returned: on a loaded machine
        # (and with the guard's copies) that is later than the issue began
        returned = call["returned"]
        # and the thread that calls track() may wait for the GIL (5 ms a switch, longer
        # beside a hog) while the op's worker starts: a span begun before compute() was
        # called is tracked in time; a late track() begins after compute() ran
        latest = max(returned + tol + copy_s, c_start + tol)
        off = not issued - tol <= m_start <= latest and abs(m_start - call["began"]) > tol
        # a span that starts late (tracked after compute()) is named for its start; one
        # opened before the call and closed at wait() for its end: its start is early by
        # however long the loaded machine took to issue the op (8.7 ms beside a CPU hog
        # in fresh-clone run 50), and the wait() is the mistake, named alike on any load
        problem = _comm_end_problem(seen, call, (c_start, c_end), (m_start, m_end), tol)
        if problem and not (off and m_start > latest):
            report.fail(f"rank {rank}: {problem}")
            return
        if off:
            report.fail(
                f"rank {rank}: your comm span starts at {_ms(m_start)}, but the AllReduce "
                f"was started at {_ms(issued)}: call timeline.track(...) on the handle as "
                "soon as ok.ring_all_reduce returns it"
            )
            return
    report.ok(
        "the timeline shows the AllReduce on the comm lane from its start to its true end, "
        "and compute() on the compute lane where it ran"
    )


def _comm_end_problem(seen, call, compute_run, comm_span, tol: float) -> str | None:
    """What is wrong with where the learner's comm span ends, or None.

    When compute() was called while the AllReduce was in flight, it went on until the
    op had ended, every callback on its future had run (``held``: a span that
    ``Timeline.track`` or the kit's ``timeline=`` records ends by then) and ``MARGIN_S``
    more. A span that ends at ``wait()``, or anywhere after compute(), therefore ends at
    least the margin after ``held``: the verdict does not hang on how long the load made
    the AllReduce. When the op had ended before compute() began (the rank got the CPU
    late), such a span ends after compute() too, and the true end lay before it.
    Otherwise (an op started after compute()), the span may end after the op's true
    end by the tolerance and the read guard's copy back."""
    (c_start, c_end), (m_start, m_end) = compute_run, comm_span
    issued, done, held = call["issued"], call["done"], seen["held"][0]
    copy_back_s = call["guard_s"][1]
    waits = call["waits"]
    if m_end < done - tol:
        at_return = abs(m_end - call["returned"]) <= tol
        how = (
            "when ok.ring_all_reduce returned, which it does at once, while the AllReduce "
            "goes on in the background"
            if at_return
            else "before it"
        )
        return (
            f"your comm span ends at {_ms(m_end)}, but the AllReduce finished at {_ms(done)}: "
            f"the span ends {how}. Its end must be the op's: Timeline.track(name, handle) "
            "takes it from the op's future (help(ok.Timeline.track))"
        )
    if held is not None:
        late = m_end > (held + c_end) / 2
    elif done <= c_start:  # on a loaded machine: the rank came to compute() after the op
        late = m_end > (c_start + c_end) / 2
    else:
        late = m_end - done > tol + copy_back_s
    if not late:
        return None
    when = "when wait() returned" if waits and m_end >= waits[-1] else "after compute() returned"
    hidden = c_start <= done < c_end
    during = (
        f"while compute() was still running ({_ms(c_start)}–{_ms(c_end)})"
        if hidden
        else f"before compute() ran ({_ms(c_start)}–{_ms(c_end)})"
    )
    counts = "the compute the AllReduce hid behind" if hidden else "what the rank did after it"
    return (
        f"your comm span ends at {_ms(m_end)}, {when}, but the AllReduce had finished at "
        f"{_ms(done)}, {_ms(m_end - done)} earlier, {during}. A span up to there counts "
        f"{counts} as communication: T_comm reads "
        f"{_ms(m_end - m_start)} where the AllReduce took {_ms(done - issued)}, and a step "
        "would look the same whether its AllReduce took a tenth of compute() or all of it. "
        "wait() cannot tell you when the op ended; its future can: Timeline.track(name, "
        "handle) records the end from it (help(ok.Timeline.track))"
    )


def _check(name: str, fn, timed: bool, timeout: float, compute_s: float) -> Report:
    report = Report(name)
    from ..launcher import dumps_keeping_filenames  # noqa: PLC0415

    # the kit's answers are watched in the untimed check only (grading.exercises): a watch
    # slows each Python call
    case = Case(
        f"{name} on {WORLD} ranks",
        WORLD,
        _run,
        (dumps_keeping_filenames(fn), timed, compute_s, timeout / 3),
        lambda _: True,
    )
    check = "check_timed_step" if timed else "check_overlapped_step"
    results = run_cases(report, check, [case], timeout=timeout, link=LINK, explain=_explain)
    if results is None:
        return report
    _handle_case(report, results, name)
    _values_case(report, results, name)
    _overlap_case(report, results, name)
    if timed:
        _timeline_case(report, results)
    return report


def check_overlapped_step(overlapped_step, timeout: float = TIMEOUT_S,
                          compute_s: float = COMPUTE_S) -> Report:  # fmt: skip
    """Check ``overlapped_step(grad, compute) -> compute()'s result`` on 2 ranks.

    The step must start ``ok.ring_all_reduce(grad, async_op=True)``, run
    ``compute()`` while the AllReduce crosses the link, wait on the handle and
    return what ``compute()`` returned. Three cases: the op and its handle, the
    values (grad summed over ranks, the result returned), and the overlap (the
    AllReduce in flight while ``compute()`` ran).
    """
    name = getattr(overlapped_step, "__name__", "overlapped_step")
    return _check(name, overlapped_step, False, timeout, compute_s)


def check_timed_step(timed_step, timeout: float = TIMEOUT_S,
                     compute_s: float = COMPUTE_S) -> Report:  # fmt: skip
    """Check ``timed_step(grad, compute, timeline)``: the overlapped step, recorded.

    As :func:`check_overlapped_step`, and a fourth case: the timeline must hold
    the AllReduce on the "comm" lane from its start to its true end (not to the
    ``wait()`` that came later) and ``compute()`` on the "compute" lane. The
    check's ``compute()`` goes on until ``MARGIN_S`` after the AllReduce ended,
    so a span up to ``wait()`` is told apart from the true end on any load.
    """
    name = getattr(timed_step, "__name__", "timed_step")
    return _check(name, timed_step, True, timeout, compute_s)
