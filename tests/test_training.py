"""ok.training: the modes train, staleness delays updates, the straggler knob slows one rank."""

import pytest
import torch

import overlapkit as ok
from overlapkit.training import Task, train


def _run(mode, steps, kwargs):
    timeline = ok.Timeline()
    history = train(Task(), steps=steps, mode=mode, timeline=timeline, eval_every=steps, **kwargs)
    return history, timeline


@pytest.mark.parametrize(
    ("mode", "kwargs"),
    [
        ("sync", {}),
        ("stale", {"staleness": 2}),
        ("local", {"local_steps": 4}),
        ("accumulate", {"accumulate": 2}),
    ],  # fmt: skip
)
def test_every_mode_trains_the_task_on_two_ranks(mode, kwargs):
    results = ok.launch(_run, mode, 60, kwargs, world_size=2, timeout=120)
    for history, _ in results:
        assert history.loss[-1] < 0.5 * history.loss[0], (mode, history.loss)
    # every rank evaluates the same averaged model
    assert results[0][0].loss == pytest.approx(results[1][0].loss)


def test_stale_updates_lag_the_gradient_by_the_staleness():
    """On one rank, staleness d leaves the model untouched for the first d steps."""
    task = Task()
    start = [p.detach().clone() for p in task.model().parameters()]
    for d in (0, 3):
        h = train(task, steps=3, mode="stale", staleness=d, eval_every=1)
        assert (h.loss[-1] == h.loss[0]) == (d == 3), (d, h.loss)
    assert all(torch.equal(a, b) for a, b in zip(start, task.model().parameters(), strict=True))


def test_sync_and_zero_staleness_are_the_same_algorithm():
    a = ok.launch(_run, "sync", 20, {}, world_size=2)[0][0]
    b = ok.launch(_run, "stale", 20, {"staleness": 0}, world_size=2)[0][0]
    assert a.loss == pytest.approx(b.loss, rel=1e-5)


def test_the_straggler_sleeps_only_on_its_rank():
    # 5× its usual compute: a step the suite's other processes slowed that much on every
    # one of the 10 steps would leave nothing to sleep (1.5× once did, beside them)
    results = ok.launch(_run, "sync", 10, {"slow": {1: 5.0}}, world_size=2)
    names = [{s.name for s in timeline.spans} for _, timeline in results]
    assert "straggling" not in names[0] and "straggling" in names[1]


def test_emulated_compute_lasts_its_seconds_and_a_straggler_multiplies_them():
    results = ok.launch(_run, "sync", 6, {"compute": 0.05, "slow": {1: 1.5}}, world_size=2)
    (fast, fast_tl), (slow, slow_tl) = results
    fast_s, slow_s = sorted(fast.compute_time)[3], sorted(slow.compute_time)[3]
    assert fast_s >= 0.05 and slow_s >= 0.075, (fast.compute_time, slow.compute_time)
    assert 1.25 < slow_s / fast_s < 1.75, (fast.compute_time, slow.compute_time)
    assert {s.name for s in fast_tl.spans} >= {"emulated compute"}
    assert "straggling" not in {s.name for s in fast_tl.spans}
    assert {s.name for s in slow_tl.spans} >= {"emulated compute", "straggling"}
    # every step waits for the straggler: the fast rank's step is as long as its compute
    assert sorted(fast.step_time)[3] >= 0.075, fast.step_time


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"mode": "async"}, "mode must be one of sync, stale, local, accumulate; got 'async'"),
        ({"mode": "stale", "staleness": -1}, "staleness must be an integer ≥ 0, got -1"),
        ({"slow": {3: 1.2}}, "slow={3: 1.2}: give {rank: factor ≥ 1} for ranks 0…0"),
        ({"slow": {0: 0.5}}, "give {rank: factor ≥ 1}"),
        ({"compensate": -1.0, "mode": "stale"}, "compensate is DC-ASGD's λ ≥ 0; got -1.0"),
        ({"compensate": 0.5}, "compensate= corrects stale gradients: it needs mode='stale'"),
        ({"clip": 0}, "clip is the largest gradient norm applied, > 0"),
        ({"all_reduce": "nccl"}, "a compressor of ok.compression or a function; got 'nccl'"),
        ({"compute": 0}, "compute is the seconds of emulated compute per step, > 0"),
        ({"compute": "fast"}, "seconds of emulated compute per step, > 0 .or None.; got 'fast'"),
    ],
)
def test_bad_training_options_are_refused_clearly(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("{", r"\{").replace("}", r"\}")):
        train(Task(), steps=2, **kwargs)


def test_building_the_tasks_model_leaves_the_callers_random_numbers_alone():
    """Task.model() (called by every evaluation too) must not reset the global seed: a
    learner's dropout or sampling would then draw the same numbers after each evaluation."""
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    task = Task()
    first = task.model()
    assert torch.equal(torch.rand(3), expected)
    again = task.model()  # and still the same initial weights every call
    assert all(
        torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters(), strict=True)
    )


def test_compensation_moves_a_stale_gradient_by_lambda_g_squared_times_the_parameters_move():
    from overlapkit.training import _compensated  # noqa: PLC0415

    g = torch.tensor([1.0, -2.0, 0.5])
    moved = torch.tensor([0.1, 0.1, -0.2])
    assert torch.allclose(_compensated(g, 0.5, moved), g + 0.5 * g * g * moved)


def test_clipping_bounds_the_applied_step_and_compensation_changes_only_stale_runs():
    """On one rank: clip=1e-3 barely moves the model in 5 steps; λ = 0 is plain stale SGD;
    λ > 0 trains differently once the first stale gradient is applied."""
    task = Task()
    plain = train(task, steps=5, mode="stale", staleness=2, eval_every=1)
    zero = train(task, steps=5, mode="stale", staleness=2, eval_every=1, compensate=0.0)
    assert plain.loss == zero.loss
    comp = train(task, steps=5, mode="stale", staleness=2, eval_every=1, compensate=2.0)
    assert comp.loss[:4] == plain.loss[:4]  # steps 1-2 apply nothing; step 3 nothing moved yet
    assert comp.loss[4:] != plain.loss[4:]
    clipped = train(task, steps=5, mode="sync", eval_every=5, clip=1e-3)
    free = train(task, steps=5, mode="sync", eval_every=5)
    assert abs(clipped.loss[-1] - clipped.loss[0]) < 0.1 * abs(free.loss[-1] - free.loss[0])
