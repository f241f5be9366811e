"""Checks for lab 08: a 1F1B schedule generator, and an overlapped two-stage GPipe step."""

from __future__ import annotations

import io
import re
import secrets
import time

import torch

from .. import handles
from ..pipeline import make_schedule
from ..plans import PIPELINE, PlanSyntaxError
from ..sandbox import answers
from ..sandbox.sealed import seal
from .cases import count_not_reached, not_reached
from .common import Unfinished, call_or_report, run_or_report
from .exercises import answers_of
from .lab03_collectives import CHECK_LINK
from .report import Report

SCHEDULE_CASES = [(2, 4), (2, 1), (3, 4), (4, 6), (4, 2), (2, 7)]
#: check_gpipe_step's last case, named on its ✘ line when an earlier case failed
OVERLAP = "overlap (rank 0's sends in flight during its next forwards, nothing blocking)"


def _as_strings(plan) -> list[list[str]] | None:
    if not isinstance(plan, (list, tuple)) or not all(isinstance(s, (list, tuple)) for s in plan):
        return None
    return [list(stage) for stage in plan]


def check_1f1b_schedule(one_f_one_b) -> Report:
    """Check ``one_f_one_b(stages, micro_batches)`` → per stage a list like ["F0", "F1", "B0", …]
    against the textbook 1F1B order (warm-up forwards, one forward one backward, drain)."""
    report = Report("1f1b_schedule")
    one_f_one_b = seal(one_f_one_b)  # called on a rank of its own, out of our reach
    # the cases are called quietly first: lists the kit's own code made earn nothing
    quiet = Report(report.exercise, file=io.StringIO())
    with answers.running(answers_of("check_1f1b_schedule")) as ran:
        plans = _plans(quiet, one_f_one_b)
    if ran:
        report.fail(f"your function {answers.said(ran)}")
        return report
    # the wanted schedules only now: none is anywhere in this process while the learner's
    # function runs (a function that read the check's frames found them there)
    for case in plans:
        if isinstance(case, tuple):
            _judge_schedule(report, *case)
        else:
            (report.ok if case[0] else report.fail)(case[1])
    return report


def _plans(quiet: Report, one_f_one_b) -> list:
    """Call the learner's function for each case, in order: (p, m, what, plan) for a call
    that returned, its ✘ line ([passed, message], from ``quiet``) for one that did not."""
    plans = []
    for p, m in SCHEDULE_CASES:
        what = _what(p, m)
        try:
            ran, plan = call_or_report(quiet, what, one_f_one_b, p, m)
        except Unfinished:
            plans.append(list(quiet.cases[-1]))
            rest = SCHEDULE_CASES[len(plans) :]  # not reached: each counts as failed
            plans += [[False, not_reached(_what(p, m))] for p, m in rest]
            break
        plans.append((p, m, what, plan) if ran else list(quiet.cases[-1]))
    return plans


def _what(p: int, m: int) -> str:
    return f"{p} stages, {m} micro-batch{'es' if m > 1 else ''}"


def _judge_schedule(report: Report, p: int, m: int, what: str, plan) -> None:
    # compared as written: the exercise asks for exactly these strings ("F0", not "F 0")
    want = [PIPELINE.texts(stage) for stage in make_schedule("1f1b", p, m)]
    got = _as_strings(plan)
    if got is None:
        report.fail(f"{what}: return one list of actions per stage, e.g. [['F0', 'B0'], …]")
        return
    odd = next((a for stage in got for a in stage if not isinstance(a, str)), None)
    if odd is not None:
        report.fail(
            f"{what}: the actions must be strings like 'F0' and 'B3'; got {odd!r} "
            f"({type(odd).__name__})"
        )
        return
    if len(got) != p:
        report.fail(f"{what}: {len(got)} lists; one per stage makes {p}")
        return
    bad = next((s for s in range(p) if got[s] != want[s]), None)
    if bad is None:
        report.ok(f"{what}: " + " | ".join(" ".join(stage) for stage in want))
        return
    g, w = got[bad], want[bad]
    i = next((i for i in range(min(len(g), len(w))) if g[i] != w[i]), min(len(g), len(w)))
    report.fail(
        f"{what}, stage {bad}: got {' '.join(g)}; expected {' '.join(w)} (first difference "
        f"at position {i}: {_at(g, i)} where {_at(w, i)} belongs)."
        + _schedule_hint(g, w, bad, p, m)
    )
    report._print(f"    stage {bad}: {PIPELINE.mark(g, i)}")  # that position in brackets


def _at(actions, i) -> str:
    return actions[i] if i < len(actions) else "nothing"


def _read(text: str):
    """The action ``text`` is ("F0", "B3"), or None."""
    try:
        return PIPELINE.parse_step(text)
    except PlanSyntaxError:
        return None


def _first_backward(actions) -> int:
    return next((i for i, a in enumerate(actions) if getattr(_read(a), "op", "") == "B"),
                len(actions))  # fmt: skip


def _schedule_hint(got, want, s, p, m) -> str:
    if sorted(got) != sorted(want):
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        beyond = [a for a in extra if getattr(_read(a), "micro", -1) >= m]
        return (
            " Every stage runs F and B of each micro-batch exactly once"
            + (f"; missing {missing}" if missing else "")
            + (f"; not expected {extra}" if extra else "")
            + (
                f" — there are only {_count(m, 'micro-batch')} (0 to {m - 1}): no stage runs "
                "more forwards than that, however many stages follow it"
                if beyond
                else ""
            )
            + "."
        )
    ran, right = _first_backward(got), _first_backward(want)
    after = p - s - 1
    if ran != right and after == 0:
        return (
            f" Stage {s} ran {_count(ran, 'forward')} before its first backward; 1F1B runs "
            f"{right} here: stage {s} is the last, so each micro-batch's backward can follow "
            "its forward at once (as in the drawn schedule's last stage)."
        )
    if ran != right:
        # the reason, with this case's numbers, not the formula: the learner derives that
        # from the drawn schedule
        where = f"stage {s} of {p} has {_count(after, 'stage')} after it, and there are {m}"
        return f" Stage {s} ran {_count(ran, 'forward')} before its first backward; 1F1B runs " + (
            f"{right} here ({where}): that many keep the stages after it busy; more only "
            "hold more activations. Count them in the drawn schedule, on a stage with "
            f"{_count(after, 'stage')} after it."
            if ran > right
            else f"{right} here ({where}): with fewer, the stages after it wait for work; "
            "each steady step runs its forward first, then the oldest backward."
        )
    return (
        " After the warm-up, alternate: one forward, then one backward (the oldest "
        "micro-batch first), and drain the remaining backwards at the end."
    )


# --------------------------------------------------------------------------- the step

ACT = 16  # the activation's features between the stages
BATCH = 10


def _stages():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, ACT), torch.nn.Tanh(), torch.nn.Linear(ACT, ACT), torch.nn.Tanh(),
        torch.nn.Linear(ACT, 3),
    )  # fmt: skip
    return model, model[:2], model[2:]


class _Watch:
    """Wraps ``ok.p2p``'s sends and receives while the learner's step runs: when each send
    started and was waited, which were blocking, and how the receives were made."""

    def __init__(self):
        self.sends: list[dict] = []
        self.recvs: list[dict] = []

    def __enter__(self):
        from .. import p2p  # noqa: PLC0415

        self._p2p = p2p
        self._orig = (p2p.isend, p2p.send, p2p.irecv, p2p.recv)
        watch = self

        def isend(tensor, dst, group=None):
            handle = watch._orig[0](tensor, dst, group)
            entry = {"start": time.perf_counter(), "waited": None, "blocking": False,
                     "rows": _rows(tensor)}  # fmt: skip
            watch.sends.append(entry)

            def wait(inner, timeout=None):
                result = inner(timeout)
                if entry["waited"] is None:
                    entry["waited"] = time.perf_counter()
                return result

            # seen however the learner waits (handle.wait(), type(handle).wait(handle))
            return handles.wrap_wait(handle, wait)

        def send(tensor, dst, group=None):
            start = time.perf_counter()
            watch._orig[0](tensor, dst, group).wait()
            watch.sends.append({"start": start, "waited": time.perf_counter(), "blocking": True,
                                "rows": _rows(tensor)})  # fmt: skip

        def irecv(tensor, src, group=None):
            watch.recvs.append({"posted": time.perf_counter(), "blocking": False,
                                "rows": _rows(tensor)})  # fmt: skip
            return watch._orig[2](tensor, src, group)

        def recv(tensor, src, group=None):
            watch.recvs.append({"posted": time.perf_counter(), "blocking": True,
                                "rows": _rows(tensor)})  # fmt: skip
            watch._orig[2](tensor, src, group).wait()

        p2p.isend, p2p.send, p2p.irecv, p2p.recv = isend, send, irecv, recv
        return self

    def __exit__(self, *exc):
        self._p2p.isend, self._p2p.send, self._p2p.irecv, self._p2p.recv = self._orig


def _rows(tensor) -> int | None:
    return tensor.shape[0] if isinstance(tensor, torch.Tensor) and tensor.dim() else None


def _batch(seeds: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's inputs and targets, from the seeds the checking process drew: rank 0 is
    given the first only, rank 1 the second, so neither can rebuild the other's half."""
    x = torch.randn(BATCH, 6, generator=torch.Generator().manual_seed(seeds[0]))
    y = torch.randn(BATCH, 3, generator=torch.Generator().manual_seed(seeds[1]))
    return x, y


def _run_step(gpipe_step, m, seed):
    """On each rank: its stage and its half of the data only (``seed``: rank 0's inputs,
    rank 1's targets); what is wanted is worked out by the checking process (:func:`_wants`),
    so that nothing on this rank's stack holds the answer."""
    import overlapkit as ok  # noqa: PLC0415

    me = ok.rank()
    _, first, second = _stages()
    gen = torch.Generator().manual_seed(seed)
    mine = torch.randn(BATCH, 6 if me == 0 else 3, generator=gen)
    del seed, gen
    stage = first if me == 0 else second
    handles.take_unwaited()
    computes = []
    original_forward = stage.forward

    def timed_forward(inp):
        start = time.perf_counter()
        out = original_forward(inp)
        computes.append((start, time.perf_counter()))
        return out

    stage.forward = timed_forward
    with _Watch() as watch:
        gpipe_step(stage, mine if me == 0 else None, mine if me == 1 else None, m)
    got = [None if p.grad is None else p.grad.clone() for p in stage.parameters()]
    names = [n for n, _ in stage.named_parameters()]
    return {"got": got, "names": names, "sends": watch.sends, "recvs": watch.recvs,
            "computes": computes, "unwaited": handles.take_unwaited()}  # fmt: skip


def _wants(results, m: int, seeds: tuple[int, int]) -> None:
    """In the checking process: each rank's wanted gradients (one device, the whole batch),
    and what two common weighting mistakes give: each micro-batch's mean added as it is,
    or divided by m (right only when every micro-batch has the same size)."""
    with torch.random.fork_rng(devices=[]):  # _stages seeds torch: not the notebook's
        model, first, second = _stages()
    x, y = _batch(seeds)
    sizes = [len(c) for c in torch.tensor_split(y, m)]
    for (res, _), part in zip(results, (first, second), strict=True):
        res["want"] = _grads(model, part, x, y, [len(y)])
        res["unweighted"] = _grads(model, part, x, y, sizes)
        res["by_m"] = [g / m for g in res["unweighted"]]


def _grads(model, part, x, y, sizes) -> list[torch.Tensor]:
    """``part``'s gradients of the sum over micro-batches (of ``sizes``) of each one's mean
    loss: one micro-batch of the whole batch is the right answer."""
    model.zero_grad()
    loss = sum(
        torch.nn.functional.mse_loss(model(xs), ys)
        for xs, ys in zip(torch.split(x, sizes), torch.split(y, sizes), strict=True)
    )
    loss.backward()
    grads = [p.grad.clone() for p in part.parameters()]
    model.zero_grad()
    return grads


def check_gpipe_step(gpipe_step, micro_batches: int = 4, timeout: float = 30.0) -> Report:
    """Check ``gpipe_step(stage, inputs, targets, micro_batches)`` on 2 ranks, for m = 1,
    ``micro_batches`` and a count that does not divide the batch: the messages the
    exercise defines (m activations of about batch/m rows out, m gradients back; the batch
    of 10 is no square, so chunks *of* m rows never come out as m chunks), the gradients
    against one device on the whole batch; then that rank 0's activation sends overlap its
    next forward. The check stops at its first failure; the cases after it count as not
    passed ("not reached"), so the score is out of all 4."""
    report = Report("gpipe_step")
    counts = (1, micro_batches, 3)
    whats = [f"gpipe_step with {m} micro-batch(es) on 2 ranks" for m in counts] + [OVERLAP]
    for n, m in enumerate(counts):
        seeds = (secrets.randbits(62), secrets.randbits(62))
        later = whats[n + 1 :]  # the cases not reached when this one fails: count as failed
        results = run_or_report(report, whats[n],
                                _run_step, gpipe_step, m, world_size=2, timeout=timeout,
                                link=CHECK_LINK, explain=_explain,
                                forbid=answers_of("check_gpipe_step"),
                                rank_kwargs=[{"seed": seed} for seed in seeds])  # fmt: skip
        if results is None:
            count_not_reached(report, later)
            return report
        _wants(results, m, seeds)
        for rank, (_, traffic) in enumerate(results):
            if traffic.direct:
                called = ", ".join(sorted(set(traffic.direct)))
                report.fail(
                    f"rank {rank} called {called}: use ok.p2p.isend / irecv / send / recv — "
                    "only the kit's messages go over the emulated link (and only they are "
                    "seen here)"
                )
                count_not_reached(report, later)
                return report
        counted = _counted(report, results, m)
        if counted is None or not _compare(report, results, m, counted):
            count_not_reached(report, later)
            return report
    sends = results[0][0]["sends"]
    computes = results[0][0]["computes"]
    unwaited = results[0][0]["unwaited"] + results[1][0]["unwaited"]
    if unwaited:
        report.fail(
            f"{len(unwaited)} send(s) or receive(s) never waited, e.g. {unwaited[0]}: wait for "
            "every handle before the step returns (a send's tensor must stay alive until sent)"
        )
        return report
    if any(s["blocking"] for s in sends) or not sends:
        report.fail(
            "rank 0 sent its activations with a blocking ok.p2p.send: each forward waits until "
            "the previous activation has crossed the link. Start them with ok.p2p.isend, keep "
            "the handles, and wait for them after the last forward"
        )
        return report
    # a send overlaps the next forward if it was waited only after that forward began
    overlapped = sum(
        1 for k, s in enumerate(sends[:-1])
        if k + 1 < len(computes) and (s["waited"] or float("inf")) > computes[k + 1][0]
    )  # fmt: skip
    if overlapped == 0:
        report.fail(
            "rank 0 waited for each activation's send before the next forward: nothing "
            "overlaps. Wait for the sends after the last forward (before the backwards)"
        )
        return report
    rank1 = results[1][0]
    if any(r["blocking"] for r in rank1["recvs"]):
        report.fail(
            "rank 1 received the activations with blocking ok.p2p.recv, one at a time: post "
            "every receive first with ok.p2p.irecv, so that each arrives while rank 1 computes "
            "the one before"
        )
        return report
    if any(s["blocking"] for s in rank1["sends"]):
        report.fail(
            "rank 1 sent the gradients back with a blocking ok.p2p.send: each backward waited "
            "for the previous gradient to cross the link. Use ok.p2p.isend and wait at the end"
        )
        return report
    report.ok(
        f"rank 0's {len(sends)} activation sends were in flight during its next forwards; "
        f"rank 1 posted its {len(rank1['recvs'])} receives ahead and sent its gradients "
        "without blocking; every one waited"
    )
    return report


def _counted(report: Report, results, m: int) -> str | None:
    """The messages the exercise defines, counted: rank 0 sends m activations of about
    batch/m rows each (``torch.tensor_split(inputs, m)``), rank 1 sends m gradients back.
    Returns a description for the ✔ line, or None after a ✘ line."""
    sends0, sends1 = results[0][0]["sends"], results[1][0]["sends"]
    rows = [s["rows"] for s in sends0]
    want = [len(c) for c in torch.tensor_split(torch.arange(BATCH), m)]
    most = -(-BATCH // m)  # ⌈batch / m⌉
    shown = ", ".join(map(str, rows))
    fix = (
        f"torch.tensor_split(inputs, {m}) makes the {m} micro-batch{'es' if m > 1 else ''} "
        f"({', '.join(map(str, want))} rows)"
    )
    if len(rows) != m:
        if rows == [len(c) for c in torch.split(torch.arange(BATCH), m)]:
            why = (
                f"torch.split(x, {m}) cuts chunks OF {_count(m, 'row')} ({len(rows)} of them), "
                f"not {_count(m, 'chunk')}: {fix}"
            )
        elif len(rows) == 1:
            why = (
                "The whole batch went as one micro-batch, as if micro_batches were 1: split "
                f"it into micro_batches pieces — {fix} — and send one activation per piece"
            )
        elif not rows:
            why = f"send each micro-batch's output with ok.p2p.isend; {fix}"
        else:
            why = f"one activation per micro-batch: {fix}"
        report.fail(
            f"m={m}: rank 0 sent {_count(len(rows), 'activation')} ({shown or 'none'} rows) "
            f"where micro_batches={m} asks for {m}, one per micro-batch. {why}"
        )
        return None
    if any(r is None or not 1 <= r <= most for r in rows) or sum(rows) != BATCH:
        report.fail(
            f"m={m}: rank 0's {m} activations have {shown} rows; the batch of {BATCH} in {m} "
            f"micro-batches gives each about batch/m = {BATCH / m:g} rows (at most {most}), "
            f"together {BATCH}: {fix}"
        )
        return None
    if len(sends1) != m:
        report.fail(
            f"m={m}: rank 1 sent {len(sends1)} gradient(s) back for {m} micro-batches; the "
            f"step sends {m}: after each micro-batch's backward, send its activation's "
            "gradient (buffer.grad) to rank 0"
        )
        return None
    return f"{_count(m, 'activation')} of {shown} rows out, {_count(m, 'gradient')} back"


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}" + ("" if n == 1 else "es" if thing.endswith("ch") else "s")


def _compare(report: Report, results, m: int, counted: str = "") -> bool:
    for rank, (res, _) in enumerate(results):
        for k, (name, g, w) in enumerate(zip(res["names"], res["got"], res["want"], strict=True)):
            if g is None:
                report.fail(
                    f"m={m}: rank {rank}'s {name}.grad is None after the step: did backward run "
                    "on every micro-batch?"
                    + (
                        " On rank 1, the received activation needs requires_grad_() for its "
                        "gradient to exist"
                        if rank == 1
                        else ""
                    )  # fmt: skip
                )
                return False
            diff = (g - w).abs()
            if diff.max() > 1e-5:
                i = int(diff.argmax())
                hint = ""
                if torch.allclose(g, res["unweighted"][k], atol=1e-5) and m > 1:
                    hint = (
                        " That is what adding each micro-batch's mean loss as it is gives: "
                        "weight each by its share of the batch (its size / the batch)."
                    )
                elif torch.allclose(g, res["by_m"][k], atol=1e-5):
                    hint = (
                        " That is what dividing each micro-batch's mean loss by m gives: right "
                        "only when the micro-batches have the same size (here they do not) — "
                        "weight each by its size / the batch."
                    )
                report.fail(
                    f"m={m}: rank {rank}'s {name}.grad[{i}] is {g.reshape(-1)[i].item():.6g}; one "
                    f"device on the whole batch gives {w.reshape(-1)[i].item():.6g}.{hint}"
                )
                return False
    report.ok(f"m={m}: {counted}; both stages' gradients equal one device's on the whole batch")
    return True


def _explain(text: str) -> str:
    if "posted a receive of" in text:
        cut = re.search(
            rf"rank 1 posted a receive of \d+ bytes \(\((\d+), {ACT}\) float32\) from rank 0 "
            r".*?but rank 0 sent (\d+) bytes",
            text,
        )
        if cut and int(cut[2]) % (ACT * 4) == 0 and int(cut[2]) // (ACT * 4) != int(cut[1]):
            return (
                " The two ranks cut the batch differently: rank 1 expected "
                f"{_count(int(cut[1]), 'row')}, rank 0 sent {int(cut[2]) // (ACT * 4)}. Both "
                "make the same m micro-batches with "
                "torch.tensor_split(x, m) (torch.split(x, m) cuts chunks OF m rows instead)."
            )
        return (
            " Each receive must match, in shape and order, what the other rank sends: rank 1 "
            "gets micro-batch k's activation, (its size, 16), in micro-batch order; rank 0 "
            "gets the gradients in the order rank 1 sends them (micro-batch 0 first)."
        )
    if "'NoneType' object has no attribute" in text:
        return (
            " A gradient to send back was None: on rank 1, call requires_grad_() on the "
            "received activation before the forward, so backward fills its .grad."
        )
    return ""
