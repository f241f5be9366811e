"""Checks for lab 08: a 1F1B schedule generator, and an overlapped two-stage GPipe step."""

from __future__ import annotations

import time

import torch

from .. import handles
from ..pipeline import make_schedule
from .collectives import CHECK_LINK
from .common import Unfinished, call_or_report, run_or_report
from .report import Report

SCHEDULE_CASES = [(2, 4), (2, 1), (3, 4), (4, 6), (4, 2), (2, 7)]


def _as_strings(plan) -> list[list[str]] | None:
    if not isinstance(plan, (list, tuple)) or not all(isinstance(s, (list, tuple)) for s in plan):
        return None
    return [[str(a) for a in stage] for stage in plan]


def check_1f1b_schedule(one_f_one_b) -> Report:
    """Check ``one_f_one_b(stages, micro_batches)`` → per stage a list like ["F0", "F1", "B0", …]
    against the textbook 1F1B order (warm-up forwards, one forward one backward, drain)."""
    report = Report("1f1b_schedule")
    for p, m in SCHEDULE_CASES:
        want = [[str(a) for a in stage] for stage in make_schedule("1f1b", p, m)]
        what = f"{p} stages, {m} micro-batch{'es' if m > 1 else ''}"
        try:
            ran, plan = call_or_report(report, what, one_f_one_b, p, m)
        except Unfinished:
            return report
        if not ran:
            continue
        got = _as_strings(plan)
        if got is None:
            report.fail(f"{what}: return one list of actions per stage, e.g. [['F0', 'B0'], …]")
            continue
        if len(got) != p:
            report.fail(f"{what}: {len(got)} lists; one per stage makes {p}")
            continue
        bad = next((s for s in range(p) if got[s] != want[s]), None)
        if bad is None:
            report.ok(f"{what}: " + " | ".join(" ".join(stage) for stage in want))
            continue
        g, w = got[bad], want[bad]
        i = next((i for i in range(min(len(g), len(w))) if g[i] != w[i]), min(len(g), len(w)))
        report.fail(
            f"{what}, stage {bad}: got {' '.join(g)}; expected {' '.join(w)} (first difference "
            f"at position {i}: {_at(g, i)} where {_at(w, i)} belongs)."
            + _schedule_hint(g, w, bad, p, m)
        )
    return report


def _at(actions, i) -> str:
    return actions[i] if i < len(actions) else "nothing"


def _schedule_hint(got, want, s, p, m) -> str:
    if sorted(got) != sorted(want):
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        return (
            " Every stage runs F and B of each micro-batch exactly once"
            + (f"; missing {missing}" if missing else "")
            + (f"; not expected {extra}" if extra else "")
            + "."
        )
    warm = next((i for i, a in enumerate(got) if a.startswith("B")), len(got))
    right = min(p - s - 1, m)
    if warm != right:
        return (
            f" Stage {s} ran {warm} forward(s) before its first backward; 1F1B warms up with "
            f"min(p − s − 1, m) = {right}: enough to fill the stages after it, no more (more "
            "holds more activations)."
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
    """Wraps ``ok.p2p.send/isend`` while the learner's step runs: when each send started
    and when it was waited, and whether it was a blocking send."""

    def __init__(self):
        self.sends: list[dict] = []

    def __enter__(self):
        from .. import p2p  # noqa: PLC0415

        self._p2p = p2p
        self._orig = (p2p.isend, p2p.send)
        watch = self

        def isend(tensor, dst, group=None):
            handle = watch._orig[0](tensor, dst, group)
            entry = {"start": time.perf_counter(), "waited": None, "blocking": False}
            watch.sends.append(entry)
            original_wait = handle.wait

            def wait(*args, **kwargs):
                result = original_wait(*args, **kwargs)
                if entry["waited"] is None:
                    entry["waited"] = time.perf_counter()
                return result

            handle.wait = wait
            return handle

        def send(tensor, dst, group=None):
            start = time.perf_counter()
            watch._orig[0](tensor, dst, group).wait()
            watch.sends.append({"start": start, "waited": time.perf_counter(), "blocking": True})

        p2p.isend, p2p.send = isend, send
        return self

    def __exit__(self, *exc):
        self._p2p.isend, self._p2p.send = self._orig


def _run_step(gpipe_step, m):
    import overlapkit as ok  # noqa: PLC0415

    me = ok.rank()
    model, first, second = _stages()
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 3, generator=gen)
    torch.nn.functional.mse_loss(model(x), y).backward()
    want = [p.grad.clone() for p in (first if me == 0 else second).parameters()]
    model.zero_grad()
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
        gpipe_step(stage, x if me == 0 else None, y if me == 1 else None, m)
    got = [None if p.grad is None else p.grad.clone() for p in stage.parameters()]
    names = [n for n, _ in stage.named_parameters()]
    return {"got": got, "want": want, "names": names, "sends": watch.sends,
            "computes": computes, "unwaited": handles.take_unwaited()}  # fmt: skip


def check_gpipe_step(gpipe_step, micro_batches: int = 4, timeout: float = 30.0) -> Report:
    """Check ``gpipe_step(stage, inputs, targets, micro_batches)`` on 2 ranks: its
    gradients against one device on the whole batch, for m = 1, ``micro_batches`` and a
    count that does not divide the batch; then that rank 0's activation sends overlap its
    next forward."""
    report = Report("gpipe_step")
    for m in (1, micro_batches, 3):
        results = run_or_report(report, f"gpipe_step with {m} micro-batch(es) on 2 ranks",
                                _run_step, gpipe_step, m, world_size=2, timeout=timeout,
                                link=CHECK_LINK, explain=_explain)  # fmt: skip
        if results is None:
            return report
        if not _compare(report, results, m):
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
    report.ok(
        f"rank 0's {len(sends)} activation sends were in flight during its next forwards, "
        "every one waited"
    )
    return report


def _compare(report: Report, results, m: int) -> bool:
    for rank, (res, _) in enumerate(results):
        for name, g, w in zip(res["names"], res["got"], res["want"], strict=True):
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
                ratio = (g.reshape(-1)[i] / w.reshape(-1)[i]).item() if w.reshape(-1)[i] else 0.0
                hint = ""
                if m > 1 and 0.6 * m < ratio < 1.4 * m:
                    hint = (
                        f" That is {ratio:.3g}× the right one, about m = {m} times: each "
                        "micro-batch's mean loss was added as it is — weight each micro-batch's "
                        "loss by its share of the batch (its size / the batch)."
                    )
                report.fail(
                    f"m={m}: rank {rank}'s {name}.grad[{i}] is {g.reshape(-1)[i].item():.6g}; one "
                    f"device on the whole batch gives {w.reshape(-1)[i].item():.6g}.{hint}"
                )
                return False
    report.ok(f"m={m}: both stages' gradients equal one device's on the whole batch")
    return True


def _explain(text: str) -> str:
    if "'NoneType' object has no attribute" in text:
        return (
            " A gradient to send back was None: on rank 1, call requires_grad_() on the "
            "received activation before the forward, so backward fills its .grad."
        )
    return ""
