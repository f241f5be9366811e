"""Check for lab 13: top-k sparsification with error feedback, one bucket, several steps.

The learner's ``topk_with_feedback(flat, residual, fraction)`` runs on every rank: it
adds the rank's residual to its gradient (``corrected``), picks the k = round(fraction ·
numel) entries of largest magnitude (at least one), all-gathers every rank's values and
indices with the kit's ``ok.ring_all_gather``, writes the average into ``flat`` (each
value added at its own index, the sum divided by N) and returns the new residual, what
this rank did not send (``corrected`` with its sent entries zeroed)::

    rank r:  corrected = flat + residual ─ top-k by |·| ─► (values_r, index_r)
             all-gather (values, index) of every rank        N·k values, N·k indices
             flat = Σ_r scatter(values_r at index_r) / N      the same on every rank
             return corrected with index_r set to 0           next step's residual

Two cases, 2 ranks and 3, sizes where k = round(f·n) differs from ⌊f·n⌋, three steps
each with the residual carried (the rank passes back what the function returned). Every
rank's gradients come from a seed the checking process draws and gives to that rank
alone, so no rank can rebuild another's; the reference is worked out in the checking
process. A wrong ``flat`` or residual is named by what it is (summed, by value not
magnitude, k off by one or a fraction, the rank's own indices under the others' values,
residual ignored / not updated / negated / not zeroed where sent / made of the average),
and what each rank put into collectives a step must be what top-k sends, not the whole
gradient.
"""

from __future__ import annotations

import secrets

import torch

from .. import handles, p2p
from ..costmodel import top_k_count
from .cases import Case, private_seeds, run_cases, seeded
from .common import worst_element
from .mistakes import WAIT_BEFORE_READING, never_waited, not_over_the_link
from .report import Report
from .traffic import shown

STEPS = 3
#: (ranks, elements, fraction): round(f·n) is ⌈f·n⌉ in one (1070 · 1% = 10.7) and ⌊f·n⌋
#: in the other (326 · 5% = 16.3), so neither way of rounding passes both
CASES = ((2, 1070, 0.01), (3, 326, 0.05))
_GATHER = "ok.ring_all_gather"


SPIKES = 3  # positions large on every rank, each step: two ranks choose the same ones


def _gradients(seed: int, numel: int, shared: int) -> list[torch.Tensor]:
    """A rank's gradients, step by step: entries of both signs and varied sizes, so the
    largest by value and by magnitude differ; and ``SPIKES`` positions (from ``shared``,
    the same on every rank) large on every rank, so that every step some index is chosen
    by several ranks (a learner who overwrites instead of adding fails every time)."""
    gen, common = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(shared)
    grads = []
    for _ in range(STEPS):
        grad = torch.randn(numel, generator=gen) * (1 + 3 * torch.rand(numel, generator=gen))
        spikes = torch.randperm(numel, generator=common)[:SPIKES]
        grad[spikes] += 20 * torch.randn(SPIKES, generator=gen).sign()
        grads.append(grad)
    return grads


def _run(topk_with_feedback, numel, fraction, shared, seed):
    """On each rank: its own gradients (from ``seed``, this rank's alone), the residual it
    returned carried to the next step. Records what the function left and returned."""
    grads = _gradients(seed, numel, shared)
    del seed
    residual = torch.zeros(numel)
    steps = []
    for grad in grads:
        flat = grad.clone()
        given = residual.clone()
        sent = p2p.stats().bytes_sent
        try:
            with torch.no_grad():
                returned = topk_with_feedback(flat, residual, fraction)
        except Exception as exc:
            unwaited = handles.take_unwaited()
            if unwaited:  # what it read was the race guard's poison: say so, not the crash
                raise RuntimeError(
                    f"never waited for {len(unwaited)} operation(s), e.g. {unwaited[0]}, and "
                    f"then failed with {type(exc).__name__}: {exc}. The check poisons an "
                    "operation's output until its wait() returns (gathered indices read "
                    "before their wait are out of range): call .wait() on every handle "
                    "before using what it delivers"
                ) from exc
            raise
        record = {"flat": flat.clone(), "unwaited": handles.take_unwaited(),
                  "sent": p2p.stats().bytes_sent - sent}  # fmt: skip
        if isinstance(returned, torch.Tensor) and _same_storage(returned, flat):
            record["residual"] = "flat itself (the same storage)"
        elif isinstance(returned, torch.Tensor) and returned.shape == flat.shape:
            record["residual"] = returned.detach().clone()
            residual = returned.detach()
        else:
            record["residual"] = _describe(returned)
        record["given"] = given
        steps.append(record)
        if isinstance(record["residual"], str):
            break
    return steps


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return "None" if x is None else f"a {type(x).__name__}"


# --------------------------------------------------------------------------- the reference


def _top(corrected: torch.Tensor, k: int, by_value: bool = False) -> torch.Tensor:
    return (corrected if by_value else corrected.abs()).topk(k).indices


def _placed(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values`` at ``index``, zeros elsewhere."""
    out = torch.zeros_like(values)
    out[index] = values[index]
    return out


def _mean_placed(values: list, indices: list) -> torch.Tensor:
    """The average over the ranks of each rank's ``values`` at its ``indices``."""
    return torch.stack([_placed(v, i) for v, i in zip(values, indices, strict=True)]).mean(0)


def _kept(corrected: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    out = corrected.clone()
    out[index] = 0
    return out


def _averages(corrected: list[torch.Tensor], k: int, by_value: bool = False) -> torch.Tensor:
    return _mean_placed(corrected, [_top(c, k, by_value) for c in corrected])


def _close(a, b) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and a.shape == b.shape
        and bool(torch.allclose(a, b, rtol=1e-5, atol=1e-5))
    )


def _flat_hint(got, rank, grads, given, k, numel, fraction, world, t) -> str:
    """What the learner's ``flat`` on ``rank`` is, when it is not the average: how the
    values were combined, which were chosen, or what arrived (the first that fits)."""
    corrected = [g + r for g, r in zip(grads, given, strict=True)]
    right = _averages(corrected, k)
    picked = [_top(c, k) for c in corrected]
    return (
        _combined_hint(got, rank, grads, corrected, right, picked, k, world, t)
        or _chosen_hint(got, grads, given, corrected, picked, k, numel, fraction, world, t)
        or _arrived_hint(got, rank, grads, corrected, right, k, numel, world)
    )


def _combined_hint(got, rank, grads, corrected, right, picked, k, world, t) -> str:
    """The right entries, combined wrongly (summed, their signs lost, added to flat)."""
    if world > 1 and _close(got, right * world):
        return (
            f" That is the sum over the {world} ranks, not the average: divide the "
            f"scattered values by the world size (ok.world_size()), as an AllReduce with "
            "op='avg' would."
        )
    if _close(got, _mean_placed([c.abs() for c in corrected], picked)):
        return (
            " Those are the magnitudes of the chosen entries, their signs lost: choose the "
            "positions by |corrected| (corrected.abs().topk(k).indices), then send the "
            "entries themselves, corrected[indices]."
        )
    summed = _mean_placed(corrected, picked) * world
    for start in (grads[rank], corrected[rank]):
        if _close(got, (start + summed) / world) or _close(got, start + summed / world):
            return (
                " That is this rank's own gradient plus the average: flat was not zeroed "
                "before the gathered values were added into it (flat.zero_() first: flat "
                "ends holding the average only)."
            )
    if t > 0:
        if _close(got, _mean_placed(grads, picked)):
            return (
                " The positions are right but the values are the gradient's alone: send "
                "corrected[indices] (gradient + residual), the values the positions were "
                "chosen by."
            )
    if _close(got, summed / k):
        return f" That is the sum divided by k = {k}: the average divides by N = {world}."
    return ""


def _chosen_hint(got, grads, given, corrected, picked, k, numel, fraction, world, t) -> str:
    """The wrong entries chosen (the smallest, by value, too many, without the residual)."""
    smallest = [c.abs().topk(k, largest=False).indices for c in corrected]
    if _close(got, _mean_placed(corrected, smallest)):
        return (
            " Those are the k *smallest* entries: topk(k) picks the largest by default "
            "(largest=True); the large ones carry the gradient."
        )
    overwritten = torch.zeros_like(got)
    for c, i in zip(corrected, picked, strict=True):  # in rank order, the last one kept
        overwritten[i] = c[i]
    if _close(got, overwritten / world) or _close(got, overwritten):
        return (
            " Where two ranks chose the same position, one value was kept: flat[indices] = "
            "values overwrites. Add them: flat.index_add_(0, indices, values) (an index "
            "chosen by two ranks gets both values)."
        )
    if t > 0:
        by_gradient = [_top(g, k) for g in grads]
        if _close(got, _mean_placed(corrected, by_gradient)):
            return (
                " The positions were chosen by the gradient alone: choose them by "
                "|corrected| (gradient + residual), so that what waited in the residual "
                "gets its turn."
            )
    if _close(got, _averages(corrected, k, by_value=True)):
        return (
            " Those are the k largest entries by *value*: the most negative entries matter "
            "as much as the most positive ones. Rank by magnitude: corrected.abs().topk(k)."
        )
    floor, ceil = int(fraction * numel), -int(-fraction * numel // 1)
    for other in {floor, ceil, k - 1, k + 1}:
        if other >= 1 and other != k and _close(got, _averages(corrected, other)):
            how = {floor: "⌊f·n⌋, rounded down", ceil: "⌈f·n⌉, rounded up"}.get(other, "")
            how = how or f"{other}"
            return (
                f" That is the average of every rank's top {other} ({how}); k is the fraction "
                f"as a count, rounded and at least 1: max(1, round({fraction} · {numel})) = "
                f"{k} entries per rank."
            )
    if t > 0:
        if _close(got, _averages(grads, k)):
            return (
                " That is the average of the top-k of the gradients alone: the residual "
                "passed in (what this rank did not send last step) was never added. Error "
                "feedback starts from corrected = flat + residual."
            )
        minus = [g - r for g, r in zip(grads, given, strict=True)]
        if _close(got, _averages(minus, k)):
            return (
                " That adds the residual with the wrong sign (flat − residual): the residual "
                "is what was left out, so it is added back, corrected = flat + residual."
            )
    return ""


def _arrived_hint(got, rank, grads, corrected, right, k, numel, world) -> str:
    """What arrived in flat, when it is not the others' entries added at their places."""
    if not bool(got.any()):
        return (
            " flat is all zeros: the average was never written into it (add every rank's "
            "values at their indices after flat.zero_(), then divide)."
        )
    if world > 1:
        index = _top(corrected[rank], k)
        if bool((got[~_mask(index, numel)].abs() <= 1e-7).all()) and not _close(got, right):
            return (
                f" It is non-zero only at the {k} positions rank {rank} chose itself: the "
                "other ranks' values were put at this rank's indices. Each rank picks its "
                "own positions; gather the indices with the values and add each value at "
                "its own rank's index."
            )
        if _close(got, corrected[rank]) or _close(got, grads[rank]):
            return (
                " That is this rank's own gradient, unchanged: flat must end holding the "
                "average of every rank's top-k, written into it in place (flat.zero_(), "
                "then index_add_; binding the name to a new tensor does not change the "
                "caller's)."
            )
        own = _placed(corrected[rank], index)
        if _close(got, own) or _close(got, own / world):
            return (
                f" That is rank {rank}'s own top-k only: the other ranks' entries never "
                "arrived. All-gather every rank's values and indices and add them all."
            )
    if _close(got, torch.stack(corrected).mean(0)):
        return (
            " That is the plain average of the whole gradients: nothing was dropped, so "
            "nothing was compressed."
        )
    return ""


def _mask(index: torch.Tensor, numel: int) -> torch.Tensor:
    mask = torch.zeros(numel, dtype=torch.bool)
    mask[index] = True
    return mask


def _residual_hint(got, rank, grads, given, k, world, t) -> str:
    corrected = grads[rank] + given[rank]
    index = _top(corrected, k)
    right = _kept(corrected, index)
    if got is None or isinstance(got, str):
        return ""
    if _close(got, -right):
        return (
            " That is the residual with the wrong sign (what was sent minus the corrected "
            "gradient): keep corrected − sent, which is positive where the gradient was "
            "positive, so that adding it back next step restores what was left out."
        )
    if bool((got == 0).all()):
        return (
            " It is all zeros: no error feedback. What this rank did not send is the "
            "residual; drop it and those entries are lost for good."
        )
    if t > 0 and _close(got, given[rank]):
        return (
            " That is the residual passed in, unchanged: it must be updated every step, "
            "to what this step did not send."
        )
    if _close(got, corrected):
        return (
            " The entries this rank sent are still in it: set them to zero (they were "
            "delivered), or they would be sent again next step."
        )
    if t > 0 and _close(got, _kept(grads[rank], index)):
        return (
            " That leaves out the old residual: the new residual is what remains of "
            "corrected = flat + residual, not of the gradient alone."
        )
    average = _averages([g + r for g, r in zip(grads, given, strict=True)], k)
    if world > 1 and (_close(got, corrected - average) or _close(got, corrected - average * world)):
        return (
            " That is corrected − the average: the other ranks' entries leaked into this "
            "rank's residual. The residual is what *this* rank did not send: corrected with "
            "its own sent entries set to zero."
        )
    return ""


# --------------------------------------------------------------------------- judging


def _judge(report: Report, what: str, results, seeds, shared, numel, fraction) -> bool:
    world = len(seeds)
    k = top_k_count(numel, fraction)
    grads = [_gradients(seed, numel, shared) for seed in seeds]
    for rank, (steps, _) in enumerate(results):
        unwaited = [u for s in steps for u in s["unwaited"]]
        if unwaited:
            nan = any(bool(s["flat"].isnan().any()) for s in steps)
            read = (
                "; flat then held NaN (the check poisons an operation's output until its "
                "wait() returns, so a NaN is a value read before its wait)"
                if nan
                else ""
            )
            report.fail(never_waited(what, rank, unwaited, WAIT_BEFORE_READING, read))
            return False
    for t in range(STEPS):
        for rank, (steps, _) in enumerate(results):
            if isinstance(steps[t]["residual"], str) and steps[t]["residual"].startswith("flat "):
                report.fail(
                    f"{what}: at step {t + 1}, rank {rank}'s returned residual is flat itself "
                    "(the same storage: corrected = flat.add_(residual), or flat returned). "
                    "flat is overwritten with the average, so what this rank did not send is "
                    "lost with it: make corrected a new tensor, corrected = flat + residual"
                )
                return False
        given = [steps[t]["given"] for steps, _ in results]
        step_grads = [g[t] for g in grads]
        corrected = [g + r for g, r in zip(step_grads, given, strict=True)]
        want = _averages(corrected, k)
        for rank, (steps, _) in enumerate(results):
            got = steps[t]["flat"]
            i = worst_element((got - want).abs())
            if i is not None:
                if got.isnan().any():
                    hint = (
                        " NaN: the check poisons a kit operation's output until its wait() "
                        "returns, so a NaN is a gathered value read before its wait()."
                    )
                else:
                    hint = _flat_hint(got, rank, step_grads, given, k, numel, fraction, world, t)
                report.fail(
                    f"{what}: after step {t + 1}, rank {rank}'s flat[{i}] is "
                    f"{got[i].item():.6g}; the average of every rank's top-{k} gives "
                    f"{want[i].item():.6g}.{hint}"
                )
                return False
        for rank, (steps, _) in enumerate(results):
            got = steps[t]["residual"]
            right = _kept(corrected[rank], _top(corrected[rank], k))
            if isinstance(got, str):
                report.fail(
                    f"{what}: at step {t + 1}, rank {rank}'s function returned {got}: return "
                    f"the new residual, a tensor of flat's shape ({numel},): corrected with "
                    "the entries this rank sent set to zero"
                )
                return False
            i = worst_element((got - right).abs())
            if i is not None:
                hint = _residual_hint(got, rank, step_grads, given, k, world, t)
                report.fail(
                    f"{what}: after step {t + 1}, rank {rank}'s returned residual[{i}] is "
                    f"{got[i].item():.6g}; what the rank did not send is "
                    f"{right[i].item():.6g}.{hint}"
                )
                return False
    return True


def _communication(report: Report, what: str, results, numel: int, fraction: float) -> bool:
    """Only the kit's collectives (no built-in, no group of torch's own), and no more bytes
    a step than top-k's values and indices: counted where every kit message leaves the
    rank (``ok.p2p``), whatever called it."""
    k = top_k_count(numel, fraction)
    for rank, (steps, traffic) in enumerate(results):
        world = len(results)
        budget = (world - 1) * k * 16  # a ring AllGather of k float32 and k int64: 12 per
        other = sorted({shown(c) for c in traffic.collectives if not c.startswith("ok.")})
        kit = sorted({c for c in traffic.collectives if c.startswith("ok.") and c != _GATHER})
        if traffic.direct or other or kit:
            used = ", ".join(sorted(set(traffic.direct) | set(other) | set(kit)))
            if "all_reduce" in used:
                report.fail(
                    f"{what}: rank {rank} called {used}: an AllReduce of a dense vector sends "
                    f"2(N−1)/N · {4 * numel} bytes, zeros and all, whatever top-k chose; "
                    f"gather only the {k} values and {k} indices with {_GATHER}"
                )
                return False
            advice = f"exchange the values and indices with the kit's {_GATHER}"
            report.fail(
                f"{what}: " + not_over_the_link(rank, used, advice, "what this lab counts, and ")
            )
            return False
        sent = max(s["sent"] for s in steps)
        if sent > budget:
            report.fail(
                f"{what}: rank {rank} sent {sent} bytes in a step; top-{k} on {world} ranks "
                f"sends (N−1)·k values and indices, {(world - 1) * k * 12} bytes (float32 "
                f"and int64). The whole gradient is {4 * numel} bytes: exchanging more than "
                "the chosen entries (a dense vector, every rank's gradient) compresses "
                f"nothing. Gather only the chosen values and their indices with {_GATHER}."
            )
            return False
        if not any(c == _GATHER for c in traffic.collectives):
            report.fail(f"{what}: rank {rank} never called {_GATHER}: gather the chosen values "
                        "and indices with it")  # fmt: skip
            return False
    return True


def check_topk_with_feedback(topk_with_feedback, timeout: float = 30.0) -> Report:
    """Check ``topk_with_feedback(flat, residual, fraction) -> new residual`` on 2 and 3
    ranks, three steps each (see the module docstring)."""
    report = Report("topk_with_feedback")
    cases = [_case(report, topk_with_feedback, *case) for case in CASES]
    run_cases(report, "check_topk_with_feedback", cases, timeout=timeout, explain=_explain)
    return report


def _case(report: Report, topk_with_feedback, world: int, numel: int, fraction: float) -> Case:
    k = top_k_count(numel, fraction)
    what = f"{world} ranks, {numel} elements, fraction {fraction:g} (k = {k})"
    seeds, shared = private_seeds(world), secrets.randbits(62)

    def judge(results) -> bool:
        return _judge(report, what, results, seeds, shared, numel, fraction) and _communication(
            report, what, results, numel, fraction
        )

    passed = (f"{STEPS} steps, every rank's average and residual right; each rank "
              f"gathered {k} values and {k} indices a step")  # fmt: skip
    return Case(what, world, _run, (topk_with_feedback, numel, fraction, shared), judge,
                seeded(seeds), passed)  # fmt: skip


def _explain(text: str) -> str:
    if "topk" in text and ("must be int" in text or "float" in text):
        return (
            " — topk() takes a count: the fraction of the bucket's elements, rounded, "
            "k = max(1, round(fraction · flat.numel()))"
        )
    if "selected index k out of range" in text:
        return " — k is larger than the bucket: k = max(1, round(fraction · flat.numel()))"
    if "disagree on kit operation" in text:
        return ""  # the mismatch's own words say it
    if "ring_all_gather" in text and ("size" in text or "shape" in text):
        return (
            " — ok.ring_all_gather(output, input) needs output to hold N × input's elements, "
            "of input's dtype: torch.empty(world * k) for the values, "
            "torch.empty(world * k, dtype=torch.int64) for the indices"
        )
    return ""
