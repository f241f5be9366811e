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
watch runs. The grading guide's threat model, book/grading.md, names it.)
"""

from __future__ import annotations

import io
import random

import torch

from ..fsdp import FullyShardedDP, PlanError
from ..launcher import launch
from ..plans import FSDP, Finish, PlanSyntaxError, Problem, UnitAction
from ..sandbox import answers
from ..sandbox.sealed import seal
from .cases import not_reached
from .common import Unfinished, call_or_report, judge_against_one_process
from .exercises import answers_of
from .report import Report

CASES = [(4, 0), (4, 1), (5, 2), (1, 0), (2, 3)]
#: two more are drawn each time from these: 228 plans of up to 400 actions to tabulate
DRAWN = [(n, p) for n in range(3, 41) for p in range(1, 7) if (n, p) not in CASES]


def _what(case: tuple[int, int]) -> str:
    n, p = case
    return f"{n} unit{'s' if n > 1 else ''}, prefetch {p}"


def check_fsdp_plan(fsdp_plan) -> Report:
    """Check ``fsdp_plan(units, prefetch)`` → a list of actions (see the module docstring)."""
    report = Report("fsdp_plan")
    fsdp_plan = seal(fsdp_plan)  # called on a rank of its own, out of our reach
    rng = random.SystemRandom()
    cases = [*CASES, *rng.sample(DRAWN, 2)]
    quiet = Report(report.exercise, file=io.StringIO())
    plans, whats = [], [_what(case) for case in cases]  # named here: not while watched
    with answers.running(answers_of("check_fsdp_plan")) as ran:
        for (n, p), what in zip(cases, whats, strict=True):
            try:
                called, plan = call_or_report(quiet, what, fsdp_plan, n, p)
            except Unfinished:  # the cases after it are not reached: counted below
                plans.append((what, None, None, quiet.cases[-1][1]))
                break
            said = quiet.cases[-1][1] if not called else ""
            if "cannot pickle 'generator'" in said:  # the value travels back pickled
                said = f"{what}: return a list of actions, not a generator: list(...) of it"
            plans.append((what, n, p, plan) if called else (what, None, None, said))
    if ran:
        report.fail(f"your function {answers.said(ran)}")
        return report
    # after the watch: code of this module run while it watched would count as the answer's
    plans += [(w, None, None, not_reached(w)) for w in whats[len(plans) :]]
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
            if problem.at is not None:  # the plan, the broken action in brackets
                report._print(f"    {FSDP.mark(plan, problem.at)}")
    if runnable is not None:
        _run_on_ranks(report, runnable)
    elif any(n is not None for _, n, _, _ in plans):
        report.fail("4 units, prefetch 1, run on 2 ranks: not run, the plan for that case "
                    "broke a rule (above)")  # fmt: skip
    return report


def judge_plan(plan, n: int, p: int) -> str | None:
    """The first broken rule of ``plan`` for ``n`` units and prefetch ``p``, in words, or
    None when it keeps them all: a :class:`~overlapkit.plans.Problem`, whose ``at`` is the
    index of the action that broke it."""
    if not isinstance(plan, (list, tuple)):
        return Problem(
            f"return a list of actions (strings such as 'gather 0'), not {type(plan).__name__}"
        )
    play = _Play(n, p)
    for i, action in enumerate(plan, start=1):
        where = f"action {i} {action!r}"
        step = _read(action, n)
        if isinstance(step, str):
            return Problem(f"{where}: {step}", i - 1)
        if play.finished is not None:
            return Problem(f"{where} comes after 'finish' (action {play.finished}): 'finish' "
                           "ends the step", i - 1)  # fmt: skip
        problem = play.do(step, i, where)
        if problem is not None:
            return Problem(problem, i - 1)
    return play.at_the_end(len(plan))


def _read(action, n: int):
    """The step ``action`` is (:data:`overlapkit.plans.FSDP`'s words), or why it is none."""
    try:
        step = FSDP.parse_step(action) if isinstance(action, str) else None
    except PlanSyntaxError:
        step = None
    if step is None:
        return f"expected {FSDP.expected()} (strings, one action each)"
    if isinstance(step, UnitAction) and not 0 <= step.unit < n:
        return f"there {'is 1 unit' if n == 1 else f'are {n} units'}, 0 to {n - 1}"
    return step


def _since_free(freed_at: dict, k: int) -> str:
    return f" since it was freed at action {freed_at[k]}" if k in freed_at else ""


def _units(units) -> str:
    return ", ".join(map(str, units))


class _Play:
    """A plan played action by action (positions are 1-based): each unit sharded, arriving
    (gathered, not waited) or whole, and what ran where. Each action's method returns the
    rule it breaks, in words, or None once the play has moved on."""

    def __init__(self, n: int, p: int):
        self.n, self.p = n, p
        self.state = ["sharded"] * n  # sharded | arriving | whole
        self.gathered_at: dict[int, int] = {}  # unit -> position of its last gather
        self.used = [True] * n  # used since its last gather
        self.freed_at: dict[int, int] = {}
        self.forwards, self.backwards, self.reduced = [], [], []
        self.started: dict[tuple[str, int], int] = {}  # (forward|backward, unit) -> position
        self.gathers: dict[tuple[str, int], int] = {}  # (forward|backward phase, unit) -> position
        self.finished = None
        self.waited: dict[int, int] = {}  # unit -> position of its wait, until it computes
        self.last_gather: dict[str, int] = {}  # phase -> the unit gathered last
        self.unreduced = None  # (unit, position of its backward) not yet reduced

    def do(self, step, i: int, where: str) -> str | None:
        if isinstance(step, Finish):
            problem = self.finish(i, where)
        elif step.op in ("forward", "backward"):
            problem = self.compute(step.op, step.unit, i, where)
        else:
            problem = getattr(self, step.op)(step.unit, i, where)
        if problem is not None:
            return problem
        held = [u for u in range(self.n) if self.state[u] != "sharded"]
        if len(held) > self.p + 1:
            p = self.p
            return (f"{where}: units {_units(held)} are whole or arriving at once; prefetch "
                    f"{p} allows {p + 1} (the unit computing and {p} ahead): free each unit "
                    "after it computes, and gather no further ahead")  # fmt: skip
        return None

    def gather(self, k: int, i: int, where: str) -> str | None:
        state, at = self.state, self.gathered_at.get(k)
        if state[k] != "sharded":
            return (f"{where}: unit {k} is already {state[k]} (gathered at action {at}): a "
                    "second AllGather moves its bytes twice")  # fmt: skip
        phase = "backward" if self.forwards == list(range(self.n)) else "forward"
        previous = self.last_gather.get(phase)
        later = previous is not None and (k < previous if phase == "forward" else k > previous)
        if later:  # the link carries AllGathers in the order they were issued
            need = "forward runs 0 up" if phase == "forward" else "backward runs down"
            return (f"{where} comes after 'gather {previous}', but unit {k} is needed "
                    f"first ({need}): one link carries the AllGathers in the order they "
                    f"were issued, so unit {k}'s would wait behind unit {previous}'s. "
                    "Gather in the order the units compute")  # fmt: skip
        self.last_gather[phase] = k
        state[k], self.gathered_at[k], self.used[k] = "arriving", i, False
        self.gathers.setdefault((phase, k), i)
        return None

    def wait(self, k: int, i: int, where: str) -> str | None:
        if self.state[k] == "sharded":
            return (f"{where}: unit {k}'s AllGather was never issued"
                    f"{_since_free(self.freed_at, k)}: add 'gather {k}' before it")  # fmt: skip
        if self.state[k] == "whole":
            return f"{where}: unit {k} was already waited for; wait once per gather"
        self.state[k] = "whole"
        self.waited[k] = i
        return None

    def compute(self, op: str, k: int, i: int, where: str) -> str | None:
        problem = self._in_order(op, k) or self._whole(op, k)
        if problem:
            return f"{where}: {problem}"
        early = next((u for u, at in self.waited.items() if u != k), None)
        if early is not None:  # waited for, then another unit computed first
            return (f"{where}: unit {early} was waited for at action {self.waited[early]}, "
                    f"before unit {k} computes: the wait blocks until unit {early}'s "
                    f"AllGather is over, so nothing travels under {op} {k}. Wait for a "
                    "unit right before it computes")  # fmt: skip
        self.waited.pop(k, None)
        if op == "backward" and self.unreduced is not None:
            u, at = self.unreduced
            return (f"{where} starts before unit {u}'s gradient was reduced "
                    f"(backward {u} at action {at}): reduce each "
                    "unit right after its backward, so that its ReduceScatter travels "
                    "while the next backward computes")  # fmt: skip
        if op == "backward":
            self.unreduced = (k, i)
        (self.forwards if op == "forward" else self.backwards).append(k)
        self.started[(op, k)] = i
        self.used[k] = True
        return None

    def _in_order(self, op: str, k: int) -> str | None:
        n, forwards, backwards = self.n, self.forwards, self.backwards
        if op == "forward":
            want = len(forwards)
            if want == n:
                return f"every unit already ran its forward; unit {k}'s backward comes next"
            if k != want:
                return f"the units run in order, 0 to {n - 1}: forward {want} comes next"
            return None
        if len(forwards) < n:
            return (f"backward starts after the last forward; forward {len(forwards)} has not "
                    "run yet")  # fmt: skip
        want = n - 1 - len(backwards)
        if want < 0:
            return f"every unit already ran its backward; unit {k} backward twice"
        if k != want:
            return f"backward runs from the last unit to the first: backward {want} comes next"
        return None

    def _whole(self, op: str, k: int) -> str | None:
        if self.state[k] == "arriving":
            return (f"unit {k}'s parameters are used before its AllGather (action "
                    f"{self.gathered_at[k]}) was waited: its bytes may still be arriving; add "
                    f"'wait {k}' first")  # fmt: skip
        if self.state[k] == "sharded":
            if op == "backward" and k in self.freed_at:
                return (f"unit {k} was freed at action {self.freed_at[k]} after its forward, and "
                        f"backward needs its parameters again: gather and wait it before "
                        f"backward {k}")  # fmt: skip
            return (f"unit {k} is not whole{_since_free(self.freed_at, k)}: gather it and wait "
                    "for it first")  # fmt: skip
        return None

    def free(self, k: int, i: int, where: str) -> str | None:
        if self.state[k] == "sharded":
            return (f"{where}: unit {k} is not whole{_since_free(self.freed_at, k)}; free a unit "
                    "once, after it computes")  # fmt: skip
        if self.state[k] == "arriving":
            return (f"{where}: unit {k}'s AllGather (action {self.gathered_at[k]}) was never "
                    "waited: a unit may be freed only once its bytes have arrived")  # fmt: skip
        if not self.used[k]:
            return (f"{where}: unit {k} was gathered (action {self.gathered_at[k]}) and freed "
                    "without computing: was that the unit you meant to gather?")  # fmt: skip
        self.state[k], self.freed_at[k] = "sharded", i  # before or after its reduce: both right
        return None

    def reduce(self, k: int, i: int, where: str) -> str | None:
        if k not in self.backwards:
            return (f"{where} before backward {k}: unit {k}'s gradient is not complete yet; "
                    "reduce each unit right after its backward")  # fmt: skip
        if k in self.reduced:
            return f"{where}: unit {k} was already reduced; each unit is reduced once"
        self.reduced.append(k)
        self.unreduced = None
        return None

    def finish(self, i: int, where: str) -> str | None:
        missing = [k for k in range(self.n) if k not in self.reduced]
        if missing:
            return (f"{where}: 'finish' waits for the ReduceScatters, but unit(s) "
                    f"{_units(missing)} were never reduced: the optimizer would step on "
                    "shards without their gradient")  # fmt: skip
        self.finished = i
        return None

    def at_the_end(self, end: int) -> Problem | None:
        """The rule a plan broke that no one action did (``end``: the plan's length)."""
        n, forwards, backwards = self.n, self.forwards, self.backwards
        if len(forwards) < n:
            return Problem(f"forward {len(forwards)} never runs: every unit runs its forward, "
                           f"0 to {n - 1}", end)  # fmt: skip
        if len(backwards) < n:
            return Problem(f"backward {n - 1 - len(backwards)} never runs: every unit runs its "
                           "backward", end)  # fmt: skip
        if self.finished is None:
            return Problem("the plan ends without 'finish': the optimizer would step on shards "
                           "whose ReduceScatter may still be running", end)  # fmt: skip
        whole = [k for k in range(n) if self.state[k] != "sharded"]
        if whole:
            return Problem(f"unit(s) {_units(whole)} still whole at the end of the step "
                           f"(gathered at action {self.gathered_at[whole[0]]}): free each unit "
                           "after its backward", end)  # fmt: skip
        return self._prefetched() if self.p >= 1 else None

    def _prefetched(self) -> Problem | None:
        """Each AllGather issued early enough to travel under the compute before it."""
        n, p, started, gathers = self.n, self.p, self.started, self.gathers
        for k in range(n):  # forward: gathered before forward k−p starts
            before = max(0, k - p)
            spot = gathers.get(("forward", k))
            if spot is not None and spot > started[("forward", before)]:
                return Problem(f"prefetch {p}: unit {k}'s AllGather should be issued before "
                               f"forward {before} starts (action {started[('forward', before)]}), "
                               f"so that it travels while unit {before} computes; yours is "
                               f"action {spot}", spot - 1)  # fmt: skip
        for k in reversed(range(n)):  # backward (the first offence first): re-gathered
            # before backward k+p starts
            before = min(n - 1, k + p)
            spot = gathers.get(("backward", k))
            if spot is not None and spot > started[("backward", before)]:
                return Problem(f"prefetch {p}: in backward, unit {k}'s AllGather should be "
                               f"issued before backward {before} starts (action "
                               f"{started[('backward', before)]}), so that it travels "
                               f"meanwhile; yours is action {spot}", spot - 1)  # fmt: skip
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
