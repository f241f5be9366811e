"""Check for lab 06, and what lab 07's bucketed wrapper is checked with: a hook-driven
data-parallel wrapper.

A wrapper is checked by training with it: 5 SGD steps (with momentum) on 3
ranks (so that a hard-coded 2 shows), each on its own slice of the batch,
against one process training on the whole batch. A mismatch is explained in
the exercise's terms (summed instead of averaged, never all-reduced, divided
twice, read before wait(): NaN under the read guard, ...); then *how* it
communicated is checked: async operations launched during backward (overlap), all of them waited,
and — for the bucketed one — one AllReduce per bucket, launched in bucket order.
"""

from __future__ import annotations

import secrets

import torch

from .. import handles
from .cases import Case, run_cases
from .common import worst_element
from .lab03_collectives import CHECK_LINK
from .mistakes import bypasses_the_link
from .report import Report
from .traffic import shown

STEPS = 5
PER_RANK = 4
TIMEOUT_S = 30.0


class _Net(torch.nn.Module):
    """Four layers, one frozen: 8 trainable tensors of different sizes. ``l3`` is
    registered before ``l2`` but used after it, so its gradients are ready *before*
    ``l2``'s although they come later in reverse parameter order: a bucket can be full
    while an earlier one is not, as in real models whose forward order differs from
    their definition order."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(6, 32)
        self.l3 = torch.nn.Linear(32, 16)
        self.l2 = torch.nn.Linear(32, 32)
        self.frozen = torch.nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.l4 = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.l2(torch.tanh(self.l1(x))))
        h = torch.tanh(self.l3(h + self.frozen(h)))
        return self.l4(h)


def _net(seed: int = 0):
    torch.manual_seed(seed)
    return _Net()


def _data(world: int, seed: int):
    """Every step's whole batch, drawn from ``seed``: the check draws it afresh each time
    and sends each rank its own slices only (:func:`_slices`), so no rank can work out the
    whole batch's gradients, and what a rank reports is judged against one process here."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(world * PER_RANK, 6, generator=gen), torch.randn(world * PER_RANK, 4,
                                                                     generator=gen))
        for _ in range(STEPS)
    ]  # fmt: skip


def _slices(data, rank: int) -> dict:
    sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return {"batches": [(x[sl].clone(), y[sl].clone()) for x, y in data]}


def _reference(data, world: int) -> list[tuple[dict, dict]]:
    """(weights, averaged gradients) after each step of one process training on the whole
    batch with rank 0's initial weights: what every rank must hold."""
    reference = _net(seed=1)  # rank 0's model: the wrapper broadcasts it
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    out = []
    for x, y in data:
        # the mean over ranks of each rank's mean loss (= the whole batch's)
        loss = sum(
            torch.nn.functional.mse_loss(reference(x[r * PER_RANK : (r + 1) * PER_RANK]),
                                         y[r * PER_RANK : (r + 1) * PER_RANK])
            for r in range(world)
        ) / world  # fmt: skip
        loss.backward()
        grads = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
        plain.step()
        plain.zero_grad()
        out.append(({n: p.detach().clone() for n, p in reference.named_parameters()}, grads))
    return out


def _run(report: Report, check: str, what: str, wrapper_cls, make_args, world: int,
         timeout: float) -> list | None:  # fmt: skip
    """Train with the learner's wrapper on ``world`` ranks, each on its own secret slices;
    each rank's trace completed with the reference's (weights, gradients) per step."""
    data = _data(world, secrets.randbits(62))

    def references(results) -> bool:  # the verdict comes after, in cases of its own
        refs = _reference(data, world)
        for res, _ in results:
            res["trace"] = [(got, want, right, grads)
                            for (got, grads), (want, right) in zip(res["trace"], refs,
                                                                   strict=False)]  # fmt: skip
        return True

    private = [_slices(data, r) for r in range(world)]
    case = Case(what, world, _train, (wrapper_cls, make_args), references, private)
    return run_cases(report, check, [case], timeout=timeout, link=CHECK_LINK,
                     explain=_explain_race)  # fmt: skip


def _kit_ops_issued() -> int:
    from ..ordering import issued  # noqa: PLC0415 - on the default group's kit stream

    return issued().ops


class _Calls:
    """Wraps ``ok.ring_all_reduce`` while the learner's wrapper trains: the elements of
    each call, in issue order, and whether it was asynchronous."""

    def __init__(self):
        self.calls: list[tuple[int, bool]] = []

    def __enter__(self):
        import overlapkit  # noqa: PLC0415

        from .. import collectives  # noqa: PLC0415

        original = overlapkit.ring_all_reduce

        def ring_all_reduce(tensor, *args, **kwargs):
            self.calls.append((tensor.numel(), bool(kwargs.get("async_op", False))))
            return original(tensor, *args, **kwargs)

        self._restore = [(m, m.ring_all_reduce) for m in (overlapkit, collectives)]
        for m, _ in self._restore:
            m.ring_all_reduce = ring_all_reduce
        return self

    def __exit__(self, *exc):
        for m, original in self._restore:
            m.ring_all_reduce = original

    def take(self) -> list[tuple[int, bool]]:
        calls, self.calls = self.calls, []
        return calls


def _train(wrapper_cls, make_args, batches):
    """Rank body: train with the learner's wrapper on this rank's ``batches``; the
    weights and gradients after each step, and how it communicated."""
    import overlapkit as ok  # noqa: PLC0415

    me = ok.rank()
    handles.take_unwaited()
    with _Calls() as calls:
        model = wrapper_cls(_net(seed=1 + me), *make_args)  # a different init per rank
        calls.take()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        names = [n for n, p in _net().named_parameters() if p.requires_grad]
        trace, events = [], []
        for x, y in batches:
            issued = _kit_ops_issued()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            in_backward = _kit_ops_issued() - issued
            during = calls.take()
            pending = handles.pending()
            model.finish_gradient_synchronization()
            in_finish = _kit_ops_issued() - issued - in_backward
            grads = {
                n.removeprefix("module."): None if p.grad is None else p.grad.detach().clone()
                for n, p in model.named_parameters()
            }
            left = getattr(model, "pending", None)
            events.append({"in_backward": in_backward, "pending": pending,
                           "in_finish": in_finish, "calls": during + calls.take(),
                           "left": len(left) if isinstance(left, list) else 0})  # fmt: skip
            opt.step()
            opt.zero_grad(set_to_none=True)
            mine = dict(model.named_parameters())
            got = {n.removeprefix("module."): p.detach().clone() for n, p in mine.items()}
            trace.append((got, grads))
    unwaited = handles.take_unwaited()
    buckets = getattr(model, "buckets", None)
    buckets = [list(b) for b in buckets] if isinstance(buckets, (list, tuple)) else None
    return {"trace": trace, "events": events, "unwaited": unwaited, "names": names,
            "buckets": buckets}  # fmt: skip


def _builtins(results) -> str | None:
    """The built-in collectives a rank called (the given constructor's broadcast aside)."""
    for rank, (_, traffic) in enumerate(results):
        called = sorted({c for c in traffic.collectives if not c.startswith("ok.")} - {"broadcast"})
        if called:
            so = (", so the overlap you will measure would not be there (and this check "
                  "cannot see when your AllReduces ran)")  # fmt: skip
            return bypasses_the_link(rank, ", ".join(map(shown, called)),
                                     "ok.ring_all_reduce(..., async_op=True)", so)  # fmt: skip
    return None


def _kept_hint(events, step: int) -> str:
    """A list of pending operations never emptied explains a wrong gradient in any later
    step, however the timing of the re-waited operations made it look."""
    kept = [e["left"] for e in events[:step]]
    if not any(kept):
        return ""
    return (
        f" self.pending still held {max(kept)} entries after an earlier step's "
        "finish_gradient_synchronization(): that step's operations are waited and their "
        "gradients divided again — clear your list of pending operations at the end of finish"
    )


def _compare(report: Report, results, world: int, expect=None) -> bool:
    """First (step, rank, parameter, element) where the averaged gradient or the
    weights differ from one process training on the whole batch."""
    for step in range(STEPS):
        for rank, (res, _) in enumerate(results):
            got, want, right_grads, grads = res["trace"][step]
            missing = sorted(set(want) - set(got))
            if missing:
                report.fail(
                    f"the wrapper's parameters() lack {missing[:3]}: wrap the model as "
                    "self.module so that parameters() are the model's"
                )
                return False
            for name in res["names"]:
                g, right = grads.get(name), right_grads[name]
                if g is None:
                    report.fail(
                        f"after step {step + 1}'s finish_gradient_synchronization(), rank "
                        f"{rank}'s {name}.grad is None: the averaged gradient must be left in "
                        "each parameter's .grad"
                    )
                    return False
                i = worst_element((g - right).abs())
                if i is not None:
                    report.fail(
                        f"after step {step + 1}'s finish_gradient_synchronization(), rank "
                        f"{rank}'s {name}.grad[{i}] is {g.reshape(-1)[i].item():.6g}; the "
                        f"average over ranks is {right.reshape(-1)[i].item():.6g}."
                        + (
                            _kept_hint(res["events"], step)
                            or _hint(results, step, rank, name, world, i, expect)
                        )  # fmt: skip
                    )
                    return False
            for name in want:  # frozen ones too: they must not move
                i = worst_element((got[name] - want[name]).abs())
                if i is not None:
                    report.fail(
                        f"after step {step + 1}, rank {rank}'s {name}[{i}] is "
                        f"{got[name].reshape(-1)[i].item():.6g}; one process training on the "
                        f"whole batch has {want[name].reshape(-1)[i].item():.6g}, although the "
                        "gradients were right: do the weights start equal (broadcast from rank "
                        "0), and does parameters() return the model's own parameters?"
                    )
                    return False
    report.ok(
        f"{STEPS} SGD steps on {world} ranks, each on its own data: every rank's averaged "
        "gradients and weights equal one process training on the whole batch"
    )
    return True


def _hint(results, step, rank, name, world, i, expect=None) -> str:
    """What the learner's gradient is, compared with the right (averaged) one."""
    res = results[rank][0]
    _, _, right_grads, grads = res["trace"][step]
    g, right = grads[name], right_grads[name]
    event = res["events"][step]
    wanted = len(expect) if expect is not None else len(res["names"])
    if 0 < len(event["calls"]) < wanted:
        if expect is not None:
            return (
                f" Only {len(event['calls'])} of the {wanted} buckets were all-reduced in step "
                f"{step + 1}: when a gradient completes a bucket, launch every complete bucket "
                "from self.next on (a while loop, not an if) — here a layer's gradients are "
                "ready before those of a layer defined after it, so a full bucket can wait for "
                "an earlier one."
            )
        return (
            f" Only {len(event['calls'])} of the {wanted} gradients were all-reduced in step "
            f"{step + 1}: every trainable parameter's hook must launch one."
        )
    if step > 0 and not event["calls"] and res["events"][0]["calls"]:
        return (
            f" In step {step + 1} no AllReduce was issued at all (step 1 issued "
            f"{len(res['events'][0]['calls'])}): reset what tracks a step — the gradients still "
            "missing per bucket, the next bucket to launch, the pending list — at the end of "
            "finish_gradient_synchronization(), so that the next step launches again."
        )
    if torch.isnan(g).any():
        return (
            " It is NaN: the check fills a tensor with NaN while its AllReduce is in flight "
            "(and writes the result back at wait()), so NaN here means the gradient was read — "
            "copied, divided, or handed on — before its handle's wait() returned. Read it only "
            "after wait()."
        )
    other_rank = (rank + 1) % len(results)
    if other_rank != rank:
        other = results[other_rank][0]["trace"][step][3][name]
        if other is not None and (other - g).abs().max() > 1e-5:
            pair = f"Rank {rank} and rank {other_rank}"
            waited = not any(r["unwaited"] for r, _ in results)
            if waited and res.get("buckets") is not None:
                return (
                    f" {pair} hold different gradients: each kept its own, although "
                    "every AllReduce was waited. Did the reduced flat tensor reach .grad? Copy "
                    "each slice of it back into its parameter's .grad (torch.cat made a copy)."
                )
            return (
                f" {pair} hold different gradients: each kept its own — the "
                "gradients were not all-reduced (or a copy of them was), or their AllReduce "
                "had not finished (no wait()) when they were read."
            )
    return _factor_hint(g, right, world, i)


def _factor_hint(g, right, world: int, i: int) -> str:
    """What a gradient the ranks agree on is, as a factor of the average (element ``i`` is
    the one that differs most)."""
    moved = right.abs() > 1e-6
    if not moved.any():
        return ""
    ratios = g[moved] / right[moved]
    ratio = ratios.median().item()
    worst = (g.reshape(-1)[i] / right.reshape(-1)[i]).item() if right.reshape(-1)[i] else ratio
    lo, hi = ratios.min().item(), ratios.max().item()
    if hi - lo > 0.1 * max(abs(hi), abs(lo)):  # not one factor: elements disagree
        if abs(ratio - 1) < 0.01:
            right_share = ((ratios - 1).abs() < 1e-3).float().mean().item()
            return (
                f" {right_share:.0%} of its elements are right, but here it is {worst:.3g}× "
                "the average: it was read or changed (divided?) while its AllReduce was still "
                "running. Touch a gradient only after its handle's wait()."
            )
        return (
            f" Its elements are off by different factors, from {lo:.3g}× to {hi:.3g}× the "
            "average: a sign of a gradient read or changed (divided?) while its AllReduce was "
            "still running. Touch a gradient only after its handle's wait()."
        )
    if world > 2 and abs(ratio - world / 2) < 0.05 * world / 2:
        return (
            f" Yours is {ratio:.3g}× the average, N/2 with N = {world}: did you divide by 2 "
            "instead of by ok.world_size()? The check runs on 3 ranks so that a constant shows."
        )
    if abs(ratio - world) < 0.05 * world:
        return (
            f" Yours is {ratio:.3g}× the average, N = {world} times: the gradients were "
            "summed, not averaged (divide each by ok.world_size() after its wait())."
        )
    if abs(ratio - 1 / world) < 0.05 / world:
        return (
            f" Yours is {ratio:.3g}× the average, 1/N: it was divided twice — is an earlier "
            "step's handle waited and divided again (clear your list of pending operations "
            "after finishing)?"
        )
    if abs(ratio) < 0.01:
        return " It is zero: the averaged gradient never reached .grad."
    return f" Yours is {worst:.3g}× the average there."


def _report_unwaited(report: Report, results) -> bool:
    unwaited = [u for res, _ in results for u in res["unwaited"]]
    if unwaited:
        report.fail(
            f"{len(results[0][0]['unwaited'])} AllReduce(s) on rank 0 in {STEPS} steps were "
            f"never waited, e.g. {unwaited[0]}: "
            "finish_gradient_synchronization() must wait() every handle before the optimizer "
            "reads .grad"
        )
    return bool(unwaited)


def _check_communication(report: Report, results, expect: list[int] | None) -> None:
    """How it communicated. ``expect``: each bucket's elements, in bucket order (None:
    one AllReduce per parameter, in any order)."""
    events = results[0][0]["events"]
    unwaited = _report_unwaited(report, results)
    during = [e["in_backward"] for e in events]
    if max(during) == 0:
        report.fail(
            "no AllReduce was issued during backward: they all ran in "
            "finish_gradient_synchronization(), after backward — that is NaiveDDP. Launch each "
            "one from the gradient hook, with async_op=True"
        )
        return
    if max(e["pending"] for e in events) == 0 and all(a for e in events for _, a in e["calls"]):
        report.fail(
            "every AllReduce was started with async_op=True, but all had finished when backward "
            "returned: something waits for each one during backward (handle.wait() inside the "
            "hook?), so backward stops at every gradient until its AllReduce is done. Keep the "
            "handles and wait() for them in finish_gradient_synchronization()"
        )
        return
    if max(e["pending"] for e in events) == 0:
        report.fail(
            "the AllReduces issued during backward had all finished when backward returned: "
            "the hook all-reduces synchronously, so backward stops at every gradient until its "
            "AllReduce is done. Pass async_op=True, keep the handle, and wait() in "
            "finish_gradient_synchronization()"
        )
        return
    if any(e["in_finish"] for e in events) and expect is None:
        report.fail(
            f"{max(e['in_finish'] for e in events)} AllReduce(s) per step were issued in "
            "finish_gradient_synchronization(): every gradient's AllReduce belongs in its hook"
        )
        return
    per_step = [e["in_backward"] + e["in_finish"] for e in events]
    if expect is not None:
        sizes = [[n for n, _ in e["calls"]] for e in events]
        if any(len(got) > len(expect) for got in sizes):
            report.fail(
                f"{per_step[0]} AllReduce(s) per step; the {len(expect)} buckets need exactly "
                f"{len(expect)} — one per bucket (flatten the bucket's gradients, all-reduce the "
                "flat tensor once)"
            )
            return
        if any(len(got) < len(expect) for got in sizes):
            short = next(got for got in sizes if len(got) < len(expect))
            report.fail(
                f"only {len(short)} of the {len(expect)} buckets were all-reduced in a step: when "
                "a gradient completes a bucket, launch every complete bucket from self.next on "
                "(a while loop, not an if): here a layer's gradients are ready before those of a "
                "layer defined after it, so a bucket can wait for an earlier one"
            )
            return
        wrong = next((got for got in sizes if got != expect), None)
        if wrong is not None:
            report.fail(
                f"buckets were all-reduced out of order: elements per AllReduce {wrong}, bucket "
                f"order {expect}. The k-th AllReduce of a rank meets the k-th of every other "
                "rank, so all must launch the same buckets in the same order: launch a full "
                "bucket only once every earlier one is launched"
            )
            return
        left = max(e["left"] for e in events)
        if left:
            report.fail(
                f"self.pending still held {left} entries after finish_gradient_synchronization(): "
                "empty it there, or every step keeps (and copies back) the old buckets again"
            )
            return
    if not unwaited:
        report.ok(
            f"{during[-1]} async AllReduce(s) launched during backward, {per_step[-1]} per "
            "step" + (", in bucket order" if expect is not None else "") + ", every one waited"
        )


#: the checks' ranks: 3, so that a hard-coded 2 (the world size of most examples) shows
WORLD = 3


def check_hook_ddp(wrapper_cls, world_size: int = WORLD, timeout: float = TIMEOUT_S) -> Report:
    """Check a hook-driven data-parallel wrapper ``wrapper_cls(module)`` (lab 06).

    It must broadcast rank 0's weights, average gradients with one async AllReduce per
    parameter launched from the parameter's post-accumulate-grad hook, and wait for
    them in ``finish_gradient_synchronization()``.
    """
    report = Report("hook_ddp")
    what = f"{wrapper_cls.__name__} on {world_size} ranks"
    results = _run(report, "check_hook_ddp", what, wrapper_cls, (), world_size, timeout)
    if results is None:
        _loop_hint(report)
        return report
    builtin = _builtins(results)
    if builtin:
        report.fail(builtin)
    if _compare(report, results, world_size) and not builtin:
        _check_communication(report, results, expect=None)
    elif not builtin:
        _report_unwaited(report, results)
    return report


def _explain_race(text: str) -> str:
    """A RaceError (or a gradient that is None) in the learner's wrapper, in the
    exercise's terms."""
    if "TypeError" in text and "'NoneType'" in text:  # e.g. p.grad /= N on a frozen layer
        return (
            ". A parameter's .grad is None: the test model has a frozen layer "
            "(requires_grad=False), which gets no gradient and no hook. Finish only the "
            "parameters whose AllReduce your hooks started (those you kept in self.pending)"
        )
    if "RaceError" not in text:
        return ""
    return (
        ". In this exercise that is a gradient (or a flat bucket) divided, copied or "
        "accumulated into before its handle's wait() returned. If your code touches it only "
        "after wait(), look for an older handle: a pending list not cleared at the end of "
        "finish_gradient_synchronization() makes the next step wait and divide last step's "
        "entries while this step's AllReduces on the same gradients are still running"
    )


def _loop_hint(report: Report) -> None:
    """A hook that never returns hangs backward: say so after the timeout line."""
    if report.cases and "did not finish" in report.cases[-1][1]:
        text = report.cases[-1][1]
        if "_on_grad_ready" in text or "finish_gradient_synchronization" in text:
            report.fail(
                "a rank was still inside your wrapper's code when time ran out: look for a loop "
                "whose condition never changes there (a while loop that does not advance "
                "self.next?)"
            )
