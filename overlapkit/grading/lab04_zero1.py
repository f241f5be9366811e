"""Checks for lab 04: one ZeRO-1 optimizer step built from ReduceScatter and AllGather, and
the memory per rank it leaves.

``check_zero1_step`` runs the learner's step for 10 steps on 3 ranks next to an unsharded
reference that every rank computes alone (each rank knows every rank's batch), so the only
collectives recorded are the learner's. A wrong update is named by what it is: the sum,
the sum over a fixed number, this rank's own gradient, another rank's slice, the gradient
itself gathered, a NaN read before a wait, a shard without ``.grad``.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from .. import handles
from ..sandbox import answers
from ..sandbox.sealed import seal
from ..sharded import flatten_padded, unflatten_into
from .cases import Case, count_not_reached, private_seeds, run_cases, seeded
from .common import plain_number, refused_rank, worst_element
from .exercises import answers_of
from .mistakes import WAIT_BEFORE_READING, never_waited
from .report import Report
from .traffic import shown

STEPS, LR, MOMENTUM = 10, 0.05, 0.9
_RS, _AG = "ok.ring_reduce_scatter", "ok.ring_all_gather"
_ALL_REDUCES = ("ok.ring_all_reduce", "ok.naive_all_reduce", "ok.bucketed_all_reduce")
_POISON = (
    "the check poisons a kit operation's output with NaN until its wait() returns (the "
    "race guard), so a NaN is a value read before its wait()"
)


def _model():
    torch.manual_seed(0)  # the same model on every rank
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _grads_at(model, params, flat, batches, padded):
    """Every rank's flat gradient at the parameters ``flat`` (one row per rank's batch)."""
    with torch.no_grad():
        unflatten_into(params, flat)
    rows = []
    for x, y in batches:
        torch.nn.functional.mse_loss(model(x), y).backward()
        rows.append(flatten_padded(params, padded, [p.grad for p in params]))
        for p in params:
            p.grad = None
    return torch.stack(rows)


def _run(zero1_step, seed):
    """On each rank: its own batches only (``seed``, drawn by the checking process and
    sent to this rank alone), so no rank can average the gradients without the
    ReduceScatter; the unsharded reference is worked out by the checking process
    (:func:`_references`), so nothing on this rank's stack holds the answer."""
    import overlapkit as ok  # noqa: PLC0415

    me, world = ok.rank(), ok.world_size()
    model = _model()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    n = -(-numel // world)
    padded = n * world
    flat_params = flatten_padded(params, padded)
    shard = torch.nn.Parameter(flat_params[me * n : (me + 1) * n].clone())
    # SGD with momentum, not Adam: Adam is nearly blind to the gradient's scale, so it
    # could not tell a summed gradient from an averaged one
    optimizer = torch.optim.SGD([shard], lr=LR, momentum=MOMENTUM)
    gen = torch.Generator().manual_seed(seed)
    del seed
    steps = []
    for _ in range(STEPS):
        batch = (torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen))
        before = flat_params.clone()
        grad = _grads_at(model, params, flat_params, [batch], padded)[0]  # at the learner's
        shard_before = shard.detach().clone()
        with torch.no_grad():
            zero1_step(flat_params, grad, shard, optimizer)
        unwaited = handles.take_unwaited()
        steps.append(
            {
                "before": before,
                "after": flat_params.clone(),
                "shard before": shard_before,
                "shard after": shard.detach().clone(),
                "shard grad": None if shard.grad is None else shard.grad.detach().clone(),
                "unwaited": unwaited,
            }
        )
    state = sum(t.numel() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    return {"steps": steps, "state": state, "numel": numel, "n": n}


def _references(values: list[dict], seeds: list[int]) -> None:
    """In the checking process: per step, every rank's gradient at the parameters each
    rank held (``grads``), the unsharded optimizer's momentum before the step (``buf``) and
    its parameters after it (``want``), on the averaged gradients."""
    with torch.random.fork_rng(devices=[]):  # _model seeds torch: not the notebook's
        model = _model()
    params = list(model.parameters())
    world = len(seeds)
    padded = -(-sum(p.numel() for p in params) // world) * world
    reference = torch.nn.Parameter(flatten_padded(params, padded).clone())
    plain = torch.optim.SGD([reference], lr=LR, momentum=MOMENTUM)
    gens = [torch.Generator().manual_seed(seed) for seed in seeds]
    for t in range(STEPS):
        batches = [(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)) for g in gens]
        buf = plain.state.get(reference, {}).get("momentum_buffer")
        buf = torch.zeros(padded) if buf is None else buf.clone()
        for res in values:
            step = res["steps"][t]
            step["grads"] = _grads_at(model, params, step["before"], batches, padded)
            step["buf"] = buf
        reference.grad = _grads_at(model, params, reference.detach(), batches, padded).mean(0)
        plain.step()
        for res in values:
            res["steps"][t]["want"] = reference.detach().clone()


# --------------------------------------------------------------------------- what went wrong


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-3, atol=1e-5))


def _update_hint(results, r: int, t: int, i: int, world: int) -> str:
    """Why rank ``r``'s parameter ``i`` is wrong after step ``t``, in the exercise's terms."""
    n = results[0]["n"]
    o = i // n  # the rank whose optimizer owns this element
    part = slice(o * n, (o + 1) * n)
    mine, owner = results[r]["steps"][t], results[o]["steps"][t]
    got, before, want = mine["after"][part], mine["before"][part], mine["want"][part]
    grads = owner["grads"]
    avg = grads.mean(0)
    if got.isnan().any():
        if owner["shard after"].isnan().any():
            return (
                f" NaN: {_POISON}. Rank {o}'s optimizer stepped on a NaN gradient: the "
                "ReduceScatter's output went into shard.grad / optimizer.step() before "
                "handle.wait(). Wait for the ReduceScatter first."
            )
        return (
            f" NaN, while rank {o}'s shard is fine: {_POISON}. The gathered parameters were "
            "read (copied into flat_params) before the AllGather's wait(): wait first."
        )
    moved = not torch.equal(owner["shard after"], owner["shard before"])
    if owner["shard grad"] is None and not moved:
        return (
            f" The optimizer never saw a gradient: rank {o}'s shard parameter has no .grad "
            "when optimizer.step() runs (SGD skips a parameter whose .grad is None), so the "
            "shard never moved. Set shard.grad to this rank's reduced slice of the gradient "
            "before optimizer.step()."
        )
    if _close(owner["shard after"], want):  # the optimizer did its part: the gather did not
        return _gather_hint(results, r, t, o, part, got, before, avg, world)
    # the optimizer's update went wrong: which gradient did it step on?
    return _gradient_hint(results, r, t, o, part, avg, world)


def _gather_hint(results, r: int, t: int, o: int, part: slice, got, before, avg, world: int) -> str:
    """Why rank ``r``'s part from rank ``o`` is wrong when ``o``'s optimizer updated it right:
    the AllGather went wrong."""
    mine, grads = results[r]["steps"][t], results[o]["steps"][t]["grads"]
    if torch.equal(mine["after"], mine["before"]) and results[r]["gathers"]:
        return (
            f" flat_params did not change on rank {r}, not even rank {r}'s own shard, which "
            "its optimizer did update, though it called an AllGather: write the gathered "
            "parameters into flat_params itself (ok.ring_all_gather(flat_params, "
            "shard.detach()), or flat_params.copy_(…)); binding the name to a new tensor "
            "does not change the caller's."
        )
    if torch.equal(got, before):
        return (
            " This part did not change at all: the updated shard never reached this "
            "rank. All-gather every rank's shard into flat_params after optimizer.step()."
        )
    if _close(got, avg[part]) or _close(got, grads.sum(0)[part]):
        return (
            " That value is a gradient, not a parameter: flat_params holds the gathered "
            "shard.grad. All-gather the updated parameters, shard.detach(), after "
            "optimizer.step()."
        )
    for k in range(world):
        if k != o and _close(got, results[k]["steps"][t]["shard after"]):
            return (
                f" It is rank {k}'s updated shard, at rank {o}'s place: the AllGather "
                "concatenates the shards in rank order, rank r's at [r·n, (r+1)·n)."
            )
    return (
        f" Rank {o}'s optimizer updated its shard right; what arrived here differs: "
        "all-gather the updated shards (shard.detach()) into flat_params."
    )


def _gradient_hint(results, r: int, t: int, o: int, part: slice, avg, world: int) -> str:
    """Why rank ``o``'s optimizer updated its shard wrong: the gradient it stepped on."""
    n = results[0]["n"]
    mine, owner = results[r]["steps"][t], results[o]["steps"][t]
    grads = owner["grads"]
    used = (owner["shard before"] - owner["shard after"]) / LR - MOMENTUM * mine["buf"][part]
    right = avg[part]
    nonzero = right.abs() > 1e-6
    ratio = (used[nonzero] / right[nonzero]).median().item() if nonzero.any() else math.nan
    if world > 1 and _close(used, right * world):
        return (
            f" Your update is {ratio:.2f}× the right one, about N = {world}: the gradients "
            "were summed, not averaged (ring_reduce_scatter(..., op='avg'))."
        )
    if world > 1 and _close(used, right / world):
        return (
            f" Your update is {ratio:.2f}× the right one, 1/N with N = {world}: the average "
            "was divided by N once more (op='avg' already divides by the world size)."
        )
    for k in range(2, 17):
        if k != world and _close(used, right * world / k):
            return (
                f" Your update is {ratio:.2f}× the right one: N/{k} with N = {world} — the "
                f"sum divided by {k}, a world size written as a number. Divide by "
                "ok.world_size() (or op='avg'), which holds on any number of ranks."
            )
    if world > 1 and _close(used, grads[o][part]):
        return (
            f" The update there is rank {o}'s own gradient, not reduced over the ranks "
            f"({ratio:.2f}× the right one at the median element): rank {o}'s batch only. "
            "Reduce-scatter the gradients (ok.ring_reduce_scatter(grad, flat_grads, "
            f"op='avg')) so its optimizer steps on the average over the {world} ranks."
        )
    for k in range(world):
        sl = slice(k * n, (k + 1) * n)
        if k != o and _close(used, avg[sl]):
            return (
                f" Rank {o}'s optimizer stepped on the averaged gradient of rank {k}'s slice "
                f"(elements {k * n}…{(k + 1) * n - 1}), not of its own ({o * n}…"
                f"{(o + 1) * n - 1}): rank r's shard is flat[r·n:(r+1)·n], the part "
                "ring_reduce_scatter delivers to rank r."
            )
        if k != o and _close(used, grads[o][sl]):
            return (
                f" Rank {o}'s optimizer stepped on its own, unreduced gradient of rank {k}'s "
                f"slice: it needs the average over the ranks of its own slice "
                f"({o * n}…{(o + 1) * n - 1}), which ring_reduce_scatter(..., op='avg') "
                "delivers."
            )
    return f" Your update is {ratio:.2f}× the right one there."


def _explain(text: str) -> str:
    if "already in flight in an earlier operation that was not waited yet" in text:
        return (
            ". The operation of the step before on that tensor was never waited: wait() for "
            "every handle before zero1_step returns (until then the check keeps its output "
            "NaN)"
        )
    return ""


def _first_wrong_shard(diff, n: int) -> int | None:
    """The worst element of the lowest-numbered shard that is off: the message then names
    the same shard every run (the batches are drawn afresh each time, and the worst element
    of the whole vector wanders from shard to shard)."""
    for lo in range(0, diff.numel(), n):
        i = worst_element(diff[lo : lo + n])
        if i is not None:
            return lo + i
    return None


def _values(report: Report, what: str, results, world: int) -> bool:
    for rank, res in enumerate(results):
        unwaited = [u for s in res["steps"] for u in s["unwaited"]]
        if unwaited:
            nan = any(s["after"].isnan().any() for s in res["steps"])
            read = f"; flat_params then held NaN ({_POISON})" if nan else ""
            report.fail(never_waited(what, rank, unwaited, WAIT_BEFORE_READING, read))
            return False
    numel = results[0]["numel"]
    for t in range(STEPS):  # the first step where any rank is off: all agreed before it
        for rank, res in enumerate(results):
            step = res["steps"][t]
            got, want = step["after"][:numel], step["want"][:numel]
            i = _first_wrong_shard((got - want).abs(), res["n"])
            if i is None:
                continue
            hint = _update_hint(results, rank, t, i, world)
            report.fail(
                f"after step {t + 1}, rank {rank}'s parameter {i} (in rank {i // res['n']}'s "
                f"shard) is {got[i].item():.6g}; unsharded SGD on the averaged gradients "
                f"gives {want[i].item():.6g}.{hint}"
            )
            return False
    return True


def _communication(report: Report, what: str, results, world: int) -> bool:
    """One ok.ring_reduce_scatter and one ok.ring_all_gather per step, nothing else."""
    nbytes = results[0][0]["n"] * world * 4  # S: the flat fp32 gradient
    rs = (world - 1) * nbytes // world
    for rank, (_, traffic) in enumerate(results):
        builtin = [shown(c) for c in traffic.collectives if not c.startswith("ok.")]
        if refused_rank(report, what, rank, {"builtin": builtin}, traffic,
                        f"one step is {_RS} of the gradients and {_AG} of the updated "
                        "shards"):  # fmt: skip
            return False
        calls = Counter(traffic.collectives)
        whole = [c for c in _ALL_REDUCES if calls[c]]
        if whole and not calls[_RS]:
            report.fail(
                f"{what}: rank {rank} all-reduced the whole gradient ({', '.join(whole)}): a "
                f"ring AllReduce of S = {nbytes} bytes sends 2(N−1)/N·S = {2 * rs} bytes per "
                f"rank, twice the (N−1)/N·S = {rs} of a ReduceScatter, and rank {rank}'s "
                "optimizer uses only its shard of it (with the AllGather, the step sends "
                "1.5× the bytes it needs). Reduce-scatter it (ok.ring_reduce_scatter(grad, "
                "flat_grads, op='avg')), so each rank receives only its shard's sum."
            )
            return False
        if whole:
            report.fail(
                f"{what}: rank {rank} called {', '.join(whole)} besides the ReduceScatter: "
                f"the updated shards only need gathering, {_AG}(flat_params, shard.detach()) "
                f"sends (N−1)/N·S = {rs} bytes per rank, an AllReduce twice that."
            )
            return False
        if calls != Counter({_RS: STEPS, _AG: STEPS}):
            said = ", ".join(f"{c} {k}×" for c, k in sorted(calls.items())) or "no collective"
            report.fail(
                f"{what}: in {STEPS} steps rank {rank} called {said}: one step is one "
                f"{_RS} of the gradients and one {_AG} of the updated shards, "
                f"{STEPS} of each."
            )
            return False
    return True


def _state(report: Report, results) -> None:
    states = [res["state"] for res, _ in results]
    n, numel = results[0][0]["n"], results[0][0]["numel"]
    if all(s == n for s in states):
        report.ok(f"each rank holds momentum for its shard only: {n} of {numel} values")
    elif not any(states):
        never = all(s["shard grad"] is None for res, _ in results for s in res["steps"])
        why = (
            ": optimizer.step() never had a gradient to apply (shard.grad was None on every "
            "rank, every step). Set shard.grad to the rank's reduced slice before stepping"
            if never
            else ": optimizer.step() never ran with a gradient"
        )
        report.fail(f"no rank's optimizer holds any momentum (state per rank {states}){why}")
    else:
        report.fail(f"optimizer state per rank is {states} values; expected {n} (the shard)")


def check_zero1_step(zero1_step, world_size: int = 3, timeout: float = 60.0) -> Report:
    """Check ``zero1_step(flat_params, flat_grads, shard, optimizer)`` against the unsharded step.

    Over 10 steps on ``world_size`` ranks (SGD with momentum), every rank's full
    parameter vector must match the unsharded optimizer on the averaged gradients, with
    one ``ok.ring_reduce_scatter`` and one ``ok.ring_all_gather`` per step, and each
    rank's optimizer state must cover its shard only.
    """
    report = Report("zero1_step")
    what = f"zero1_step on {world_size} ranks"
    seeds = private_seeds(world_size)

    def references(results) -> bool:  # the verdict comes below, in cases of its own
        _references([res for res, _ in results], seeds)
        for res, traffic in results:
            res["gathers"] = any("all_gather" in c for c in traffic.collectives)
        return True

    case = Case(what, world_size, _run, (zero1_step,), references, seeded(seeds))
    results = run_cases(report, "check_zero1_step", [case], timeout=timeout, explain=_explain)
    if results is None:
        return report
    values = [res for res, _ in results]
    right = _values(report, what, values, world_size)
    built = right and _communication(report, what, results, world_size)
    if built:
        report.ok(
            f"{STEPS} steps on {world_size} ranks: every rank matches the unsharded optimizer, "
            "with one ReduceScatter and one AllGather of the kit per step"
        )
    if right and not built:  # the sharded state earns nothing for a step the kit did not make
        report.fail("optimizer state per shard: not judged, the step above is not built from "
                    "the kit's ReduceScatter and AllGather")  # fmt: skip
        return report
    _state(report, results)
    return report


# --------------------------------------------------------------------------- memory per rank

#: fp32 values of optimizer state per parameter
STATES = {"adam": 2, "sgd-momentum": 1}
#: (n_params, world_size, optimizer, zero1): the lab's measured model, plain DDP, SGD, and
#: sizes not divisible by N (the shard is padded). No N = 2 or 4 with this model: there two
#: typical mistakes give one number (e.g. params sharded on N = 4, 4n/4 bytes, and the
#: count of values n; SGD with two states on N = 2 and its whole state, 4n)
MEMORY_CASES = (
    (1_312_000, 1, "adam", True),
    (1_312_000, 8, "adam", True),
    (1_312_000, 8, "adam", False),
    (1_312_000, 3, "sgd-momentum", True),
    (1_000_003, 3, "adam", True),
    (10, 4, "sgd-momentum", True),
)
_KEYS = ("params", "grads", "optimizer_state")


def memory_reference(n_params: int, world_size: int, optimizer: str = "adam",
                     zero1: bool = True) -> dict:  # fmt: skip
    """Bytes per rank (fp32) of parameters, gradients and per-element optimizer state,
    under ZeRO-1 (state for the padded shard only) or plain data parallelism."""
    whole = 4 * n_params
    shard = -(-n_params // world_size) if zero1 else n_params
    return {"params": whole, "grads": whole, "optimizer_state": 4 * STATES[optimizer] * shard}


def _memory_hint(key, got, want, n_params, world, optimizer, zero1) -> str:
    k = STATES[optimizer]
    shard = -(-n_params // world)

    def near(x):
        return math.isclose(got, x, rel_tol=1e-12, abs_tol=1e-6)

    if near(want / 4):
        return " That is a count of values, not bytes: each fp32 value takes 4 bytes."
    if key != "optimizer_state":
        if zero1 and world > 1 and (near(4 * shard) or near(4 * n_params / world)):
            return (
                " ZeRO-1 shards only the optimizer state: every rank keeps all parameters "
                "and all gradients (sharding those is ZeRO-2 and ZeRO-3)."
            )
        if not zero1 and world > 1 and near(want / world):
            return " Plain data parallelism shards nothing: every rank holds all of it."
        return ""
    per = shard if zero1 else n_params
    if zero1 and world > 1 and near(4 * k * n_params):
        return (
            " That is the whole state, every rank's under plain data parallelism: under "
            f"ZeRO-1 each rank keeps its shard's only, ceil(n/N) = {shard:,} values per state."
        )
    if not zero1 and world > 1 and near(4 * k * shard):
        return " Plain data parallelism (zero1=False) shards nothing: every rank keeps all state."
    padded = (
        f" The shard is padded: n = {n_params:,} on N = {world} ranks is not a multiple of N, "
        f"so every rank's shard holds ceil(n/N) = {shard:,} values"
    )
    if zero1 and world > 1 and near(4 * k * (n_params // world)):
        return padded + f" (n // N = {n_params // world:,} drops the remainder)."
    if zero1 and world > 1 and near(4 * k * n_params / world):
        return padded + (
            f" (n / N = {n_params / world:,.2f} is no whole number of values: round it up, "
            "ceil(n/N) or -(-n // N))."
        )
    if optimizer == "adam" and near(4 * per):
        return (
            " Adam keeps two values per parameter, exp_avg and exp_avg_sq: 8 bytes of state "
            "per parameter, not 4."
        )
    if optimizer == "sgd-momentum" and near(8 * per):
        return " SGD with momentum keeps one buffer per parameter (momentum_buffer): 4 bytes."
    return ""


def check_memory_per_rank(memory_per_rank) -> Report:
    """Check ``memory_per_rank(n_params, world_size, optimizer, zero1)`` -> dict of bytes per
    rank (``params``, ``grads``, ``optimizer_state``; fp32, per-element state only)."""
    report = Report("memory_per_rank")
    memory_per_rank = seal(memory_per_rank)  # called on a rank of its own, out of our reach
    labels = [f"memory_per_rank({n:,}, {w}, {o!r}, zero1={z})" for n, w, o, z in MEMORY_CASES]
    for k, (n_params, world, optimizer, zero1) in enumerate(MEMORY_CASES):
        label = labels[k]
        try:
            with answers.running(answers_of("check_memory_per_rank")) as ran:
                got = memory_per_rank(n_params, world, optimizer, zero1)
        except NotImplementedError:
            report.fail(f"{label}: not implemented yet (still raises NotImplementedError)")
            count_not_reached(report, labels[k + 1 :])  # each counts as failed
            return report
        except Exception as exc:  # noqa: BLE001 - a crash is one ✘ line
            report.fail(f"{label} raised {type(exc).__name__}: {exc}")
            continue
        if ran:
            report.fail(f"{label}: your function {answers.said(ran)}")
            return report
        want = memory_reference(n_params, world, optimizer, zero1)
        if not isinstance(got, dict) or set(_KEYS) - set(got):
            report.fail(
                f"{label} returned {got!r}: return a dict with the keys 'params', 'grads' "
                "and 'optimizer_state' (bytes per rank)"
            )
            continue
        wrong = None
        for key in _KEYS:
            value = got[key]
            right = plain_number(value) and (  # a subclass's == could agree with anything
                value == want[key]
                # Adam's step counter: one fp32 scalar, as the measured table counts it
                or (key == "optimizer_state" and optimizer == "adam" and value == want[key] + 4)
            )
            if not right:
                wrong = key
                break
        if wrong is None:
            report.ok(
                f"{label}: params {want['params']:,} B, grads {want['grads']:,} B, "
                f"optimizer state {want['optimizer_state']:,} B"
            )
            continue
        value = got[wrong]
        hint = (
            _memory_hint(wrong, value, want[wrong], n_params, world, optimizer, zero1)
            if plain_number(value)
            else f" That is a {type(value).__name__}: return a plain int, a number of bytes."
        )
        report.fail(f"{label}: {wrong!r} should be {want[wrong]:,} bytes, got {value!r}.{hint}")
    return report
