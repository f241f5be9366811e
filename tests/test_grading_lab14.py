"""Lab 14's checks name a learner's typical mistakes in a mesh's groups and in a stage's plan
of when to reduce, every time, and pass the right answers, in any valid bucket order."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

import overlapkit as ok
from overlapkit.grading import lab14
from overlapkit.grading.report import Report
from tests.conftest import _soaking

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")


# --------------------------------------------------------------------------- the mesh


def groups_right(dp, pp):
    return ([[d * pp + s for s in range(pp)] for d in range(dp)],
            [[d * pp + s for d in range(dp)] for s in range(pp)])  # fmt: skip


def groups_by_stride(dp, pp):
    """Also right: the replicas as strided slices of the ranks."""
    ranks = list(range(dp * pp))
    return [ranks[d * pp : (d + 1) * pp] for d in range(dp)], [ranks[s::pp] for s in range(pp)]


def groups_transposed(dp, pp):  # rank = s·dp + d
    return ([[s * dp + d for s in range(pp)] for d in range(dp)],
            [[s * dp + d for d in range(dp)] for s in range(pp)])  # fmt: skip


def groups_swapped(dp, pp):
    pipelines, replicas = groups_right(dp, pp)
    return replicas, pipelines


def stages_reversed(dp, pp):
    pipelines, replicas = groups_right(dp, pp)
    return [p[::-1] for p in pipelines], replicas


def off_by_one(dp, pp):  # ranks counted from 1
    pipelines, replicas = groups_right(dp, pp)
    return [[r + 1 for r in g] for g in pipelines], [[r + 1 for r in g] for g in replicas]


def one_pipeline_only(dp, pp):
    pipelines, replicas = groups_right(dp, pp)
    return pipelines[:1], replicas


def floats(dp, pp):
    pipelines, replicas = groups_right(dp, pp)
    return [[float(r) for r in g] for g in pipelines], replicas


def returns_sets(dp, pp):
    pipelines, replicas = groups_right(dp, pp)
    return [set(g) for g in pipelines], [set(g) for g in replicas]


def yields_the_groups(dp, pp):
    yield from groups_right(dp, pp)


def groups_as_ranges(dp, pp):
    return ([range(d * pp, d * pp + pp) for d in range(dp)],
            [range(s, dp * pp, pp) for s in range(pp)])  # fmt: skip


def groups_as_arrays(dp, pp):
    import numpy as np

    mesh = np.arange(dp * pp).reshape(dp, pp)
    return list(mesh), list(mesh.T)


def asks_torch_for_the_mesh(dp, pp):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    return mesh.mesh.tolist(), mesh.mesh.T.tolist()


def _check_groups(fn) -> Report:
    with contextlib.redirect_stdout(io.StringIO()):
        return ok.grading.check_mesh_groups(fn)


@pytest.mark.parametrize("fn", [groups_right, groups_by_stride])
def test_the_meshs_groups_pass_every_shape(fn):
    report = _check_groups(fn)
    assert report.all_passed and len(report.cases) == 6, report.cases


@pytest.mark.parametrize("fn, words", [
    (groups_transposed, "the mesh transposed: with rank = d·pp + s"),
    (groups_swapped, "pipelines and replicas swapped"),
    (stages_reversed, "the right ranks, out of order"),
    (off_by_one, "do not exist"),
    (one_pipeline_only, "1 group, a 2 × 2 mesh has 2"),
    (floats, "each a list of int ranks"),
    (returns_sets, "not a set: a group's order says which rank is stage 0"),
])  # fmt: skip
def test_each_typical_mistake_in_the_groups_is_named_on_the_fixed_shapes(fn, words):
    fixed = [lab14.judge_groups(fn(dp, pp), dp, pp) for dp, pp in lab14.MESHES]
    assert any(v is not None and words in v for v in fixed), fixed
    for dp, pp in lab14.DRAWN_MESHES:  # where it fails by chance, in words too
        verdict = lab14.judge_groups(fn(dp, pp), dp, pp)
        assert verdict is None or verdict.startswith(("the mesh", "pipelines", "replicas",
                                                      "each"))  # fmt: skip


def test_a_generator_of_groups_is_told_to_return_lists():
    report = _check_groups(yields_the_groups)
    failed = [m for passed, m in report.cases if not passed]
    assert failed and all("not a generator" in m for m in failed), report.cases


@pytest.mark.parametrize("fn, words", [
    (groups_as_ranges, "your function returned a value holding a range object, which the check "
                       "cannot read back"),
    (groups_as_arrays, "got an array (a NumPy array or a torch tensor: both come back as a "
                       "tensor): return lists, .tolist() of each"),
])  # fmt: skip
def test_groups_that_are_not_lists_are_told_what_came_back_and_what_was_expected(fn, words):
    report = _check_groups(fn)
    failed = [m for passed, m in report.cases if not passed]
    assert len(failed) == 6 and all(words in m for m in failed), report.cases
    assert not any("raised" in m for m in failed)  # nothing raised: the value was refused


def test_asking_torch_for_the_mesh_inside_the_check_is_a_named_crash():
    report = _check_groups(asks_torch_for_the_mesh)
    assert not report.all_passed
    assert all("raised" in m for passed, m in report.cases if not passed), report.cases


# --------------------------------------------------------------------------- the plan


def right(actions, stage, stages, buckets):
    plan = list(actions)
    if stage == 0:
        return plan[:-1] + [plan[-1] + " ready", "finish"]
    return plan + [f"reduce {b}" for b in range(buckets)] + ["finish"]


def buckets_backwards(actions, stage, stages, buckets):
    """Also right: any bucket order, the same on every call."""
    if stage == 0:
        return right(actions, stage, stages, buckets)
    return list(actions) + [f"reduce {b}" for b in reversed(range(buckets))] + ["finish"]


def reduces_after_each_backward(actions, stage, stages, buckets):
    plan, b = [], 0
    for a in actions:
        plan.append(a)
        if a.startswith("B") and b < buckets:
            plan.append(f"reduce {b}")
            b += 1
    return plan + [f"reduce {k}" for k in range(b, buckets)] + ["finish"]


def ready_on_the_first_backward(actions, stage, stages, buckets):
    first = next(i for i, a in enumerate(actions) if a.startswith("B"))
    return [a + (" ready" if i == first else "") for i, a in enumerate(actions)] + ["finish"]


def flushes_after_the_reduces(actions, stage, stages, buckets):
    """Also right (harmless): a flush once the reductions are on their way."""
    return right(actions, stage, stages, buckets)[:-1] + ["flush", "finish"]


def ready_typo(actions, stage, stages, buckets):
    return [a.replace(" ", "") + " ready" if a == actions[-1] else a for a in actions] + ["finish"]


def flushes_on_stage_0_only(actions, stage, stages, buckets):
    plan = right(actions, stage, stages, buckets)
    return plan[:-1] + ["flush", "finish"] if stage == 0 else plan


def flushes_before_its_last_backward(actions, stage, stages, buckets):
    plan = right(actions, stage, stages, buckets)
    return [*plan[:1], "flush", *plan[1:]]


def flushes_first(actions, stage, stages, buckets):
    return list(actions) + ["flush"] + [f"reduce {b}" for b in range(buckets)] + ["finish"]


def stage0_after_its_backward(actions, stage, stages, buckets):
    return list(actions) + [f"reduce {b}" for b in range(buckets)] + ["finish"]


def every_stage_ready(actions, stage, stages, buckets):
    return list(actions[:-1]) + [actions[-1] + " ready", "finish"]


def no_finish(actions, stage, stages, buckets):
    return right(actions, stage, stages, buckets)[:-1]


def one_bucket_only(actions, stage, stages, buckets):
    if stage == 0:
        return right(actions, stage, stages, buckets)
    return list(actions) + ["reduce 0", "finish"]


def random_bucket_order(actions, stage, stages, buckets):
    import random

    if stage == 0:
        return right(actions, stage, stages, buckets)
    order = list(range(buckets))
    random.shuffle(order)
    return list(actions) + [f"reduce {b}" for b in order] + ["finish"]


def gpipe_order(actions, stage, stages, buckets):
    forwards = [a for a in actions if a.startswith("F")]
    backwards = [a for a in actions if a.startswith("B")]
    return right(forwards + backwards, stage, stages, buckets)


def reduce_before_anything(actions, stage, stages, buckets):
    return [f"reduce {b}" for b in range(buckets)] + list(actions) + ["finish"]


def yields_the_actions(actions, stage, stages, buckets):
    yield from right(actions, stage, stages, buckets)


def asks_the_kit(actions, stage, stages, buckets):
    return ok.hybrid.plan_for("overlap", actions, stage, buckets)


def asks_the_checks_judge(actions, stage, stages, buckets):
    for plan in (right(actions, stage, stages, buckets), []):
        if lab14.judge_plan(plan, actions, stage, buckets) is None:
            return plan
    return []


# the kit's plan_for by other doors


def plan_for_with_its_globals_aliased(actions, stage, stages, buckets):
    """plan_for's body pasted, each global it reads reached through another name."""
    return _aliased("overlap", list(actions), stage, buckets)


S_, E_, L_, R_ = ok.hybrid.DP_STARTS, ValueError, list, range


def _aliased(dp_start, actions, stage, buckets):
    if dp_start not in S_:
        raise E_(f"dp_start must be one of {S_}, got {dp_start!r}")
    plan = L_(actions)
    if not buckets:
        return plan + ["finish"]
    if dp_start == "overlap" and stage == 0:
        return plan[:-1] + [plan[-1] + " ready", "finish"]
    reduces = [f"reduce {b}" for b in R_(buckets)]
    return plan + (["flush"] if dp_start == "flush" else []) + reduces + ["finish"]


def rebinds_the_watchs_copy_finder(actions, stage, stages, buckets):
    import types

    import overlapkit.sandbox.answers as watch

    watch._copy_of = lambda code, shapes: None
    renamed = ok.hybrid.plan_for.__code__.replace(co_name="pf", co_qualname="pf")
    return types.FunctionType(renamed, vars(ok.hybrid))("overlap", actions, stage, buckets)


def takes_the_originals_from_the_watchs_closure(actions, stage, stages, buckets):
    """Looks for the answers' original code and the cache of verdicts in the profiler's
    closure and in the token cache: mark the originals 'not an answer' there, then run
    one. On a rank neither holds them."""
    import types

    originals = [entry[0] for entry in ok.sandbox.answers._tokens_of.values()]
    if not originals:
        raise LookupError("no original code in the token cache")
    code = next(c for c in originals if c.co_name == "plan_for")
    return types.FunctionType(code, vars(ok.hybrid))("overlap", actions, stage, buckets)


def reads_the_watchs_state_from_its_frame(actions, stage, stages, buckets):
    """The watch is a bound method now (no closure): its state is in a generator's frame."""
    import sys

    state = sys.getprofile().__self__[0]
    state.gi_frame.f_locals["seen"].clear()
    return right(actions, stage, stages, buckets)


def closes_the_watch(actions, stage, stages, buckets):
    import sys

    sys.getprofile().__self__[0].close()
    return right(actions, stage, stages, buckets)


def asks_the_garbage_collector_for_the_watch(actions, stage, stages, buckets):
    import gc

    [f for f in gc.get_objects() if getattr(f, "__name__", "") == "watch"]
    return right(actions, stage, stages, buckets)


@pytest.mark.parametrize("fn, words", [
    (plan_for_with_its_globals_aliased, "ran ok.hybrid.plan_for (an edited copy"),
    (rebinds_the_watchs_copy_finder, "ran ok.hybrid.plan_for"),
    (takes_the_originals_from_the_watchs_closure, "no original code in the token cache"),
    (reads_the_watchs_state_from_its_frame, "the check's watch is not yours to read"),
    (closes_the_watch, "cut off the check's watch"),
    (asks_the_garbage_collector_for_the_watch, "gc.get_objects"),
])  # fmt: skip
def test_the_kits_plan_by_another_door_fails(fn, words):
    report = _check_plan(fn)
    failed = [m for passed, m in report.cases if not passed]
    assert failed and any(words in m for m in failed), report.cases


def _check_plan(fn) -> Report:
    with contextlib.redirect_stdout(io.StringIO()):
        return ok.grading.check_hybrid_plan(fn)


@pytest.mark.parametrize("fn", [right, buckets_backwards, flushes_after_the_reduces])
def test_right_plans_pass_every_case_and_train_as_one_process_on_four_ranks(fn):
    report = _check_plan(fn)
    assert report.all_passed, report.cases
    assert any("on 4 ranks" in m and "equal one process" in m for _, m in report.cases)


@pytest.mark.parametrize("fn, words", [
    (reduces_after_each_backward, "reduces after 'B 0', but 'B 1' (micro-batch 1) still adds"),
    (ready_on_the_first_backward, "launches every bucket as it fills, but"),
    (flushes_first, "'flush' waits for the whole pipeline"),
    (stage0_after_its_backward, "stage 0's last backward"),
    (every_stage_ready, "ahead of the gradient that backward sends to stage 0"),
    (no_finish, "never says 'finish'"),
    (one_bucket_only, "never reduced"),
    (gpipe_order, "the schedule runs"),
    (reduce_before_anything, "reduces before any backward"),
    (ready_typo, "not an action ('F k', 'B k', 'B k ready'"),
])  # fmt: skip
def test_each_typical_mistake_in_a_plan_is_named_in_every_case_it_breaks(fn, words):
    fixed = []
    for p, m, schedule, b in lab14.PLANS:
        for s in range(p):
            acts = lab14.stage_actions(p, m, schedule, s)
            fixed.append(lab14.judge_plan(fn(acts, s, p, b), acts, s, b))
    assert any(v is not None and words in v for v in fixed), fixed


@pytest.mark.parametrize("fn, words", [
    (flushes_on_stage_0_only, "stage(s) [1] never say 'flush', but stage(s) [0] do"),
    (flushes_before_its_last_backward, "'flush' waits until every stage has run all its"),
    (random_bucket_order, "two calls with the same arguments gave different plans"),
    (yields_the_actions, "not a generator"),
    (asks_the_kit, "your function"),
    (asks_the_checks_judge, "your function"),
])  # fmt: skip
def test_the_check_names_the_mistake_whatever_the_function_returns_or_calls(fn, words):
    report = _check_plan(fn)
    failed = [m for passed, m in report.cases if not passed]
    assert failed and any(words in m for m in failed), report.cases


def test_a_plan_that_breaks_a_rule_is_not_run_and_the_report_says_so():
    report = _check_plan(no_finish)
    assert report.cases[-1] == (False, "2 × 2 mesh, 2 SGD steps on 4 ranks: not run, a plan "
                                       "of the 2-stage case broke a rule (above)")  # fmt: skip


def test_the_run_on_ranks_finds_a_bucket_reduced_too_early_in_the_parameters():
    acts = [lab14.stage_actions(2, 2, "1f1b", s) for s in (0, 1)]
    plans = [reduces_after_each_backward(a, s, 2, 4) for s, a in enumerate(acts)]
    gaps = ok.launch(lab14._train_by_plans, plans, world_size=4, timeout=60)
    assert max(gaps) > 1e-3  # the reductions miss micro-batch 1's gradient


def hangs(actions, stage, stages, buckets):
    while True:
        pass


def test_a_plan_that_never_returns_is_a_named_failure_after_the_checks_limit():
    with contextlib.redirect_stdout(io.StringIO()):
        report = ok.grading.check_hybrid_plan(hangs, timeout=5)
    failed = [m for passed, m in report.cases if not passed]
    assert failed and "did not return within 5 s" in failed[0], report.cases


# --------------------------------------------------------------------------- the notebook
# An answer the check failed never hangs a later cell: the student lab, run cell by cell
# with a typical wrong answer in the exercise, either runs each later cell or fails it at
# once with a named reason.

LAB = Path(__file__).resolve().parents[1] / "labs" / "14_hybrid_parallel.ipynb"
#: the lab's measurement, made small: one micro-batch count, one timed round
SMALLER = {"MICRO = [1, 2, 4]": "MICRO = [1]", "ROUNDS = 4": "ROUNDS = 1",
           "def time_stages(micro, reps=5)": "def time_stages(micro, reps=1)"}  # fmt: skip
#: a cell that fails, or a hang past this, is a failure of the test (the lab's 300 s limit,
#: made short: a failing cell here fails at once)
CELL_LIMIT_S = 150
AT_ONCE_S = 60

WRONG_GROUPS = {
    "transposed": "def mesh_groups(dp, pp):\n"
    "    return ([[s * dp + d for s in range(pp)] for d in range(dp)],\n"
    "            [[s * dp + d for d in range(dp)] for s in range(pp)])",
    "ranges": "def mesh_groups(dp, pp):\n"
    "    return ([range(d * pp, d * pp + pp) for d in range(dp)],\n"
    "            [range(s, dp * pp, pp) for s in range(pp)])",
    "arrays": "import numpy as np\n\n\ndef mesh_groups(dp, pp):\n"
    "    mesh = np.arange(dp * pp).reshape(dp, pp)\n    return list(mesh), list(mesh.T)",
    "nothing": "def mesh_groups(dp, pp):\n    pass",
}
WRONG_PLANS = {
    "flushes on stage 0 only": (
        "def hybrid_plan(actions, stage, stages, buckets):\n"
        "    plan = list(actions)\n"
        "    if stage == 0:\n"
        "        return plan[:-1] + [plan[-1] + ' ready', 'flush', 'finish']\n"
        "    return plan + [f'reduce {b}' for b in range(buckets)] + ['finish']",
        "never say 'flush'",
    ),
    "no finish": (
        "def hybrid_plan(actions, stage, stages, buckets):\n"
        "    return list(actions) + [f'reduce {b}' for b in range(buckets)]",
        "never says 'finish'",
    ),
    "returns nothing": (
        "def hybrid_plan(actions, stage, stages, buckets):\n    pass",
        "a plan is a list of actions (strings), not NoneType",
    ),  # fmt: skip
    "reduces after each backward": (
        "def hybrid_plan(actions, stage, stages, buckets):\n"
        "    plan, b = [], 0\n"
        "    for a in actions:\n"
        "        plan.append(a)\n"
        "        if a.startswith('B') and b < buckets:\n"
        "            plan.append(f'reduce {b}')\n"
        "            b += 1\n"
        "    return plan + [f'reduce {k}' for k in range(b, buckets)] + ['finish']",
        None,  # it runs: the gradients are wrong, the timing is not
    ),
}


def _in_this_run(wrong: dict, learners_case: str) -> list[str]:
    """Every wrong answer under ``make soak``; in the test suite, the one a learner met (a
    whole student lab per case: the suite's time on 2 cores allows one each)."""
    return list(wrong) if _soaking() else [learners_case]


def _run_lab(exercise: str, answer: str, upto: str | None, tmp_path):
    """The student lab with ``answer`` in the cell of ``exercise``, its measurement made
    small, run from the top to the cell that starts with ``upto`` (None: the end), skipping
    the other exercise's cells; the code cells run, each with (ename, evalue, seconds)."""
    import nbformat

    from .test_notebooks import run_watched

    nb = nbformat.read(LAB, as_version=4)
    other = "mesh_groups" if exercise == "hybrid_plan" else "hybrid_plan"
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if upto is not None and cells and cells[-1].source.startswith(upto):
            break
        if f"def {exercise}(" in cell.source:
            cell.source = answer
        elif other in cell.source:
            continue  # the other exercise's cells: unfinished here, and nothing reads them
        for old, new in SMALLER.items():
            cell.source = cell.source.replace(old, new)
        cells.append(cell)
    nb.cells = cells
    run_watched(nb, tmp_path, cell_timeout=CELL_LIMIT_S)
    out = []
    for cell in nb.cells:
        err = next((o for o in cell.outputs if o.output_type == "error"), None)
        timing = cell.metadata.get("execution", {})
        began, ended = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
        took = _seconds(ended) - _seconds(began) if began and ended else None
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        out.append((cell.source.splitlines()[0], err and err.ename, err and err.evalue, took,
                    text))  # fmt: skip
    return out


def _seconds(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@pytest.mark.slow
@pytest.mark.parametrize("name", _in_this_run(WRONG_GROUPS, "ranges"))
def test_wrong_groups_hang_no_later_cell_and_cell_7_says_they_differ(name, tmp_path):
    cells = _run_lab("mesh_groups", WRONG_GROUPS[name], "def my_groups_from_torch", tmp_path)
    errors = [(first, e, v) for first, e, v, _, _ in cells if e]
    assert not errors, errors  # the check's ✘ lines are printed, not raised
    *_, (first, _, _, took, text) = cells
    assert first.startswith("def my_groups_from_torch") and took < AT_ONCE_S, cells[-1]
    assert "init_device_mesh's pp group [0, 1]" in text, text
    said = {
        "transposed": "; yours: ([0, 2], [0, 1])",
        "ranges": "but as range, not lists of int",
        "arrays": "but as int64, ndarray, not lists of int",
        "nothing": "could not be read",
    }
    assert said[name] in text, text  # never "the same" without saying how the check sees it


@pytest.mark.slow
@pytest.mark.parametrize("name", _in_this_run(WRONG_PLANS, "flushes on stage 0 only"))
def test_a_wrong_plan_hangs_no_later_cell(name, tmp_path):
    answer, reason = WRONG_PLANS[name]
    cells = _run_lab("hybrid_plan", answer, None, tmp_path)
    check = next(c for c in cells if c[0].startswith("ok.grading.check_hybrid_plan"))
    assert "✘" in check[4], check  # the check fails it first
    runs = next(i for i, c in enumerate(cells) if c[0].startswith("ROUNDS = 1"))
    first, ename, evalue, took, _ = cells[runs]
    if reason is None:  # it runs, and so does every cell after it
        assert not [c for c in cells if c[1]], cells
        return
    assert ename is not None and reason in evalue and took < AT_ONCE_S, cells[runs]
    for first, ename, evalue, took, _ in cells[runs + 1 :]:  # the cells that need its runs
        assert ename == "NameError" and took < AT_ONCE_S, (first, ename, evalue, took)
