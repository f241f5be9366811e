"""Lab 05's streams check: an overlapped backward on a simulated GPU passes; each typical
mistake is named (one stream, no event, the event recorded too early, no record_stream or
the wrong stream recorded, no wait before the optimizer, a wait or a synchronize inside
the loop, a wire never freed or freed before its kernels)."""

import pytest

import overlapkit as ok

from .conftest import failed_with


def step(second_stream=True, event="after pack", record="comm", final_wait=True,
         wait_each=False, sync_each=False, free="after"):  # fmt: skip
    """A learner's overlapped backward, with the choices a mistake changes."""

    def overlapped_backward(gpu, layers):
        compute = gpu.current_stream()
        side = gpu.Stream("comm") if second_stream else compute
        for layer in layers:
            grad = layer.backward(gpu)
            marker = gpu.Event()
            if event == "after backward":
                marker.record(compute)
            wire = layer.pack(gpu, grad)
            if free == "before":
                wire.free()
            if event == "after pack":
                marker.record(compute)
            if event is not None:
                side.wait_event(marker)
            with gpu.stream(side):
                layer.all_reduce(gpu, wire, grad)
            if record:
                wire.record_stream({"comm": side, "compute": compute}[record])
            if free == "after":
                wire.free()
            if wait_each:
                compute.wait_stream(side)
            if sync_each:
                gpu.synchronize()
        if final_wait:
            compute.wait_stream(side)

    return overlapped_backward


def test_an_overlapped_backward_passes_every_case_and_is_shorter_than_one_stream():
    report = ok.grading.check_overlapped_backward(step())
    assert report.all_passed and report.total == 4, report.cases
    assert "4 layers, each all-reduce shorter than a backward: step 16.0 ms (one stream: " \
           "22.6 ms)" in report.cases[0][1]  # fmt: skip


def test_the_pack_on_the_communication_stream_is_named_where_communication_is_longer():
    def packed_on_comm(gpu, layers):
        compute, comm = gpu.current_stream(), gpu.Stream("comm")
        for layer in layers:
            grad = layer.backward(gpu)
            comm.wait_stream(compute)
            with gpu.stream(comm):  # the wire is then allocated on comm: no record_stream
                wire = layer.pack(gpu, grad)
                layer.all_reduce(gpu, wire, grad)
            wire.free()
        compute.wait_stream(comm)

    report = ok.grading.check_overlapped_backward(packed_on_comm)
    assert report.cases[0][0]  # where compute is the longer chain it costs nothing
    failed_with(
        report,
        "3 layers whose all-reduces outlast their backward: step 15.2 ms",
        "'pack 3' ran on the communication stream",
    )


@pytest.mark.parametrize(
    ("mistake", "words"),
    [
        ({"second_stream": False}, ["every kernel ran on the compute stream",
                                    "gpu.Stream()"]),
        ({"event": None}, ["race: 'all-reduce 4' on stream comm reads wire 4 while 'pack 4'",
                           "comm.wait_event(event)"]),
        ({"event": "after backward"}, ["race:", "'pack 4'", "after layer.pack(...) is queued"]),
        ({"record": None}, ["reuse: wire 3 got the memory of wire 4",
                            "wire.record_stream(comm)"]),
        ({"record": "compute"}, ["reuse:", "the stream it was allocated on"]),
        ({"final_wait": False}, ["race: 'optimizer' on stream compute reads grad",
                                 "compute.wait_stream(comm)"]),
        ({"wait_each": True}, ["step 22.6 ms, where the overlapped step takes 16.0 ms",
                               "waited for communication inside the loop"]),
        ({"sync_each": True, "final_wait": False}, ["the host waited (synchronize)"]),
        ({"free": None}, ["wire 4, wire 3, wire 2, wire 1 never freed"]),
        ({"free": "before"}, ["raised RuntimeError", "wire 4 was freed already"]),
    ],
    ids=["one stream", "no event", "event before pack", "no record_stream",
         "record_stream(compute)", "no final wait", "wait in the loop", "synchronize in loop",
         "never freed", "freed before its kernels"],
)  # fmt: skip
def test_each_typical_mistake_is_named(mistake, words):
    report = ok.grading.check_overlapped_backward(step(**mistake))
    failed_with(report, *words)
    assert report.total == 1  # one clear reason, then the check stops


def test_an_unfinished_exercise_is_reported_as_not_implemented():
    def overlapped_backward(gpu, layers):
        raise NotImplementedError

    report = ok.grading.check_overlapped_backward(overlapped_backward)
    failed_with(report, "not implemented yet")
