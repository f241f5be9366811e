"""ok.hybrid: pipeline stages × data-parallel replicas on a device mesh; gradients equal one
device's on every mesh shape and AllReduce start; replicas issuing buckets in different
orders are told, not mixed; the cost model's shared cores and AllReduce starts."""

import pytest
import torch

import overlapkit as ok
from overlapkit import costmodel, hybrid
from overlapkit.pipeline import make_schedule

WIDTH, BLOCKS, BATCH, STEPS = 16, 4, 12, 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
            for _ in range(BLOCKS)
        ]
    )


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def _train(dp, pp, dp_start, micro):
    """STEPS steps of SGD on this rank's stage of its replica: its parameters after, and the
    lanes its timeline got."""
    mesh = hybrid.make_mesh(dp, pp)
    full = _model()
    per = BLOCKS // pp
    piece = full[mesh.stage * per : (mesh.stage + 1) * per]
    stage = hybrid.HybridStage(piece, mesh, bucket_mb=WIDTH * (WIDTH + 1) * 4 / 2**20)
    x, y = (t.chunk(dp)[mesh.replica] for t in _data())
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    tl = ok.Timeline()
    for _ in range(STEPS):
        result = stage.step(x if mesh.stage == 0 else None, y if mesh.stage == pp - 1 else None,
                            torch.nn.functional.mse_loss, micro_batches=micro,
                            dp_start=dp_start, timeline=tl)  # fmt: skip
        opt.step()
        opt.zero_grad()
    launched = result.reduce_launched is not None
    return mesh.stage, [p.detach() for p in piece.parameters()], set(tl.lanes), launched


def _one_device():
    full = _model()
    x, y = _data()
    opt = torch.optim.SGD(full.parameters(), lr=0.1)
    for _ in range(STEPS):
        torch.nn.functional.mse_loss(full(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in full.parameters()]


@pytest.mark.parametrize("dp,pp", [(2, 2), (1, 4), (4, 1)])
@pytest.mark.parametrize("dp_start", hybrid.DP_STARTS)
def test_every_mesh_shape_and_allreduce_start_trains_as_one_device(dp, pp, dp_start,
                                                                   no_leftover_ranks):  # fmt: skip
    want = _one_device()
    for stage, params, lanes, launched in ok.launch(_train, dp, pp, dp_start, 2, world_size=4):
        n = len(params)
        for got, ref in zip(params, want[stage * n : (stage + 1) * n], strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        assert ("comm dp" in lanes) == (dp > 1) and ("comm pp" in lanes) == (pp > 1)
        assert launched == (dp > 1)


def _reversed_on_one_replica():
    mesh = hybrid.make_mesh(2, 2)
    piece = _model()[mesh.stage * 2 : (mesh.stage + 1) * 2]
    stage = hybrid.HybridStage(piece, mesh, bucket_mb=1e-9)  # a bucket per tensor
    order = list(range(len(stage.buckets)))
    if mesh.replica == 1:
        order.reverse()
    plan = stage.actions(2) + [f"reduce {b}" for b in order] + ["finish"]
    x, y = _data()
    stage.run_plan(plan, x if mesh.stage == 0 else None, y if mesh.stage == 1 else None,
                   torch.nn.functional.mse_loss, micro_batches=2)  # fmt: skip


def test_replicas_launching_buckets_in_different_orders_are_told_which_each_ran(
    no_leftover_ranks,
):
    with pytest.raises(Exception) as info:
        ok.launch(_reversed_on_one_replica, world_size=4, timeout=60)
    text = str(info.value)
    # stage 0's replicas are ranks 0 and 2 (or stage 1's, 1 and 3): both named, with the
    # bucket each ran
    assert any(
        f"rank {a} and rank {b} disagree" in text for a, b in ((0, 2), (2, 0), (1, 3), (3, 1))
    )
    assert "bucket 0]" in text and "bucket 3]" in text


def _bad(kind, plan=None):
    if kind == "shape":
        hybrid.make_mesh(3, 2)
    mesh = hybrid.make_mesh(2, 1)
    stage = hybrid.HybridStage(_model(), mesh, bucket_mb=1e-9)
    x, y = _data()
    if kind == "start":
        stage.step(x, y, torch.nn.functional.mse_loss, dp_start="later")
    stage.run_plan(plan, x, y, torch.nn.functional.mse_loss, micro_batches=2)


@pytest.mark.parametrize("kind,plan,message", [
    ("shape", None, "a 3 × 2 mesh has 6 ranks, but 2 are running"),
    ("start", None, "dp_start must be one of"),
    ("plan", ["F 0", "B 0", "F 1", "B 1", "reduce 9", "finish"], "there is no bucket 9"),
    ("plan", ["F 1", "F 0"], r"plan\[0\] 'F 1': the schedule runs 'F 0' here"),
    ("plan", ["F 0", "B 0", "F 1", "B 1 ready"], "never says 'finish'"),
    ("plan", ["F 0", "B 0", "F 1", "B 1", "reduce 0", "finish"], r"bucket\(s\) \[1, 2, "),
    ("plan", ["F 0", "B 0 ready", "F 1", "B 1 ready", "finish"], "one 'B k ready'"),
])  # fmt: skip
def test_bad_input_is_named(kind, plan, message, no_leftover_ranks):
    with pytest.raises(Exception, match=message):
        ok.launch(_bad, kind, plan, world_size=2, timeout=60)


def _flush_on_stage_0_only():
    mesh = hybrid.make_mesh(1, 2)
    if mesh.stage == 0:
        hybrid._flush(mesh, timeout_s=2)


def test_a_flush_one_stage_never_joins_is_named_not_waited_for_forever(no_leftover_ranks):
    with pytest.raises(Exception, match=r"stage 0 \(rank 0\) waited 2 s at 'flush'"):
        ok.launch(_flush_on_stage_0_only, world_size=2, timeout=30)


def _plans_that_disagree_on_flush(kind):
    mesh = hybrid.make_mesh(2, 2)
    stage = hybrid.HybridStage(_model()[:2] if mesh.stage == 0 else _model()[2:], mesh,
                               bucket_mb=1e-9)  # fmt: skip
    plan = hybrid.plan_for("after", stage.actions(2), mesh.stage, len(stage.buckets))
    if kind == "stage 0 only" and mesh.stage == 0:
        plan = [*plan[:-1], "flush", "finish"]
    if kind == "mid-plan":
        plan = [plan[0], "flush", *plan[1:]]
    x, y = _data()
    stage.run_plan(plan, x[:4] if mesh.stage == 0 else None, y[:4] if mesh.stage == 1 else None,
                   torch.nn.functional.mse_loss, micro_batches=2)  # fmt: skip


@pytest.mark.parametrize("kind, words", [
    ("stage 0 only", r"stage\(s\) \[1\] never say 'flush', but stage\(s\) \[0\] do"),
    ("mid-plan", r"plan\[1\] 'flush': 'flush' waits until every stage has run all its actions"),
])  # fmt: skip
def test_a_plan_that_flushes_on_some_stages_or_too_soon_is_refused_at_once(
    kind, words, no_leftover_ranks
):
    import time

    began = time.monotonic()
    with pytest.raises(Exception, match=words):
        ok.launch(_plans_that_disagree_on_flush, kind, world_size=4, timeout=60)
    assert time.monotonic() - began < 30  # not the flush's 60 s wait


def test_the_flush_counts_name_the_stages_short_of_them():
    assert hybrid.flush_mismatch({0: 1, 1: 1}) is None
    assert hybrid.flush_mismatch({0: 0, 1: 1, 2: 0}).startswith(
        "stage(s) [0, 2] never say 'flush', but stage(s) [1] do"
    )
    assert hybrid.flush_mismatch({0: 2, 1: 1}).startswith(
        "stage(s) [1] say 'flush' fewer times than stage(s) [0] (2)"
    )


def test_the_kits_plans_say_when_each_stage_reduces():
    actions = ["F 0", "F 1", "B 0", "B 1"]
    assert hybrid.plan_for("flush", actions, 1, 2) == [*actions, "flush", "reduce 0",
                                                       "reduce 1", "finish"]  # fmt: skip
    assert hybrid.plan_for("after", actions, 0, 2) == [*actions, "reduce 0", "reduce 1", "finish"]
    assert hybrid.plan_for("overlap", actions, 0, 2) == [*actions[:-1], "B 1 ready", "finish"]
    assert hybrid.plan_for("overlap", actions, 1, 2) == hybrid.plan_for("after", actions, 1, 2)


def test_the_cores_model_is_the_pipeline_model_when_every_rank_has_a_core():
    schedule = make_schedule("1f1b", 3, 4)
    alone = costmodel.pipeline_step(schedule, 1.0, 2.0, 0.1)
    shared = costmodel.pipeline_on_cores(schedule, 1.0, 2.0, 0.1, replicas=2, cores=6)
    assert shared["step"] == pytest.approx(alone["step"])
    got, want = sorted(shared["spans"]), sorted(alone["spans"])
    assert [(s, n) for s, n, *_ in got] == [(s, n) for s, n, *_ in want]
    assert [t for *_, b, e in got for t in (b, e)] == pytest.approx(
        [t for *_, b, e in want for t in (b, e)]
    )


def test_stages_computing_at_once_on_too_few_cores_go_slower_but_the_ends_do_not():
    schedule = make_schedule("1f1b", 2, 4)
    full = costmodel.pipeline_on_cores(schedule, 1.0, 2.0, 0.0, replicas=2, cores=4)
    half = costmodel.pipeline_on_cores(schedule, 1.0, 2.0, 0.0, replicas=2, cores=2)
    assert full["step"] < half["step"] < 2 * full["step"]
    first = next(e - b for s, name, b, e in half["spans"] if (s, name) == (0, "F0"))
    assert first == pytest.approx(1.0)  # stage 0's first forward computes alone


def test_overlap_hides_the_later_stages_allreduce_in_the_cool_down():
    schedule = make_schedule("1f1b", 2, 2)
    args = (schedule, 1.0, 2.0, 0.2, 2.2)
    flush = costmodel.hybrid_step(*args, dp_start="flush", buckets=8)
    after = costmodel.hybrid_step(*args, dp_start="after", buckets=8)
    over = costmodel.hybrid_step(*args, dp_start="overlap", buckets=8)
    assert flush["hidden"] == 0 and flush["step"] == pytest.approx(flush["pipe"] + 2.2)
    # after its own last backward and its send (0.2 on the shared link), stage 1's AllReduce
    # runs beside stage 0's last backward (2.0): all but 0.2 of it before the pipeline's end
    assert after["reduce"][1][1] == pytest.approx(after["pipe"] + 0.2)
    # ... but the first stage ends the pipeline: only its buckets in its backward shorten it
    assert after["step"] == pytest.approx(flush["step"])
    assert over["step"] < 0.9 * flush["step"] and over["hidden"] > 0.6


def test_a_communication_lane_per_group_counts_as_communication():
    tl = ok.Timeline(0)
    tl.add("F0", 0.0, 1.0)
    tl.add("act 0", 0.5, 1.5, "comm pp")
    tl.add("bucket 0", 1.5, 2.5, "comm dp")
    assert tl.hidden_fraction() == pytest.approx(0.25)
    rows = hybrid.hot_spots(tl)
    exposed = [(r["group"], r["exposed_ms"]) for r in rows]
    assert exposed == [("dp", pytest.approx(1000.0)), ("pp", pytest.approx(500.0))]
