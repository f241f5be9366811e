"""ok.Timeline: interval metrics, merging ranks, pictures and traces."""

from __future__ import annotations

import json
import pickle
import types
from pathlib import Path

import matplotlib
import pytest
import torch

import overlapkit as ok
from overlapkit import timeline as timeline_module
from overlapkit.timeline import COMM, COMPUTE, intersect, length, subtract, union

DATA = Path(__file__).parent / "data"

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


def _device_tids_as_names(trace):
    """The trace as older Kineto wrote it: a GPU event's tid is "stream N", not N."""
    for e in trace["traceEvents"]:
        if e.get("pid") == 0 and isinstance(e.get("tid"), int) and e["tid"]:
            e["tid"] = f"stream {e['tid']}"
    return trace


def test_a_cuda_trace_counts_what_the_gpu_ran_not_what_the_host_launched():
    """tests/data/ddp_step_cuda_trace.json: one DDP step of rank 0 (CPU + CUDA activities).
    Stream 7: gemm 100–400 µs, bucket copy 402–442, gemm 445–745, gemm 750–1050,
    optimizer 1262–1282, memset 1290–1292, loss copy 1293–1295; stream 20: the NCCL
    AllReduce 450–1250. The host's cpu_ops launched them; its aten::item (600–1298)
    only waited for the GPU, and counting it as compute would hide the whole AllReduce."""
    path = DATA / "ddp_step_cuda_trace.json"
    raw = json.loads(path.read_text())
    for source in (str(path), _device_tids_as_names(raw)):
        tl = ok.Timeline.from_profiler(source, rank=0)
        us = [(s.name[:22], round(s.start * 1e6, 3), round(s.end * 1e6, 3)) for s in tl.spans]
        compute = [u for u, s in zip(us, tl.spans, strict=True) if s.lane == COMPUTE]
        assert compute == [
            ("ampere_sgemm_128x64_nn", 100.0, 400.0),
            ("Memcpy DtoD (Device ->", 402.0, 442.0),
            ("ampere_sgemm_128x64_nn", 445.0, 745.0),
            ("ampere_sgemm_128x64_nt", 750.0, 1050.0),
            ("void at::native::(anon", 1262.0, 1282.0),
            ("Memset (Device)", 1290.0, 1292.0),
            ("Memcpy DtoH (Device ->", 1293.0, 1295.0),
        ]
        (comm,) = tl.select(lane=COMM)
        assert comm.name.startswith("ncclDevKernel_AllReduce_Sum_f32_RING_LL")
        assert (comm.start, comm.end) == (pytest.approx(450e-6), pytest.approx(1250e-6))
        assert tl.busy(COMPUTE) == pytest.approx(964e-6)
        # hidden: 450–745 and 750–1050 of 450–1250 (host spans would make it 800 / 800)
        assert tl.hidden_fraction() == pytest.approx(595 / 800)
        assert tl.overlap_ratio() == pytest.approx((964 + 800 - 1195) / 800)


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


# ------------------------------------------------------------------ track(): host or GPU clock


class _FakeCuda:
    """``torch.cuda`` as far as a timeline uses it. An event recorded on a stream is
    stamped with the next GPU time in ``times`` (when the GPU would reach it, in ms)."""

    def __init__(self, *times):
        self.times, self.stream, self.log = list(times), "caller", []

    def Event(self, enable_timing=False):  # noqa: N802 (torch's name)
        fake = self

        class Event:
            def record(self, stream=None):
                self.t, self.on = fake.times.pop(0), stream
                fake.log.append(("record", stream))

            def elapsed_time(self, end):
                return end.t - self.t

            def synchronize(self):
                pass

        return Event()

    def current_stream(self, device=None):
        return self.stream

    def synchronize(self, device=None):
        pass


class _FakeWork:
    """A work whose wait() and is_completed() are logged; ``future`` None: it has none."""

    def __init__(self, future=None, log=None):
        self.future, self.log = future, [] if log is None else log

    def get_future(self):
        if self.future is None:
            raise RuntimeError("getFuture is not implemented")
        return self.future

    def wait(self, *args):
        self.log.append(("wait", args))
        return True

    def is_completed(self):
        return "the work's answer"


def _host_clock(monkeypatch, start=100.0):
    clock = [start]
    monkeypatch.setattr(ok.Timeline, "now", staticmethod(lambda: clock[0]))
    return clock


def test_track_of_host_work_keeps_the_host_clock(monkeypatch):
    """CPU work (gloo, the kit's ops): from track() to the future's completion, or to
    wait() without a future, on the host's clock; CUDA is never touched."""
    monkeypatch.setattr(timeline_module, "_torch_cuda", lambda: pytest.fail("CUDA touched"))
    clock = _host_clock(monkeypatch)
    tl = ok.Timeline(rank=0)
    future = torch.futures.Future()
    handle = tl.track("allreduce", _FakeWork(future))
    clock[0] = 103.0
    future.set_result([torch.ones(2)])  # CPU tensors: the host's clock
    clock[0] = 104.0
    assert handle.wait() is True and handle.is_completed() == "the work's answer"
    no_future = tl.track("send", _FakeWork(), lane="comm pp")
    clock[0] = 107.0
    no_future.wait()
    done = torch.futures.Future()
    done.set_result([types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))])
    forced = tl.track("forced", _FakeWork(done), device="cpu")  # the host's clock, said so
    assert [(s.name, s.start, s.end, s.lane) for s in tl.select()] == [
        ("allreduce", 100.0, 103.0, COMM),
        ("send", 104.0, 107.0, "comm pp"),
        ("forced", 107.0, 107.0, COMM),
    ]
    assert forced.is_completed() == "the work's answer"


class _NcclLikeFuture:
    """NCCL's future: complete at launch, its value the collective's CUDA tensors; PyTorch
    runs its callbacks on a pool stream synchronised with the collective's kernels."""

    def __init__(self, cuda):
        self.cuda = cuda

    def done(self):
        return True

    def value(self):
        return [types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))]

    def add_done_callback(self, callback):
        self.cuda.stream = "pool"
        callback(self)
        self.cuda.stream = "caller"


def test_track_of_nccl_work_is_timed_by_cuda_events_on_the_gpus_clock(monkeypatch):
    """The CUDA path's logic, with fake events: start on the caller's stream at track(),
    end on the stream the future's callback runs on, both placed by the anchor. That the
    real events bracket the real NCCL kernel only a GPU run shows (the gpu tests below)."""
    # GPU ms at which the start (track), end (the collective done) and anchor are reached
    cuda = _FakeCuda(2.0, 9.5, 10.0)
    monkeypatch.setattr(timeline_module, "_torch_cuda", lambda: cuda)
    clock = _host_clock(monkeypatch, start=50.0)
    tl = ok.Timeline(rank=0)
    work = _FakeWork(_NcclLikeFuture(cuda))
    handle = tl.track("allreduce", work)  # the device, from the future's tensors
    assert cuda.log == [("record", "caller"), ("record", "pool")]
    clock[0] = 50.001  # wait() returns at once on the host, as NCCL's does
    assert handle.wait() is True and work.log == [("wait", ())]
    assert len(cuda.log) == 2  # wait() recorded nothing more: the callback had the end
    assert handle.is_completed() == "the work's answer"  # the work's, not the span's
    clock[0] = 60.0  # the timeline is read: the anchor (GPU 10 ms) is host 60 s
    (span,) = tl.select()
    assert (span.name, span.lane) == ("allreduce", COMM)
    assert span.start == pytest.approx(60.0 - 8e-3) and span.end == pytest.approx(60.0 - 0.5e-3)


def test_track_of_cuda_work_without_a_future_ends_after_wait_on_the_current_stream(monkeypatch):
    """device= says it is CUDA work; no future: the end event is recorded on the caller's
    stream after wait(), which made that stream wait for the work."""
    cuda = _FakeCuda(1.0, 4.0, 6.0)
    monkeypatch.setattr(timeline_module, "_torch_cuda", lambda: cuda)
    clock = _host_clock(monkeypatch, start=20.0)
    tl = ok.Timeline(rank=0)
    work = _FakeWork(log=cuda.log)
    handle = tl.track("all_gather", work, device="cuda:0")
    handle.wait(5.0)
    assert cuda.log == [("record", "caller"), ("wait", (5.0,)), ("record", "caller")]
    clock[0] = 30.0
    (span,) = tl.select()
    assert (span.start, span.end) == (pytest.approx(30.0 - 5e-3), pytest.approx(30.0 - 2e-3))


@pytest.mark.gpu
def test_tracked_cuda_work_is_the_gpus_time_not_the_hosts_wait():
    """NCCL's contract on one GPU: work on a stream of its own, a CUDA future completed
    at launch, wait() only makes the caller's stream wait. The span ends when the GPU is
    done with the work: after the host's wait() returned, before the longer compute
    queued behind it on the caller's stream ends."""
    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(4096, 4096, device=dev)
    b = torch.randn(4096, 4096, device=dev) / 64
    (a @ b).sum().item()  # cuBLAS ready
    side = torch.cuda.Stream(dev)

    class StreamWork:
        def __init__(self):
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                out = a
                for _ in range(5):
                    out = out @ b
                self.done = torch.cuda.Event()
                self.done.record()
                self.future = torch.futures.Future(devices=[dev])
                self.future.set_result([out])  # its events on the side stream, after the work

        def get_future(self):
            return self.future

        def wait(self):
            torch.cuda.current_stream(dev).wait_event(self.done)
            return True

        def is_completed(self):
            return self.done.query()

    tl = ok.Timeline(rank=0)
    before = tl.now()
    handle = tl.track("collective", StreamWork())
    with tl.cuda_span("compute"):
        c = a
        for _ in range(30):
            c = c @ b
    handle.wait()
    returned = tl.now()
    torch.cuda.synchronize()
    after = tl.now()
    (comm,), (compute,) = tl.select(lane=COMM), tl.select(lane=COMPUTE)
    assert before <= comm.start < comm.end <= after + 1e-3
    assert comm.end > returned  # the host's clock would have ended it here
    assert comm.end < compute.end  # not stretched over what the caller's stream queued


def _tracked_nccl_all_reduce():
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    x = torch.ones(2**26, device=ok.device())  # 256 MB
    dist.all_reduce(x)
    torch.cuda.synchronize()
    tl = ok.Timeline()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        before = tl.now()
        handle = tl.track("allreduce", dist.all_reduce(x, async_op=True))
        handle.wait()
        returned = tl.now()
        torch.cuda.synchronize()
        after = tl.now()
    kernels = [s.duration for s in ok.Timeline.from_profiler(prof).select(lane=COMM)]
    (span,) = tl.select()
    return before, returned, after, span, kernels


@pytest.mark.gpu
def test_a_tracked_nccl_all_reduce_spans_its_kernel():
    world = min(2, torch.cuda.device_count())
    for before, returned, after, span, kernels in ok.launch(
        _tracked_nccl_all_reduce, world_size=world, backend="nccl", quiet=True
    ):
        assert span.lane == COMM and before <= span.start <= span.end <= after + 1e-3
        if kernels:  # NCCL ran a kernel (one rank alone may not): the span holds it
            assert span.duration >= max(kernels) - 20e-6
            if world > 1:
                assert span.end > returned  # wait() returned before the GPU was done


def test_a_stamp_is_the_host_clock_off_a_gpu_and_a_cuda_event_on_one(monkeypatch):
    """The wrappers' compute spans: on the CPU the host's clock, as before; on a CUDA device
    events on the current stream, placed on the host clock when the timeline is read."""
    monkeypatch.setattr(timeline_module, "_torch_cuda", lambda: pytest.fail("CUDA touched"))
    clock = _host_clock(monkeypatch, start=5.0)
    tl = ok.Timeline(rank=0)
    start = tl.stamp(torch.device("cpu"))
    clock[0] = 6.5
    tl.add("F0", start, tl.stamp(None))
    assert [(s.name, s.start, s.end) for s in tl.select()] == [("F0", 5.0, 6.5)]

    cuda = _FakeCuda(1.0, 3.0, 4.0)  # GPU ms: the forward's start, its end, the anchor
    monkeypatch.setattr(timeline_module, "_torch_cuda", lambda: cuda)
    tl = ok.Timeline(rank=0)
    start = tl.stamp("cuda:0")
    assert tl.add("F1", start, tl.stamp("cuda:0")) is None  # placed when read
    assert cuda.log == [("record", "caller"), ("record", "caller")]
    clock[0] = 10.0  # read: the anchor (GPU 4 ms) is host 10 s
    (span,) = tl.select()
    assert (span.start, span.end) == (pytest.approx(10.0 - 3e-3), pytest.approx(10.0 - 1e-3))
