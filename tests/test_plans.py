"""The plan grammar: each kind of plan reads back what it writes, a step in no form is named
with the forms expected, and the marked printer brackets the step a check points at."""

from __future__ import annotations

import pickle

import pytest

import overlapkit as ok
from overlapkit import hybrid, plans
from overlapkit.plans import (
    FSDP,
    HYBRID,
    PIPELINE,
    Action,
    Finish,
    Flush,
    PlanSyntaxError,
    Problem,
    Reduce,
    UnitAction,
)


def _fsdp_plan(units: int) -> list:
    forward = [UnitAction(op, k) for k in range(units) for op in ("gather", "wait", "forward")]
    backward = [UnitAction(op, k) for k in reversed(range(units))
                for op in ("backward", "free", "reduce")]  # fmt: skip
    return [*forward, *backward, Finish()]


@pytest.mark.parametrize("name", ["sequential", "gpipe", "1f1b"])
def test_a_schedule_reads_back_what_it_writes(name):
    schedule = ok.pipeline.make_schedule(name, 3, 4)
    assert plans.parse_schedule(plans.format_schedule(schedule)) == schedule
    assert plans.parse_schedule([PIPELINE.texts(s) for s in schedule]) == schedule
    assert [PIPELINE.parse(PIPELINE.show(s)) for s in schedule] == schedule


def test_the_pipeline_writes_as_before():
    assert str(Action("F", 3)) == "F3" and repr(Action("B", 0)) == "B0"
    assert ok.pipeline.Action is Action and ok.pipeline.format_schedule is plans.format_schedule
    assert PIPELINE.parse(["F0", "B12"]) == [Action("F", 0), Action("B", 12)]


def test_a_fully_sharded_plan_reads_back_what_it_writes():
    plan = _fsdp_plan(3)
    assert FSDP.parse(FSDP.texts(plan)) == plan
    assert FSDP.parse(FSDP.show(plan)) == plan
    assert FSDP.texts(plan)[:2] == ["gather 0", "wait 0"] and FSDP.texts(plan)[-1] == "finish"
    assert FSDP.parse(["  free   2 "]) == [UnitAction("free", 2)]  # words apart by any spaces


def test_a_hybrid_plan_reads_back_what_it_writes():
    actions = HYBRID.texts(ok.pipeline.make_schedule("1f1b", 2, 2)[1])
    for start in hybrid.DP_STARTS:
        for stage in (0, 1):
            text = hybrid.plan_for(start, actions, stage, 3)
            plan = HYBRID.parse(text)
            assert HYBRID.texts(plan) == text
            assert HYBRID.parse(HYBRID.show(plan)) == plan
    assert HYBRID.parse(["B 1 ready", "reduce 2", "flush", "finish"]) == [
        Action("B", 1, ready=True), Reduce(2), Flush(), Finish()]  # fmt: skip


@pytest.mark.parametrize("grammar, plan, index, forms", [
    (FSDP, ["gather 0", "wait 0", "gather zero"], 2, "'gather K', 'wait K', 'forward K'"),
    (FSDP, ["finish 1"], 0, "'reduce K' or 'finish'"),
    (HYBRID, ["F 0", "reduce"], 1, "'reduce b', 'flush' or 'finish'"),
    (PIPELINE, ["F0", "F 1"], 1, "'Fk' or 'Bk'"),
    (PIPELINE, ["F0", 3], 1, "'Fk' or 'Bk'"),
])  # fmt: skip
def test_a_malformed_step_is_named_with_the_forms_expected(grammar, plan, index, forms):
    with pytest.raises(PlanSyntaxError) as caught:
        grammar.parse(plan)
    err = caught.value
    assert (err.index, err.text) == (index, plan[index])
    assert str(err).startswith(f"plan[{index}] {plan[index]!r}: expected ")
    assert forms in str(err)
    assert pickle.loads(pickle.dumps(err)).args == err.args  # a rank's error travels whole


def test_a_step_of_another_kind_is_in_no_form():
    with pytest.raises(PlanSyntaxError):
        FSDP.parse([Reduce(0)])
    assert FSDP.parse([UnitAction("wait", 1)]) == [UnitAction("wait", 1)]  # typed: as it is


def test_the_marked_plan_brackets_the_step_with_a_few_either_side():
    plan = FSDP.texts(_fsdp_plan(4))
    assert FSDP.mark(plan, 0, around=2) == "[gather 0], wait 0, forward 0 …"
    assert FSDP.mark(plan, 5, around=1) == "… wait 1, [forward 1], gather 2 …"
    assert FSDP.mark(plan, len(plan) - 1, around=1) == "… reduce 0, [finish]"
    assert FSDP.mark(plan, len(plan), around=0) == "… [ ]"  # after the last step
    assert PIPELINE.mark(["F0", "F1", "B0"], 1) == "F0 [F1] B0"
    assert HYBRID.mark(["F 0", 7, "finish"], 1) == "F 0, [7], finish"  # as the learner wrote


def test_a_problem_is_its_words_and_the_step_it_broke_at():
    problem = Problem("action 2 'wait 0': …", 1)
    assert problem == "action 2 'wait 0': …" and isinstance(problem, str) and problem.at == 1
    assert Problem("the plan ends without 'finish'").at is None


def test_the_checks_judges_say_where_a_plan_broke():
    from overlapkit.grading import lab12, lab14

    plan = [a for a in FSDP.texts(_fsdp_plan(2)) if a != "wait 1"]
    problem = lab12.judge_plan(plan, 2, 1)
    assert problem.startswith("action 5 'forward 1'") and problem.at == 4
    acts = lab14.stage_actions(2, 2, "1f1b", 0)
    problem = lab14.judge_plan([*acts, "reduce 0", "finish"], acts, 0, 1)
    assert problem.startswith("stage 0's last backward") and problem.at == len(acts) - 1
