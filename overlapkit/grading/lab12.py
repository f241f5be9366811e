"""Check for lab 12: a fully sharded step's plan, what to gather, wait, free and reduce when.

The learner's ``fsdp_plan(units, prefetch)`` returns one step's actions for a model of
``units`` units run one after another ("gather K", "wait K", "forward K", "free K",
"backward K", "reduce K", "finish"). A plan is judged by *playing it*: each unit is sharded,
arriving (gathered, not waited) or whole, and the first action that breaks a rule is named
with its position and the rule — not compared with one right plan (several are right: a
unit may be freed before or after the next gather is issued). The rules:

* a unit computes (forward or backward) only when whole: gathered *and* waited, and is
  waited for right before it computes (no other unit computes in between: a wait any
  earlier blocks while nothing computes, and hides nothing);
* forwards run 0 … n−1, then backwards n−1 … 0, each once; a unit is reduced after its
  backward, once, before the next backward starts (so its ReduceScatter travels under it);
  "finish" comes last, after every reduce (the optimizer steps next);
* at most ``prefetch + 1`` units are whole or arriving at once, and each is freed after it
  computes (nothing whole at the end);
* with ``prefetch = p ≥ 1``, unit k's AllGather is issued before the compute p units
  earlier starts (forward k−p, or in backward, backward k+p), so it travels meanwhile;
* nothing is gathered that is not then used, and units are gathered in the order they
  compute (one link carries the AllGathers in the order issued).

Then the plan for 4 units and prefetch 1 runs on 2 ranks (``FullyShardedDP.run_plan``): the
parameters after two SGD steps must equal one process's. Two more cases are drawn at
random each time (3–40 units, prefetch 1–6), so a table of plans for the fixed cases
fails. (What no check in a learner's process rules out: a table of every drawable case
computed before the check with the kit's own code, at the notebook's top level, where no
watch runs. The README's threat model names it.)
"""

from __future__ import annotations

import io
import random

import torch

from ..fsdp import FullyShardedDP, PlanError
from ..launcher import launch
from ..sandbox import answers
from ..sandbox.sealed import seal
from .common import Unfinished, call_or_report, judge_against_one_process
from .exercises import answers_of
from .report import Report

CASES = [(4, 0), (4, 1), (5, 2), (1, 0), (2, 3)]
#: two more are drawn each time from these: 228 plans of up to 400 actions to tabulate
DRAWN = [(n, p) for n in range(3, 41) for p in range(1, 7) if (n, p) not in CASES]
_OPS = ("gather", "wait", "forward", "backward", "free", "reduce")


def check_fsdp_plan(fsdp_plan) -> Report:
    """Check ``fsdp_plan(units, prefetch)`` → a list of actions (see the module docstring)."""
    report = Report("fsdp_plan")
    fsdp_plan = seal(fsdp_plan)  # called on a rank of its own, out of our reach
    rng = random.SystemRandom()
    cases = [*CASES, *rng.sample(DRAWN, 2)]
    quiet = Report(report.exercise, file=io.StringIO())
    plans = []
    with answers.running(answers_of("check_fsdp_plan")) as ran:
        for n, p in cases:
            what = f"{n} unit{'s' if n > 1 else ''}, prefetch {p}"
            try:
                called, plan = call_or_report(quiet, what, fsdp_plan, n, p)
            except Unfinished:
                plans.append((what, None, None, quiet.cases[-1][1]))
                break
            said = quiet.cases[-1][1] if not called else ""
            if "cannot pickle 'generator'" in said:  # the value travels back pickled
                said = f"{what}: return a list of actions, not a generator: list(...) of it"
            plans.append((what, n, p, plan) if called else (what, None, None, said))
    if ran:
        report.fail(f"your function {answers.said(ran)}")
        return report
    runnable = None
    for what, n, p, plan in plans:
        if n is None:
            report.fail(plan)
            continue
        problem = judge_plan(plan, n, p)
        if problem is None:  # the drawn case passes in the same words each time
            said = f"{what}: {len(plan)} actions" if (n, p) in CASES else "a case drawn at random"
            report.ok(f"{said}, every rule kept")
            if (n, p) == (4, 1):
                runnable = plan
        else:
            report.fail(f"{what}: {problem}")
    if runnable is not None:
        _run_on_ranks(report, runnable)
    elif any(n is not None for _, n, _, _ in plans):
        report.fail("4 units, prefetch 1, run on 2 ranks: not run, the plan for that case "
                    "broke a rule (above)")  # fmt: skip
    return report


def judge_plan(plan, n: int, p: int) -> str | None:
    """The first broken rule of ``plan`` for ``n`` units and prefetch ``p``, in words, or
    None when it keeps them all."""
    if not isinstance(plan, (list, tuple)):
        return f"return a list of actions (strings such as 'gather 0'), not {type(plan).__name__}"
    state = ["sharded"] * n  # sharded | arriving | whole
    gathered_at: dict[int, int] = {}  # unit -> position of its last gather
    used = [True] * n  # used since its last gather
    freed_at: dict[int, int] = {}
    forwards, backwards, reduced = [], [], []
    started: dict[tuple[str, int], int] = {}  # (forward|backward, unit) -> position
    gathers: dict[tuple[str, int], int] = {}  # (forward|backward phase, unit) -> position
    finished = None
    waited: dict[int, int] = {}  # unit -> position of its wait, until it computes
    last_gather: dict[str, int] = {}  # phase -> the unit gathered last
    unreduced = None  # (unit, position of its backward) not yet reduced
    for i, action in enumerate(plan, start=1):
        where = f"action {i} {action!r}"
        parsed = _parse(action, n)
        if isinstance(parsed, str):
            return f"{where}: {parsed}"
        op, k = parsed
        if finished is not None:
            return f"{where} comes after 'finish' (action {finished}): 'finish' ends the step"
        phase = "backward" if forwards == list(range(n)) and op != "forward" else "forward"
        if op == "gather":
            if state[k] != "sharded":
                return (f"{where}: unit {k} is already {state[k]} (gathered at action "
                        f"{gathered_at[k]}): a second AllGather moves its bytes twice")  # fmt: skip
            previous = last_gather.get(phase)
            later = previous is not None and (k < previous if phase == "forward" else k > previous)
            if later:  # the link carries AllGathers in the order they were issued
                need = "forward runs 0 up" if phase == "forward" else "backward runs down"
                return (f"{where} comes after 'gather {previous}', but unit {k} is needed "
                        f"first ({need}): one link carries the AllGathers in the order they "
                        f"were issued, so unit {k}'s would wait behind unit {previous}'s. "
                        "Gather in the order the units compute")  # fmt: skip
            last_gather[phase] = k
            state[k], gathered_at[k], used[k] = "arriving", i, False
            gathers.setdefault((phase, k), i)
        elif op == "wait":
            if state[k] == "sharded":
                return (f"{where}: unit {k}'s AllGather was never issued"
                        f"{_since_free(freed_at, k)}: add 'gather {k}' before it")  # fmt: skip
            if state[k] == "whole":
                return f"{where}: unit {k} was already waited for; wait once per gather"
            state[k] = "whole"
            waited[k] = i
        elif op in ("forward", "backward"):
            problem = _compute(op, k, n, i, state, gathered_at, freed_at, forwards, backwards)
            if problem:
                return f"{where}: {problem}"
            early = next((u for u, at in waited.items() if u != k), None)
            if early is not None:  # waited for, then another unit computed first
                return (f"{where}: unit {early} was waited for at action {waited[early]}, "
                        f"before unit {k} computes: the wait blocks until unit {early}'s "
                        f"AllGather is over, so nothing travels under {op} {k}. Wait for a "
                        "unit right before it computes")  # fmt: skip
            waited.pop(k, None)
            if op == "backward" and unreduced is not None:
                return (f"{where} starts before unit {unreduced[0]}'s gradient was reduced "
                        f"(backward {unreduced[0]} at action {unreduced[1]}): reduce each "
                        "unit right after its backward, so that its ReduceScatter travels "
                        "while the next backward computes")  # fmt: skip
            if op == "backward":
                unreduced = (k, i)
            (forwards if op == "forward" else backwards).append(k)
            started[(op, k)] = i
            used[k] = True
        elif op == "free":
            if state[k] == "sharded":
                return (f"{where}: unit {k} is not whole{_since_free(freed_at, k)}; free a unit "
                        "once, after it computes")  # fmt: skip
            if state[k] == "arriving":
                return (f"{where}: unit {k}'s AllGather (action {gathered_at[k]}) was never "
                        "waited: a unit may be freed only once its bytes have arrived")  # fmt: skip
            if not used[k]:
                return (f"{where}: unit {k} was gathered (action {gathered_at[k]}) and freed "
                        "without computing: was that the unit you meant to gather?")  # fmt: skip
            state[k], freed_at[k] = "sharded", i  # before or after its reduce: both right
        elif op == "reduce":
            if k not in backwards:
                return (f"{where} before backward {k}: unit {k}'s gradient is not complete yet; "
                        "reduce each unit right after its backward")  # fmt: skip
            if k in reduced:
                return f"{where}: unit {k} was already reduced; each unit is reduced once"
            reduced.append(k)
            unreduced = None
        else:  # finish
            missing = [k for k in range(n) if k not in reduced]
            if missing:
                return (f"{where}: 'finish' waits for the ReduceScatters, but unit(s) "
                        f"{_units(missing)} were never reduced: the optimizer would step on "
                        "shards without their gradient")  # fmt: skip
            finished = i
        held = [u for u in range(n) if state[u] != "sharded"]
        if len(held) > p + 1:
            return (f"{where}: units {_units(held)} are whole or arriving at once; prefetch "
                    f"{p} allows {p + 1} (the unit computing and {p} ahead): free each unit "
                    "after it computes, and gather no further ahead")  # fmt: skip
    return _at_the_end(n, p, state, gathered_at, forwards, backwards, finished, started, gathers)


def _parse(action, n: int):
    words = action.split() if isinstance(action, str) else None
    if words == ["finish"]:
        return "finish", None
    number = words[1].removeprefix("-") if words and len(words) == 2 else ""
    if not words or len(words) != 2 or words[0] not in _OPS or not number.isdigit():
        return ("expected 'gather K', 'wait K', 'forward K', 'backward K', 'free K', "
                "'reduce K' or 'finish' (strings, one action each)")  # fmt: skip
    k = int(words[1])
    if not 0 <= k < n:
        return f"there {'is 1 unit' if n == 1 else f'are {n} units'}, 0 to {n - 1}"
    return words[0], k


def _since_free(freed_at: dict, k: int) -> str:
    return f" since it was freed at action {freed_at[k]}" if k in freed_at else ""


def _units(units) -> str:
    return ", ".join(map(str, units))


def _compute(op, k, n, i, state, gathered_at, freed_at, forwards, backwards) -> str | None:
    if op == "forward":
        want = len(forwards)
        if want == n:
            return f"every unit already ran its forward; unit {k}'s backward comes next"
        if k != want:
            return f"the units run in order, 0 to {n - 1}: forward {want} comes next"
    else:
        if len(forwards) < n:
            return (f"backward starts after the last forward; forward {len(forwards)} has not "
                    "run yet")  # fmt: skip
        want = n - 1 - len(backwards)
        if want < 0:
            return f"every unit already ran its backward; unit {k} backward twice"
        if k != want:
            return f"backward runs from the last unit to the first: backward {want} comes next"
    if state[k] == "arriving":
        return (f"unit {k}'s parameters are used before its AllGather (action {gathered_at[k]}) "
                f"was waited: its bytes may still be arriving; add 'wait {k}' first")  # fmt: skip
    if state[k] == "sharded":
        if op == "backward" and k in freed_at:
            return (f"unit {k} was freed at action {freed_at[k]} after its forward, and "
                    f"backward needs its parameters again: gather and wait it before "
                    f"backward {k}")  # fmt: skip
        return (f"unit {k} is not whole{_since_free(freed_at, k)}: gather it and wait for it "
                "first")  # fmt: skip
    return None


def _at_the_end(n, p, state, gathered_at, forwards, backwards, finished, started, gathers):
    if len(forwards) < n:
        return f"forward {len(forwards)} never runs: every unit runs its forward, 0 to {n - 1}"
    if len(backwards) < n:
        return f"backward {n - 1 - len(backwards)} never runs: every unit runs its backward"
    if finished is None:
        return ("the plan ends without 'finish': the optimizer would step on shards whose "
                "ReduceScatter may still be running")  # fmt: skip
    whole = [k for k in range(n) if state[k] != "sharded"]
    if whole:
        return (f"unit(s) {_units(whole)} still whole at the end of the step (gathered at "
                f"action {gathered_at[whole[0]]}): free each unit after its backward")  # fmt: skip
    if p >= 1:
        for k in range(n):  # forward: gathered before forward k−p starts
            before = max(0, k - p)
            if ("forward", k) in gathers and gathers[("forward", k)] > started[("forward", before)]:
                return (f"prefetch {p}: unit {k}'s AllGather should be issued before forward "
                        f"{before} starts (action {started[('forward', before)]}), so that it "
                        f"travels while unit {before} computes; yours is action "
                        f"{gathers[('forward', k)]}")  # fmt: skip
        for k in reversed(range(n)):  # backward (the first offence first): re-gathered
            # before backward k+p starts
            before = min(n - 1, k + p)
            spot = gathers.get(("backward", k))
            if spot is not None and spot > started[("backward", before)]:
                return (f"prefetch {p}: in backward, unit {k}'s AllGather should be issued "
                        f"before backward {before} starts (action "
                        f"{started[('backward', before)]}), so that it travels meanwhile; "
                        f"yours is action {spot}")  # fmt: skip
    return None


# --------------------------------------------------------------------------- running it


def _model(units: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(units)])


def _train_by_plan(plan):
    """Two SGD steps by the plan beside one process on the whole batch: the largest
    difference of any parameter, or the plan's error."""
    import overlapkit as ok  # noqa: PLC0415

    me, world = ok.rank(), ok.world_size()
    sharded, alone = FullyShardedDP(_model(4)), _model(4)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    ref = torch.optim.SGD(alone.parameters(), lr=0.1)
    loss = torch.nn.functional.mse_loss
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * world, 8, generator=gen), torch.randn(4 * world, 8, generator=gen)
        mine = slice(4 * me, 4 * me + 4)
        try:
            sharded.run_plan(plan, x[mine], y[mine], loss)
        except PlanError as exc:
            return str(exc)
        opt.step()
        opt.zero_grad()
        loss(alone(x), y).backward()
        ref.step()
        ref.zero_grad()
    whole = sharded.full_state_dict()
    return max((whole[k] - v).abs().max().item() for k, v in alone.state_dict().items())


def _run_on_ranks(report: Report, plan) -> None:
    what = "4 units, prefetch 1, run on 2 ranks (2 SGD steps)"
    results = launch(_train_by_plan, list(plan), world_size=2, timeout=60)
    judge_against_one_process(report, what, results)
