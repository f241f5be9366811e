"""Checks for lab 14: a 2-D mesh's groups, and when each pipeline stage reduces its gradients.

``mesh_groups(dp, pp)`` returns ``(pipelines, replicas)``: the pp groups (each the global
ranks of one pipeline replica, stage 0 first) and the dp groups (each the ranks holding one
stage, replica 0 first), laid out as ``init_device_mesh(..., (dp, pp))`` lays them: rank
d·pp + s is stage s of replica d. Judged on fixed shapes and two drawn at random, with the
likely mistakes named (the mesh transposed, the two lists swapped, a stage order reversed).

``hybrid_plan(actions, stage, stages, buckets)`` returns one stage's plan for a step: its
pipeline ``actions`` ("F k" / "B k", in its schedule's order) with the data-parallel events
between them ("B k ready", "reduce b", "flush", "finish": ``ok.hybrid.HybridStage.run_plan``).
A plan is judged by its rules, not against one plan (the buckets may go in any order):

* the pipeline actions as given, in order; every bucket reduced once; "finish" last;
* no bucket reduced (and no "ready") before the stage's last backward: each backward adds
  its micro-batch's gradient, and a bucket sent earlier misses it;
* stage 0's last backward is the pipeline's last action: nothing after it to hide a
  reduction under, so it launches each bucket as that backward fills it ("B k ready");
* a later stage reduces right after its last backward, whose input gradient stage s − 1
  waits for: buckets launched during it ("ready") go out ahead of that gradient on a link
  both groups share; "flush" waits for the whole pipeline and hides nothing;
* the same arguments give the same plan (every replica must issue its buckets in one order).

Then the plans for a 2 × 2 mesh run on 4 ranks for two SGD steps (``run_plan``), whose
parameters must equal one process's training on the whole batch.
"""

from __future__ import annotations

import functools
import io
import random
import re
from dataclasses import replace

import torch

from ..hybrid import flush_mismatch
from ..launcher import LaunchError, launch
from ..pipeline import make_schedule
from ..plans import HYBRID, Action, Flush, PlanSyntaxError, Problem, Reduce
from ..sandbox import answers
from ..sandbox.sealed import seal
from .common import Unfinished, call_or_report, judge_against_one_process
from .exercises import answers_of
from .report import Report

MESHES = [(2, 2), (1, 4), (4, 1), (2, 3)]
#: two more are drawn each time
DRAWN_MESHES = [(d, p) for d in range(1, 7) for p in range(1, 7) if (d, p) not in MESHES]
#: (stages, micro-batches, schedule, buckets): the stages each get a plan
PLANS = [(2, 2, "1f1b", 4), (2, 4, "gpipe", 1), (3, 4, "1f1b", 3)]
DRAWN_PLANS = [(p, m, s, b) for p in (2, 3, 4) for m in (1, 2, 3, 5, 8) for s in ("1f1b", "gpipe")
               for b in (1, 2, 5, 9) if (p, m, s, b) not in PLANS]  # fmt: skip


def _with_timeout(fn, timeout: float):
    """A sealed function whose calls give up after ``timeout`` seconds (honest ones take
    milliseconds; the default minute made a learner's hang wait twice what it needs)."""
    return functools.partial(fn, timeout=timeout) if callable(fn) else fn


def expected_groups(dp: int, pp: int) -> tuple[list[list[int]], list[list[int]]]:
    """The pp groups and dp groups of ``init_device_mesh(..., (dp, pp))``."""
    return ([[d * pp + s for s in range(pp)] for d in range(dp)],
            [[d * pp + s for d in range(dp)] for s in range(pp)])  # fmt: skip


# --------------------------------------------------------------------------- the mesh


def check_mesh_groups(mesh_groups, timeout: float = 30.0) -> Report:
    """Check ``mesh_groups(dp, pp)``: it returns ``(pipelines, replicas)``, the pp groups
    (one replica's ranks, stage 0 first) and the dp groups (one stage's ranks, replica 0
    first) of ``init_device_mesh(..., (dp, pp))``, on several shapes (two drawn at random).
    A call that does not return within ``timeout`` seconds is a ✘ line."""
    report = Report("mesh_groups")
    quiet = Report(report.exercise, file=io.StringIO())
    mesh_groups = _with_timeout(seal(mesh_groups), timeout)
    shapes = [*MESHES, *random.SystemRandom().sample(DRAWN_MESHES, 2)]
    with answers.running(answers_of("check_mesh_groups")) as ran:
        got = []
        for dp, pp in shapes:
            try:
                called, value = call_or_report(quiet, f"{dp} × {pp}", mesh_groups, dp, pp)
            except Unfinished:
                report.fail(quiet.cases[-1][1])
                return report
            if not called:
                said = quiet.cases[-1][1]
                if "cannot pickle 'generator'" in said:  # the value travels back pickled
                    said = (f"{dp} × {pp}: return (pipelines, replicas) as lists, not a "
                            "generator: list(...) of each")  # fmt: skip
                said = _unreadable(said, f"{dp} × {pp}", _GROUPS) or said
                report.fail(said)
            got.append(((dp, pp), called, value))
    if ran:
        report.fail(f"your function {answers.said(ran)}")
        return report
    for (dp, pp), called, value in got:
        if not called:
            continue
        what = f"{dp} × {pp}" if (dp, pp) in MESHES else "a mesh shape drawn at random"
        problem = judge_groups(value, dp, pp)
        report.check(problem is None, f"{what}: the pipelines and replicas of init_device_mesh",
                     f"{dp} × {pp} (dp × pp): {problem}")  # fmt: skip
    return report


_GROUPS = "(pipelines, replicas), each a list of groups, each a list of int ranks"
_PLAN = "a plan, a list of strings such as 'F 0' or 'reduce 1'"


def _unreadable(said: str, what: str, expected: str) -> str | None:
    """A call whose value could not come back from the process the check ran it in (it
    held an object that is not plain data), said as what the function returned and what
    was expected; None for any other failure. (Nothing raised: the value was refused.)"""
    found = re.search(r"returned a value that cannot be read: the value holds an object of "
                      r"([\w.]+)", said)  # fmt: skip
    if found is None:
        return None
    kind = found.group(1).rsplit(".", 1)[-1]
    fix = {"range": "list(range(...))", "map": "list(map(...))", "filter": "list(filter(...))",
           "zip": "list(zip(...))"}.get(kind, "plain lists, ints and strings")  # fmt: skip
    return (
        f"{what}: your function returned a value holding a {kind} object, which the check "
        f"cannot read back (only plain data comes back: lists, tuples, ints, strings); "
        f"expected {expected}: use {fix}"
    )


def _as_groups(value) -> list[list[int]] | None:
    if not isinstance(value, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in value):
        return None  # a set has no order to read a stage or a replica from
    try:
        groups = [[int(r) for r in g] for g in value]
    except (TypeError, ValueError):
        return None
    same = all(isinstance(r, int) and not isinstance(r, bool) for g in value for r in g)
    return groups if same else None


def judge_groups(value, dp: int, pp: int) -> str | None:
    """What is wrong with ``value`` as (pipelines, replicas) of a dp × pp mesh, or None."""
    pipes, reps = expected_groups(dp, pp)
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return "return a pair (pipelines, replicas): two lists of groups of ranks"
    got = [_as_groups(v) for v in value]
    if any(g is None for g in got):
        kinds = {type(g).__name__ for v in value if isinstance(v, (list, tuple, set))
                 for g in v if not isinstance(g, (list, tuple))}  # fmt: skip
        kinds |= {type(v).__name__ for v in value if not isinstance(v, (list, tuple))}
        sets = " (not a set: a group's order says which rank is stage 0, or replica 0)"
        arrays = ("; got an array (a NumPy array or a torch tensor: both come back as a "
                  "tensor): return lists, .tolist() of each")  # fmt: skip
        shown = {"Tensor": "an array"}
        return ("each of pipelines and replicas is a list of groups, each a list of int "
                f"ranks{sets if 'set' in kinds or any(isinstance(v, set) for v in value) else ''}"
                + (arrays if kinds == {"Tensor"} else
                   f"; got {', '.join(sorted(shown.get(k, k) for k in kinds))}" if kinds
                   else ""))  # fmt: skip
    mine_p, mine_r = got
    if (mine_p, mine_r) == (pipes, reps):
        return None
    transposed = expected_groups(pp, dp)[::-1]  # rank = s·dp + d
    if (mine_p, mine_r) == (reps, pipes) and pipes != reps:
        return (f"pipelines and replicas swapped{' (or the mesh transposed)' if dp == pp else ''}"
                f": you gave the pipelines as {mine_p}, but a pipeline is one replica's "
                f"stages, consecutive ranks: {pipes}")  # fmt: skip
    if (mine_p, mine_r) == transposed and transposed != (pipes, reps):
        return (
            f"the mesh transposed: with rank = d·pp + s (dp the outer dimension, as "
            f"init_device_mesh lays out (dp, pp)), the pipelines are {pipes}, not {mine_p}"
        )
    for name, mine, want in (("pipelines", mine_p, pipes), ("replicas", mine_r, reps)):
        if mine == want:
            continue
        if sorted(map(sorted, mine)) == sorted(map(sorted, want)):
            bad = next(g for g in mine if g not in want)
            return (f"{name}: the right ranks, out of order ({bad}): a pipeline lists stage "
                    "0 first, a replica group replica 0 first, and the groups go in that "
                    f"order too: {want}")  # fmt: skip
        if len(mine) != len(want):
            return (f"{name}: {len(mine)} group{'s' if len(mine) != 1 else ''}, a {dp} × {pp} "
                    f"mesh has {len(want)}: {want}")  # fmt: skip
        flat = [r for g in mine for r in g]
        if sorted(flat) != list(range(dp * pp)):
            out = sorted(set(flat) - set(range(dp * pp)))
            twice = sorted({r for r in flat if flat.count(r) > 1})
            detail = (f"rank(s) {out} do not exist (ranks 0 … {dp * pp - 1})" if out else
                      f"rank(s) {twice} in two groups" if twice else "a rank missing")  # fmt: skip
            return f"{name}: every rank in exactly one group; {detail}. Want {want}"
        return f"{name}: {mine}, want {want}"
    return None


# --------------------------------------------------------------------------- the plan


def stage_actions(stages: int, micro: int, schedule: str, stage: int) -> list[str]:
    """One stage's pipeline actions as a hybrid plan writes them ("F 0", "B 0", …)."""
    return HYBRID.texts(make_schedule(schedule, stages, micro)[stage])


def check_hybrid_plan(hybrid_plan, timeout: float = 30.0) -> Report:
    """Check ``hybrid_plan(actions, stage, stages, buckets)``: the plan of one stage's step,
    its pipeline ``actions`` with 'B k ready', 'reduce b', 'flush' and 'finish' between them,
    judged by the lab's rules for several pipelines (two drawn at random), then trained on a
    2 × 2 mesh against one process. A call that does not return within ``timeout`` seconds
    is a ✘ line."""
    report = Report("hybrid_plan")
    hybrid_plan = _with_timeout(seal(hybrid_plan), timeout)
    cases = [*PLANS, *random.SystemRandom().sample(DRAWN_PLANS, 2)]
    quiet = Report(report.exercise, file=io.StringIO())
    got = []
    with answers.running(answers_of("check_hybrid_plan")) as ran:
        for p, m, schedule, b in cases:
            for s in range(p):
                acts = stage_actions(p, m, schedule, s)
                what = f"stage {s} of {p}, {m} micro-batches ({schedule}), {b} bucket(s)"
                try:
                    called, plan = call_or_report(quiet, what, hybrid_plan, list(acts), s, p, b)
                    said = quiet.cases[-1][1] if not called else None  # (before a 2nd call's)
                    again = (call_or_report(quiet, what, hybrid_plan, list(acts), s, p, b)[1]
                             if called else None)  # fmt: skip
                except Unfinished:
                    report.fail(quiet.cases[-1][1])
                    return report
                drawn = (p, m, schedule, b) not in PLANS
                if said and "cannot pickle 'generator'" in said:
                    said = f"{what}: return a list of actions, not a generator: list(...) of it"
                said = (_unreadable(said, what, _PLAN) or said) if said else said
                got.append((what, drawn, acts, s, b, plan, again, said))
    if ran:
        report.fail(f"your function {answers.said(ran)}")
        return report
    runnable, cases_ok = {}, {}
    flushes: dict = {}  # case -> {stage: how many 'flush'}
    for what, drawn, acts, s, b, plan, again, said in got:
        case = (drawn, what.split(" of ")[1].split(",")[0], what.split(", ", 1)[1])
        if said:
            report.fail(said)
            cases_ok[case] = False
            continue
        problem = judge_plan(plan, acts, s, b)
        if problem is None and list(plan) != list(again):
            problem = (f"two calls with the same arguments gave different plans ({plan} and "
                       f"{again}): every replica of a stage must issue its AllReduces in "
                       "one order, or their buckets meet the wrong partner")  # fmt: skip
        if problem is None:
            flushes.setdefault(case, {})[s] = sum(1 for a in plan if a == "flush")
            problem = flush_mismatch(flushes[case])  # a barrier of the pipeline: all or none
        if problem is None:
            runnable[what] = plan
            cases_ok.setdefault(case, True)
        else:
            report.fail(f"{what}: {problem}")
            if getattr(problem, "at", None) is not None:  # the plan, that action in brackets
                report._print(f"    {HYBRID.mark(plan, problem.at)}")
            cases_ok[case] = False
    for (drawn, stages, rest), fine in cases_ok.items():
        if fine:  # a drawn case passes in the same words each time
            report.ok(f"{'a case drawn at random' if drawn else f'{stages} stages, {rest}'}: "
                      "every stage's plan keeps every rule")  # fmt: skip
    key = [w for w, *_ in got if w.endswith("2 micro-batches (1f1b), 4 bucket(s)")]
    if all(k in runnable for k in key):
        _run_on_ranks(report, [runnable[k] for k in key])
    else:
        report.fail("2 × 2 mesh, 2 SGD steps on 4 ranks: not run, a plan of the 2-stage "
                    "case broke a rule (above)")  # fmt: skip
    return report


def judge_plan(plan, actions: list[str], stage: int, buckets: int) -> str | None:
    """The first broken rule of ``plan`` for a stage with these pipeline ``actions`` and
    ``buckets``, in words, or None: a :class:`~overlapkit.plans.Problem`, whose ``at`` is
    the index of the action that broke it (None where no one action did)."""
    from ..hybrid import PlanError, parse_plan  # noqa: PLC0415

    early = _reduced_early(plan, actions)
    if early is not None:
        return early
    try:
        steps, after = parse_plan(plan, actions, buckets)
    except PlanError as exc:
        return Problem(str(exc), exc.at)
    last = max(i for i, (text, _) in enumerate(steps) if text.startswith("B"))
    events = after[last]
    written = HYBRID.parse(plan)  # it parsed: every step is in HYBRID's words
    at = max(i for i, s in enumerate(written) if isinstance(s, Action) and s.op == "B")
    flush = next((i for i, e in enumerate(events) if e[0] == "flush"), None)
    if flush is not None and any(e[0] == "reduce" for e in events[flush:]):
        return Problem("'flush' waits for the whole pipeline before reducing: the AllReduce "
                       "then hides under nothing (that is the baseline section 3 measures)",
                       written.index(Flush(), at))  # fmt: skip
    text, ready = steps[last]
    if stage == 0 and buckets and not ready:
        return Problem(f"stage 0's last backward ({text!r}) is the pipeline's last action: "
                       "after it nothing computes, so reductions launched after it are all "
                       f"exposed. Launch each bucket as it fills: '{text} ready'", at)  # fmt: skip
    if stage > 0 and ready:
        return Problem(f"'{text} ready' launches buckets during the backward, ahead of the "
                       f"gradient that backward sends to stage {stage - 1}, which waits for it "
                       "(one link carries both groups' bytes). Reduce right after it: 'reduce "
                       f"b' lines after {text!r}", at)  # fmt: skip
    return None


def _reduced_early(plan, actions: list[str]) -> Problem | None:
    """A reduction (or "ready") before the stage's last backward, named first: a plan that
    reduces after every backward also reduces some bucket twice, but the early one is the
    mistake to fix."""
    if not isinstance(plan, (list, tuple)) or not all(isinstance(a, str) for a in plan):
        return None
    last = [a for a in HYBRID.parse(actions) if a.op == "B"][-1]
    written = [_step_or_none(a) for a in plan]
    where = next((i for i, s in enumerate(written) if _unready(s) == last), len(plan))
    done = None  # the last backward before the reduction
    for i, (a, step) in enumerate(zip(plan[:where], written, strict=False)):
        if isinstance(step, Action) and step.op == "B":
            done = HYBRID.show_step(_unready(step))
        still = (f", but {HYBRID.show_step(last)!r} (micro-batch {last.micro}) still adds its "
                 "gradient later: a bucket sent before the stage's last backward misses what "
                 "follows")  # fmt: skip
        if isinstance(step, Action) and step.op == "B" and step.ready:
            return Problem(f"plan[{i}] {a!r} launches every bucket as it fills{still}", i)
        if isinstance(step, Reduce):
            when = f"after {done!r}" if done else "before any backward"
            return Problem(f"plan[{i}] {a!r} reduces {when}{still}", i)
    return None


def _step_or_none(text: str):
    try:
        return HYBRID.parse_step(text)
    except PlanSyntaxError:
        return None


def _unready(step):
    return replace(step, ready=False) if isinstance(step, Action) else step


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(4)])


def _train_by_plans(plans):
    """Two SGD steps of a 2 × 2 mesh by the stages' plans; the largest difference from one
    process's training on the whole batch, or the plan's error."""
    import overlapkit as ok  # noqa: PLC0415

    mesh = ok.hybrid.make_mesh(2, 2)
    piece = _model()[2 * mesh.stage : 2 * mesh.stage + 2]
    stage = ok.hybrid.HybridStage(piece, mesh, bucket_mb=1e-9)  # a bucket per tensor: 4
    alone = _model()
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    ref = torch.optim.SGD(alone.parameters(), lr=0.1)
    loss = torch.nn.functional.mse_loss
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)
        mine = slice(4 * mesh.replica, 4 * mesh.replica + 4)
        try:
            stage.run_plan(plans[mesh.stage], x[mine] if mesh.stage == 0 else None,
                           y[mine] if mesh.stage == 1 else None, loss, micro_batches=2)  # fmt: skip
        except ok.hybrid.PlanError as exc:
            return str(exc)
        opt.step()
        opt.zero_grad()
        loss(alone(x), y).backward()
        ref.step()
        ref.zero_grad()
    want = list(alone.parameters())[4 * mesh.stage : 4 * mesh.stage + 4]
    return max((a - b).abs().max().item() for a, b in zip(stage.parameters(), want, strict=True))


def _run_on_ranks(report: Report, plans) -> None:
    what = "2 × 2 mesh, your plans on 4 ranks (2 SGD steps)"
    try:
        results = launch(_train_by_plans, [list(p) for p in plans], world_size=4, timeout=90)
    except LaunchError as exc:  # a hang or a crash is a ✘ line, not the check's traceback
        report.fail(f"{what}: {str(exc).splitlines()[0]}")
        return
    judge_against_one_process(report, what, results)
