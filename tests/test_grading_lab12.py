"""Lab 12's check names a learner's typical mistakes in a fully sharded step's plan, every
time, and passes the right plans, whichever of the valid orders they take."""

from __future__ import annotations

import contextlib
import io

import pytest

import overlapkit as ok
from overlapkit.grading import lab12
from overlapkit.grading.report import Report

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")


def right(units, prefetch):
    plan, whole = [], set()

    def gather(k):
        if 0 <= k < units and k not in whole:
            plan.append(f"gather {k}")
            whole.add(k)

    for k in range(units):
        for j in range(k, k + 1 + prefetch):
            gather(j)
        plan += [f"wait {k}", f"forward {k}", f"free {k}"]
        whole.discard(k)
    for k in reversed(range(units)):
        for j in range(k, k - 1 - prefetch, -1):
            gather(j)
        plan += [f"wait {k}", f"backward {k}", f"free {k}", f"reduce {k}"]
        whole.discard(k)
    return plan + ["finish"]


def keeps_the_last_unit_whole(units, prefetch):
    """Also right: the last unit is not freed between its forward and its backward."""
    plan = right(units, prefetch)
    last = units - 1
    i = plan.index(f"free {last}")
    j = plan.index(f"gather {last}", i)
    w = plan.index(f"wait {last}", j)
    return plan[:i] + plan[i + 1 : j] + plan[j + 1 : w] + plan[w + 1 :]


def reduces_after_freeing_later(units, prefetch):
    """Also right: free after reduce, finish at the end."""
    plan = right(units, prefetch)
    out = []
    for a in plan:
        if a.startswith("reduce") and out and out[-1].startswith("free"):
            out.insert(len(out) - 1, a)
        else:
            out.append(a)
    return out


def hands_the_work_to_a_thread(units, prefetch):
    """Honest, if odd: the plan made in a thread of its own."""
    import threading  # noqa: PLC0415

    out = []
    worker = threading.Thread(target=lambda: out.append(right(units, prefetch)))
    worker.start()
    worker.join()
    return out[0]


def no_wait(units, prefetch):
    return [a for a in right(units, prefetch) if not a.startswith("wait")]


def prefetches_the_wrong_unit(units, prefetch):
    """gather k+2 where k+1 belongs (an index off by one)."""
    return [f"gather {min(int(a.split()[1]) + 1, units - 1)}"
            if a.startswith("gather") and a != "gather 0" else a
            for a in right(units, prefetch)]  # fmt: skip


def frees_and_forgets(units, prefetch):
    """Freed after the forward, never gathered again for backward."""
    plan = right(units, prefetch)
    end = plan.index(f"free {units - 1}") + 1
    return plan[:end] + [a for a in plan[end:] if not a.startswith(("gather", "wait"))]


def never_frees(units, prefetch):
    return [a for a in right(units, prefetch) if not a.startswith("free")]


def reduces_before_backward(units, prefetch):
    plan = right(units, prefetch)
    i, j = plan.index("reduce 0"), plan.index("backward 0")
    plan.insert(j, plan.pop(i))
    return plan


def prefetches_in_reverse_order(units, prefetch):
    """Each batch of gathers issued last-needed first, so the
    unit needed next queues behind the others on the link."""
    plan, batch = [], []
    for a in right(units, prefetch):
        if a.startswith("gather"):
            batch.append(a)
            continue
        plan += batch[::-1] + [a]
        batch = []
    return plan


def no_finish(units, prefetch):
    return right(units, prefetch)[:-1]


def ignores_prefetch(units, prefetch):
    return right(units, 0)


def prefetches_too_far(units, prefetch):
    return right(units, prefetch + 1)


def gathers_past_the_end(units, prefetch):
    plan, whole = [], set()
    for k in range(units):
        for j in range(k, k + 1 + prefetch):
            if j not in whole:
                plan.append(f"gather {j}")
                whole.add(j)
        plan += [f"wait {k}", f"forward {k}", f"free {k}"]
    return plan + right(units, prefetch)[len(plan) :]


def backward_in_forward_order(units, prefetch):
    plan = right(units, 0)
    fwd = plan[: 4 * units]
    back = [(f"gather {k}", f"wait {k}", f"backward {k}", f"free {k}", f"reduce {k}")
            for k in range(units)]  # fmt: skip
    return fwd + [a for five in back for a in five] + ["finish"]


def waits_right_after_each_gather(units, prefetch):
    """A common habit that must not pass: a wait at once after each gather, so
    a prefetched AllGather is waited for before the unit ahead of it computes."""
    plan = []
    for a in right(units, prefetch):
        if a.startswith("wait"):
            continue
        plan.append(a)
        if a.startswith("gather"):
            plan.append("wait" + a[len("gather") :])
    return plan


def reduces_all_at_the_end(units, prefetch):
    plan = [a for a in right(units, prefetch) if not a.startswith("reduce")][:-1]
    return plan + [f"reduce {k}" for k in reversed(range(units))] + ["finish"]


def gathers_unit_minus_one(units, prefetch):
    """A backward prefetch of k − 1 without a bound: 'gather -1'."""
    return [a.replace("gather 0", "gather -1") if i > len(right(units, prefetch)) - 4 else a
            for i, a in enumerate(right(units, prefetch))] + ["gather -1"]  # fmt: skip


def yields_the_actions(units, prefetch):
    yield from right(units, prefetch)


def returns_a_string(units, prefetch):
    return ", ".join(right(units, prefetch))


def asks_the_cost_model(units, prefetch):
    spans = ok.costmodel.fsdp_step([(1.0, 2.0, 4.0)] * units, 2, 0.0, 1.0, "explicit")
    return [s[1] for s in spans["spans"]]


def asks_the_checks_own_judge(units, prefetch):
    plan = right(units, prefetch)
    assert lab12.judge_plan(plan, units, prefetch) is None
    return plan


def logs_the_wrappers_own_step(units, prefetch):
    """Would record which units ok.FullyShardedDP's hooks gather and free (it needs no
    process group to be refused: its code starting is enough)."""
    import torch  # noqa: PLC0415

    ok.FullyShardedDP(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    return right(units, prefetch)


FIXED = {case: right(*case) for case in lab12.CASES}


def table_of_the_fixed_cases(units, prefetch):
    return FIXED.get((units, prefetch), ["finish"])


def _check(fn) -> Report:
    with contextlib.redirect_stdout(io.StringIO()):
        return ok.grading.check_fsdp_plan(fn)


@pytest.mark.parametrize(
    "fn",
    [right, keeps_the_last_unit_whole, reduces_after_freeing_later, hands_the_work_to_a_thread],
)
def test_right_plans_in_any_valid_order_pass_every_case_and_run_on_two_ranks(fn):
    report = _check(fn)
    assert report.all_passed, report.cases
    assert any("run on 2 ranks" in m and "equal one process" in m for _, m in report.cases)


#: every case the check can give: its fixed ones and each it may draw
ALL_CASES = [*lab12.CASES, *lab12.DRAWN]


@pytest.mark.parametrize("fn, words", [
    (no_wait, "before its AllGather (action 1) was waited"),
    (prefetches_the_wrong_unit, "unit 1's AllGather was never issued"),
    (frees_and_forgets, "backward needs its parameters again"),
    (never_frees, "are whole or arriving at once"),
    (reduces_before_backward, "'reduce 0' before backward 0"),
    (no_finish, "ends without 'finish'"),
    (ignores_prefetch, "unit 1's AllGather should be issued before forward 0"),
    (prefetches_too_far, "allows"),
    (gathers_past_the_end, "0 to"),
    (backward_in_forward_order, "backward runs from the last unit to the first"),
    (waits_right_after_each_gather, "Wait for a unit right before it computes"),
    (reduces_all_at_the_end, "reduce each unit right after its backward"),
    (gathers_unit_minus_one, "0 to"),
    (prefetches_in_reverse_order, "Gather in the order the units compute"),
])  # fmt: skip
def test_each_typical_mistake_in_a_plan_is_named_in_every_case_it_breaks(fn, words):
    """The check's verdict on its fixed cases (run every time: the mistake fails every
    time) names the mistake; a case the check may draw is judged too, and where it fails,
    it says so in words (some mistakes are right by chance in a case: ignoring prefetch
    when it is 0, a wrong prefetch index with one unit)."""
    fixed = {(n, p): lab12.judge_plan(fn(n, p), n, p) for n, p in lab12.CASES}
    failed = [v for v in fixed.values() if v is not None]
    assert failed, f"{fn.__name__} passed every fixed case"
    assert any(words in v for v in failed), fixed
    for n, p in ALL_CASES:
        verdict = lab12.judge_plan(fn(n, p), n, p)
        assert verdict is None or verdict.startswith(("action", "prefetch", "the plan",
                                                      "unit", "forward", "backward"))  # fmt: skip


def test_a_plan_that_breaks_a_rule_is_not_run_and_the_report_says_so():
    report = _check(no_finish)
    assert report.cases[-1] == (False, "4 units, prefetch 1, run on 2 ranks: not run, the plan "
                                       "for that case broke a rule (above)")  # fmt: skip


def test_a_table_of_the_fixed_cases_fails_the_case_drawn_at_random():
    report = _check(table_of_the_fixed_cases)
    failed = [m for passed, m in report.cases if not passed]
    assert len(failed) == 2 and all("prefetch" in m for m in failed), report.cases


def test_the_run_on_ranks_names_a_plan_that_uses_a_unit_not_whole():
    plan = no_wait(4, 1)
    assert "not waited" in ok.launch(lab12._train_by_plan, plan, world_size=2)[0]


def starts_a_fresh_interpreter_for_the_kits_answer(units, prefetch):
    """A new interpreter is neither watched nor disarmed."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = f"import overlapkit as ok; print(ok.costmodel.fsdp_step([(1, 2, 4)] * {units}, 2, 0, 1))"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return right(units, prefetch)


def switches_the_watch_off_through_a_partial(units, prefetch):
    """The profiler off without a call event, a fresh copy of a kit
    module loaded from its file (not disarmed), the watch back on."""
    import functools  # noqa: PLC0415
    import importlib.util  # noqa: PLC0415
    import sys  # noqa: PLC0415

    watch = sys.getprofile()
    functools.partial(sys.setprofile, None)()
    try:
        path = ok.costmodel.sharding.__file__  # fsdp_step's module
        spec = importlib.util.spec_from_file_location("fresh_costmodel", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        functools.partial(sys.setprofile, watch)()
    return right(units, prefetch)


def loads_a_fresh_copy_of_the_kit_with_the_watch_on(units, prefetch):
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("fresh_costmodel", ok.costmodel.sharding.__file__)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return right(units, prefetch)


def switches_the_watch_off_in_a_thread(units, prefetch):
    """The profiler off in a thread of its own (every thread starts under the watch)."""
    import functools  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import threading  # noqa: PLC0415

    errors = []

    def work():
        try:
            functools.partial(sys.setprofile, None)()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    if errors:
        raise errors[0]
    return right(units, prefetch)


@pytest.mark.parametrize("fn, words", [
    (no_wait, "before its AllGather (action 1) was waited"),
    (returns_a_string, "return a list of actions"),
    (yields_the_actions, "not a generator"),
    (asks_the_cost_model, "your function"),
    (asks_the_checks_own_judge, "your function"),
    (logs_the_wrappers_own_step, "your function"),
    # ways to do the work outside the watch
    (starts_a_fresh_interpreter_for_the_kits_answer, "starts no program"),
    (switches_the_watch_off_through_a_partial, "called sys.setprofile"),
    (loads_a_fresh_copy_of_the_kit_with_the_watch_on, "opened the kit's own file"),
    (switches_the_watch_off_in_a_thread, "called sys.setprofile"),
])  # fmt: skip
def test_the_check_names_the_mistake_whatever_the_function_returns_or_calls(fn, words):
    report = _check(fn)
    failed = [m for passed, m in report.cases if not passed]
    assert failed, f"{fn.__name__} passed"
    assert any(words in m for m in failed), failed
