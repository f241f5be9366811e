"""ok.Timeline: interval metrics, merging ranks, pictures and traces."""

from __future__ import annotations

import json
import pickle

import matplotlib
import pytest

import overlapkit as ok
from overlapkit.timeline import COMM, COMPUTE, intersect, length, subtract, union

matplotlib.use("Agg")


def make(spans):
    tl = ok.Timeline(rank=0)
    for name, start, end, lane in spans:
        tl.add(name, start, end, lane)
    return tl


def test_union_merges_overlapping_and_touching_intervals():
    assert union([(3, 4), (0, 1), (0.5, 2), (2, 2.5), (5, 5)]) == [(0, 2.5), (3, 4)]
    assert length([(0, 2), (1, 3)]) == 3


def test_intersect_and_subtract_of_disjoint_lists():
    a = [(0, 4), (6, 10)]
    b = [(1, 2), (3, 7), (9, 12)]
    assert intersect(a, b) == [(1, 2), (3, 4), (6, 7), (9, 10)]
    assert subtract(a, b) == [(0, 1), (2, 3), (7, 9)]


def test_fully_serial_step_has_zero_overlap():
    tl = make([("fwd", 0, 4, COMPUTE), ("allreduce", 4, 6, COMM)])
    assert tl.overlap_ratio() == pytest.approx(0.0)
    assert tl.hidden_fraction() == pytest.approx(0.0)


def test_fully_hidden_communication_has_ratio_one():
    tl = make([("bwd", 0, 10, COMPUTE), ("allreduce", 2, 8, COMM)])
    assert tl.overlap_ratio() == pytest.approx(1.0)
    assert tl.hidden_fraction() == pytest.approx(1.0)


def test_partial_overlap_matches_the_formula():
    # comp 0-6, comm 4-10: T_comp 6, T_comm 6, T_wall 10 -> (6 + 6 - 10) / 6
    tl = make([("bwd", 0, 6, COMPUTE), ("allreduce", 4, 10, COMM)])
    assert tl.overlap_ratio() == pytest.approx(2 / 6)
    assert tl.hidden_fraction() == pytest.approx(2 / 6)


def test_idle_time_lowers_the_ratio_but_not_the_hidden_fraction():
    # an idle gap 6-8 (waiting for a peer) counts in T_wall only
    tl = make([("bwd", 0, 6, COMPUTE), ("allreduce", 4, 6, COMM), ("step", 8, 10, COMPUTE)])
    assert tl.hidden_fraction() == pytest.approx(1.0)
    assert tl.overlap_ratio() == pytest.approx((8 + 2 - 10) / 2)


def test_overlapping_spans_on_one_lane_are_counted_once():
    tl = make([("a", 0, 4, COMM), ("b", 2, 6, COMM), ("c", 0, 6, COMPUTE)])
    assert tl.busy(COMM) == pytest.approx(6)
    assert tl.overlap_ratio() == pytest.approx(1.0)


def test_no_communication_gives_none_not_a_division_by_zero():
    tl = make([("fwd", 0, 1, COMPUTE)])
    assert tl.overlap_ratio() is None and tl.hidden_fraction() is None


def test_span_ending_before_it_starts_is_rejected():
    with pytest.raises(ValueError, match="ends"):
        make([("bad", 2, 1, COMPUTE)])


def test_merge_keeps_each_rank_and_averages_metrics():
    r0 = ok.Timeline(rank=0)
    r0.add("bwd", 0, 10, COMPUTE)
    r0.add("ar", 0, 10, COMM)  # fully hidden
    r1 = ok.Timeline(rank=1)
    r1.add("bwd", 0, 5, COMPUTE)
    r1.add("ar", 5, 10, COMM)  # fully exposed
    tl = ok.Timeline.merge([r1, r0])
    assert tl.ranks == [0, 1]
    assert tl.overlap_ratio(0) == pytest.approx(1) and tl.overlap_ratio(1) == pytest.approx(0)
    assert tl.overlap_ratio() == pytest.approx(0.5)
    rows = tl.summary()
    assert [r["rank"] for r in rows] == [0, 1]
    assert rows[1]["T_wall"] == pytest.approx(10)


def test_merge_rejects_things_that_are_not_timelines():
    with pytest.raises(TypeError, match="Timeline objects"):
        ok.Timeline.merge([ok.Timeline(rank=0), 3.0])


def test_timeline_survives_pickling_between_processes():
    tl = make([("fwd", 0, 1, COMPUTE)])
    assert pickle.loads(pickle.dumps(tl)).spans == tl.spans


def test_chrome_trace_has_one_process_per_rank_and_microsecond_spans(tmp_path):
    r0 = make([("fwd", 1.0, 1.5, COMPUTE), ("ar", 1.2, 1.4, COMM)])
    r1 = ok.Timeline(rank=1)
    r1.add("fwd", 1.1, 1.6, COMPUTE)
    path = tmp_path / "trace.json"
    ok.Timeline.merge([r0, r1]).to_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["name"], e["cat"]) for e in spans} == {
        (0, "fwd", "compute"),
        (0, "ar", "comm"),
        (1, "fwd", "compute"),
    }
    fwd0 = next(e for e in spans if e["pid"] == 0 and e["name"] == "fwd")
    assert fwd0["ts"] == 0 and fwd0["dur"] == pytest.approx(500_000)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}


def test_plot_has_a_row_per_rank_and_lane_and_states_the_overlap(tmp_path):
    r0 = make([("bwd", 0, 0.010, COMPUTE), ("ar", 0.004, 0.012, COMM)])
    r1 = ok.Timeline(rank=1)
    r1.add("bwd", 0, 0.010, COMPUTE)
    fig = ok.Timeline.merge([r0, r1]).plot(title="demo")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["rank 0 · compute", "rank 0 · comm", "rank 1 · compute"]
    assert "overlap ratio 0.75" in ax.get_title() and "hidden 75%" in ax.get_title()
    assert ax.get_xlabel() == "time (ms)"
    path = ok.Timeline.merge([r0, r1]).save(str(tmp_path / "tl.png"))
    assert (tmp_path / "tl.png").stat().st_size > 5_000 and path.endswith("tl.png")


def _measured_step():
    import torch
    import torch.distributed as dist

    tl = ok.Timeline()
    grad = torch.ones(1000)
    handle = tl.track("allreduce", dist.all_reduce(grad, async_op=True))
    with tl.span("compute"):
        sum(range(20000))
    handle.wait()
    return tl, grad[0].item()


def test_spans_recorded_on_ranks_merge_on_one_clock():
    results = ok.launch(_measured_step, world_size=2)
    tl = ok.Timeline.merge([tl for tl, _ in results])
    assert [v for _, v in results] == [2.0, 2.0]
    assert tl.ranks == [0, 1]
    assert {s.name for s in tl.select(lane=COMM)} == {"allreduce"}
    starts = [s.start for s in tl.select(lane=COMM)]
    assert abs(starts[0] - starts[1]) < 5.0  # one machine, one monotonic clock


@pytest.mark.gpu
def test_cuda_spans_land_on_the_host_clock():
    import torch

    tl = ok.Timeline(rank=0)
    before = tl.now()
    x = torch.randn(2048, 2048, device="cuda")
    with tl.cuda_span("matmul"):
        for _ in range(10):
            x = x @ x
    torch.cuda.synchronize()
    after = tl.now()
    (span,) = tl.select()
    assert before <= span.start < span.end <= after + 1e-3


def test_plot_can_leave_the_overlap_figures_out_of_the_title():
    tl = make([("bwd", 0, 1, COMPUTE), ("ar", 0.5, 1.5, COMM)])
    assert tl.plot(title="naive", metrics=False).axes[0].get_title() == "naive"
    assert tl.plot(metrics=False).axes[0].get_title() == ""


# ------------------------------------------------------------------ torch.profiler traces


def test_a_profiler_trace_becomes_compute_and_comm_lanes():
    trace = {"traceEvents": [
        {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 1000, "dur": 400, "tid": 1},
        {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 1100, "dur": 100, "tid": 1},
        {"ph": "X", "name": "c10d::allreduce_", "cat": "cpu_op", "ts": 1300, "dur": 10, "tid": 1},
        {"ph": "X", "name": "gloo:all_reduce", "cat": "user_annotation", "ts": 1300, "dur": 300,
         "tid": 2},
        {"ph": "X", "name": "PyTorch Profiler (0)", "cat": "Trace", "ts": 900, "dur": 900},
        {"ph": "M", "name": "thread_name", "tid": 1},
    ]}  # fmt: skip
    tl = ok.Timeline.from_profiler(trace, rank=3)
    assert {s.lane for s in tl.spans} == {"compute", "comm"} and tl.ranks == [3]
    assert tl.busy("compute") == pytest.approx(400e-6)  # nested ops counted once
    assert tl.busy("comm") == pytest.approx(300e-6)
    assert tl.hidden_fraction() == pytest.approx(100 / 300)  # 1300–1400 under the mm


def test_a_gpu_trace_puts_nccl_kernels_on_the_comm_lane():
    trace = [
        {"ph": "X", "name": "ampere_sgemm_128x64", "cat": "kernel", "ts": 0, "dur": 50},
        {"ph": "X", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "cat": "kernel",
         "ts": 20, "dur": 60},
    ]  # fmt: skip
    tl = ok.Timeline.from_profiler(trace)
    assert [s.lane for s in tl.spans] == ["compute", "comm"]


def test_an_empty_trace_is_refused_clearly():
    with pytest.raises(ValueError, match="no complete"):
        ok.Timeline.from_profiler({"traceEvents": []})


def _profiled_all_reduce(path):
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.ones(2**16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        work = torch.distributed.all_reduce(x, async_op=True)
        torch.mm(torch.ones(256, 256), torch.ones(256, 256))
        work.wait()
    if ok.rank() == 0:  # rank 0 writes the trace; rank 1 reads its profile directly
        prof.export_chrome_trace(path)
        with pytest.raises(ValueError, match="cannot be exported again"):
            ok.Timeline.from_profiler(prof)
        return True
    return ok.Timeline.from_profiler(prof).busy("comm") > 0


def test_a_real_profiler_trace_of_a_gloo_all_reduce_has_its_comm_span(tmp_path):
    path = tmp_path / "trace.json"
    assert all(ok.launch(_profiled_all_reduce, str(path), world_size=2, quiet=True))
    tl = ok.Timeline.from_profiler(str(path))
    assert tl.busy("comm") > 0 and tl.busy("compute") > 0


def test_plot_labels_never_overlap_where_a_lanes_spans_do():
    """Queued operations overlap on the comm lane (each from issue to completion): their
    names are written only where they fit, without running into one another."""
    tl = ok.Timeline()
    tl.add("route", 0.0, 0.004, "compute")
    for c in range(4):  # issued a little after one another, done one after another
        tl.add(f"dispatch {c}", 0.004 + 0.0002 * c, 0.010 + 0.006 * c, "comm")
        tl.add(f"expert {c}", 0.010 + 0.006 * c, 0.016 + 0.006 * c, "compute")
    fig = tl.plot(title="queued")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    texts = [t for t in ax.texts if t.get_text()]
    boxes = [t.get_window_extent(renderer) for t in texts]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), [t.get_text() for t in texts]
    names = {t.get_text() for t in texts}
    assert {"expert 0", "expert 3", "route"} <= names  # wide enough: labelled
    dispatches = {n for n in names if n.startswith("dispatch")}
    assert "dispatch 0" in dispatches and len(dispatches) < 4  # the first; not every one
