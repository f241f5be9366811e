"""Checks for labs 06 and 07: a hook-driven data-parallel wrapper, and a bucketer.

A wrapper is checked by training with it: 5 SGD steps (with momentum) on 2
ranks, each on its own slice of the batch, against one process training on the
whole batch. A mismatch is explained in the exercise's terms (summed instead of
averaged, never all-reduced, divided twice, ...); then *how* it communicated is
checked: async operations launched during backward (overlap), all of them waited,
and — for the bucketed one — one AllReduce per bucket, launched in bucket order.
"""

from __future__ import annotations

import math

import torch

from .. import handles
from ..costmodel import ddp_buckets
from .collectives import CHECK_LINK
from .common import human_bytes, run_or_report
from .report import Report

STEPS = 5
PER_RANK = 4
TIMEOUT_S = 30.0


class _Net(torch.nn.Module):
    """Four layers, one frozen: 8 trainable tensors of different sizes."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(6, 32)
        self.l2 = torch.nn.Linear(32, 32)
        self.frozen = torch.nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.l3 = torch.nn.Linear(32, 16)
        self.l4 = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.l2(torch.tanh(self.l1(x))))
        h = torch.tanh(self.l3(h + self.frozen(h)))
        return self.l4(h)


def _net(seed: int = 0):
    torch.manual_seed(seed)
    return _Net()


def _data(world: int):
    gen = torch.Generator().manual_seed(5)
    return [
        (torch.randn(world * PER_RANK, 6, generator=gen), torch.randn(world * PER_RANK, 4,
                                                                     generator=gen))
        for _ in range(STEPS)
    ]  # fmt: skip


def _kit_ops_issued() -> int:
    from ..collectives import _executor  # noqa: PLC0415 - the default group's kit stream

    return _executor(None)._issued


def _train(wrapper_cls, make_args):
    """Rank body: train with the learner's wrapper and, alongside, the reference."""
    import overlapkit as ok  # noqa: PLC0415

    me, world = ok.rank(), ok.world_size()
    handles.take_unwaited()
    model = wrapper_cls(_net(seed=1 + me), *make_args)  # a different init per rank
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference = _net(seed=1)  # rank 0's model: the wrapper broadcasts it
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    names = [n for n, p in reference.named_parameters() if p.requires_grad]
    trace, events = [], []
    sl = slice(me * PER_RANK, (me + 1) * PER_RANK)
    for x, y in _data(world):
        # reference: the mean over ranks of each rank's mean loss (= the whole batch's)
        ref_loss = sum(
            torch.nn.functional.mse_loss(reference(x[r * PER_RANK : (r + 1) * PER_RANK]),
                                         y[r * PER_RANK : (r + 1) * PER_RANK])
            for r in range(world)
        ) / world  # fmt: skip
        ref_loss.backward()
        local = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
        plain.step()
        plain.zero_grad()
        issued = _kit_ops_issued()
        loss = torch.nn.functional.mse_loss(model(x[sl]), y[sl])
        loss.backward()
        in_backward = _kit_ops_issued() - issued
        pending = len(handles._unwaited)
        model.finish_gradient_synchronization()
        in_finish = _kit_ops_issued() - issued - in_backward
        grads = {
            n.removeprefix("module."): None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()
        }
        events.append({"in_backward": in_backward, "pending": pending, "in_finish": in_finish})
        opt.step()
        opt.zero_grad(set_to_none=True)
        mine = dict(model.named_parameters())
        got = {n.removeprefix("module."): p.detach().clone() for n, p in mine.items()}
        want = {n: p.detach().clone() for n, p in reference.named_parameters()}
        trace.append((got, want, local, grads))
    unwaited = handles.take_unwaited()
    return {"trace": trace, "events": events, "unwaited": unwaited, "names": names}


def _compare(report: Report, results, world: int) -> bool:
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
                diff = (g - right).abs()
                if diff.max() > 1e-5:
                    i = int(diff.argmax())
                    report.fail(
                        f"after step {step + 1}'s finish_gradient_synchronization(), rank "
                        f"{rank}'s {name}.grad[{i}] is {g.reshape(-1)[i].item():.6g}; the "
                        f"average over ranks is {right.reshape(-1)[i].item():.6g}."
                        + _hint(results, step, rank, name, world)
                    )
                    return False
            for name in want:  # frozen ones too: they must not move
                diff = (got[name] - want[name]).abs()
                if diff.max() > 1e-5:
                    i = int(diff.argmax())
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


def _hint(results, step, rank, name, world) -> str:
    """What the learner's gradient is, compared with the right (averaged) one."""
    _, _, right_grads, grads = results[rank][0]["trace"][step]
    g, right = grads[name], right_grads[name]
    if len(results) > 1:
        other = results[1 - rank][0]["trace"][step][3][name]
        if other is not None and (other - g).abs().max() > 1e-5:
            return (
                " Rank 0 and rank 1 hold different gradients: each kept its own — the "
                "gradients were not all-reduced, or their AllReduce had not finished (no "
                "wait()) when they were read."
            )
    moved = right.abs() > 1e-6
    if not moved.any():
        return ""
    ratio = (g[moved] / right[moved]).median().item()
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
    return f" Yours is {ratio:.3g}× the average there."


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


def _check_communication(report: Report, results, expect_ops: int | None) -> None:
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
    if max(e["pending"] for e in events) == 0:
        report.fail(
            "the AllReduces issued during backward had all finished when backward returned: "
            "the hook all-reduces synchronously, so backward stops at every gradient until its "
            "AllReduce is done. Pass async_op=True, keep the handle, and wait() in "
            "finish_gradient_synchronization()"
        )
        return
    if any(e["in_finish"] for e in events) and expect_ops is None:
        report.fail(
            f"{max(e['in_finish'] for e in events)} AllReduce(s) per step were issued in "
            "finish_gradient_synchronization(): every gradient's AllReduce belongs in its hook"
        )
        return
    per_step = [e["in_backward"] + e["in_finish"] for e in events]
    if expect_ops is not None and any(n != expect_ops for n in per_step):
        report.fail(
            f"{per_step[0]} AllReduce(s) per step; the buckets need exactly {expect_ops} — one "
            "per bucket (flatten the bucket's gradients, all-reduce the flat tensor once)"
        )
        return
    if not unwaited:
        report.ok(
            f"{during[-1]} async AllReduce(s) launched during backward, {per_step[-1]} per "
            "step, every one waited"
        )


def check_hook_ddp(wrapper_cls, world_size: int = 2, timeout: float = TIMEOUT_S) -> Report:
    """Check a hook-driven data-parallel wrapper ``wrapper_cls(module)`` (lab 06).

    It must broadcast rank 0's weights, average gradients with one async AllReduce per
    parameter launched from the parameter's post-accumulate-grad hook, and wait for
    them in ``finish_gradient_synchronization()``.
    """
    report = Report("hook_ddp")
    results = run_or_report(report, f"{wrapper_cls.__name__} on {world_size} ranks", _train,
                            wrapper_cls, (), world_size=world_size, timeout=timeout,
                            link=CHECK_LINK)  # fmt: skip
    if results is None:
        return report
    if _compare(report, results, world_size):
        _check_communication(report, results, expect_ops=None)
    else:
        _report_unwaited(report, results)
    return report


# --------------------------------------------------------------------------- lab 07: buckets

BUCKET_CASES = [
    ("four 1 MiB gradients, 2 MiB buckets", [2**20] * 4, 2),
    ("a gradient larger than a bucket", [100, 3 * 2**20, 100, 100], 1),
    ("buckets smaller than every gradient", [4096, 4096, 4096], 0.001),
    ("one bucket for everything (bucket_mb=None)", [10, 20, 30], None),
    ("an exact fit, then one more byte", [2**19, 2**19, 1], 1),
    ("uneven sizes", [300_000, 500_000, 200_000, 900_000, 100_000, 50_000], 1),
]


def check_assign_buckets(assign_buckets) -> Report:
    """Check ``assign_buckets(sizes, bucket_mb) -> list[list[int]]`` (lab 07).

    ``sizes``: each gradient's bytes, in the order they become ready; a bucket holds
    consecutive gradients, at most ``bucket_mb`` MiB; a gradient larger than a bucket
    gets one of its own; ``None`` means one bucket.
    """
    report = Report("assign_buckets")
    for what, sizes, mb in BUCKET_CASES:
        want = ddp_buckets(sizes, mb)
        try:
            got = assign_buckets(list(sizes), mb)
        except NotImplementedError:
            report.fail(f"{what}: not implemented yet (still raises NotImplementedError)")
            return report
        except Exception as exc:  # noqa: BLE001 - a crash is one ✘ line
            report.fail(f"{what}: raised {type(exc).__name__}: {exc}")
            continue
        got = [list(b) for b in got] if isinstance(got, (list, tuple)) else got
        if got == want:
            report.ok(f"{what}: {_show(want, sizes)}")
        else:
            hint = _bucket_hint(got, want, sizes, mb)
            report.fail(f"{what}, bucket_mb={mb}: got {got}; expected {want}.{hint}")
    return report


def _show(buckets, sizes) -> str:
    return " | ".join(f"{b} ({human_bytes(sum(sizes[i] for i in b))})" for b in buckets)


def _bucket_hint(got, want, sizes, mb) -> str:
    if not isinstance(got, list) or not all(isinstance(b, list) for b in got):
        return " Return a list of buckets, each a list of gradient indices."
    flat = [i for b in got for i in b]
    if sorted(flat) != list(range(len(sizes))):
        return " Every gradient index must be in exactly one bucket."
    if flat != list(range(len(sizes))):
        return (
            " Buckets hold consecutive gradients in the order given (the order they become "
            "ready), so that a bucket fills while backward runs."
        )
    limit = math.inf if mb is None else mb * 2**20
    for b in got:
        total = sum(sizes[i] for i in b)
        if total > limit and len(b) > 1:
            return (
                f" Bucket {b} holds {total} bytes, more than bucket_mb = {mb} MiB = "
                f"{limit:g} bytes (MiB: 2**20 bytes)."
            )
    if len(got) > len(want):
        return (
            " You start a new bucket too early: a gradient joins the current bucket while the "
            "total stays at most the limit (≤, not <)."
        )
    return ""


def check_bucketed_ddp(wrapper_cls, bucket_mb: float = 0.004, world_size: int = 2,
                       timeout: float = TIMEOUT_S) -> Report:  # fmt: skip
    """Check a bucketed wrapper ``wrapper_cls(module, bucket_mb)`` (lab 07): the weights of
    5 steps against one process, one async AllReduce per bucket launched during backward,
    every handle waited."""
    report = Report("bucketed_ddp")
    sizes = [p.numel() * 4 for p in reversed([p for p in _net().parameters() if p.requires_grad])]
    expect = len(ddp_buckets(sizes, bucket_mb))
    results = run_or_report(report, f"{wrapper_cls.__name__}(bucket_mb={bucket_mb}) on "
                            f"{world_size} ranks", _train, wrapper_cls, (bucket_mb,),
                            world_size=world_size, timeout=timeout, link=CHECK_LINK)  # fmt: skip
    if results is None:
        return report
    if _compare(report, results, world_size):
        _check_communication(report, results, expect_ops=expect)
    else:
        _report_unwaited(report, results)
    return report
