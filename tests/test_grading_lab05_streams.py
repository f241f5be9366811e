"""Lab 05's streams check: an overlapped backward on a simulated GPU passes; each typical
mistake is named (one stream, no event, the event recorded too early, no record_stream or
the wrong stream recorded, no wait before the optimizer, a wait or a synchronize inside
the loop, a wire never freed or freed before its kernels)."""

import pytest

import overlapkit as ok

from .conftest import failed_with


def step(second_stream=True, event="after pack", record="comm", final_wait=True,
         wait_each=False, sync_each=False, free="after", sync_end=False):  # fmt: skip
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
        if sync_end:
            gpu.synchronize()

    return overlapped_backward


def test_an_overlapped_backward_passes_every_case_and_is_shorter_than_one_stream():
    report = ok.grading.check_overlapped_backward(step())
    assert report.all_passed and report.total == 4, report.cases
    assert "4 layers, each all-reduce shorter than a backward: step 16.0 ms (one stream: " \
           "22.6 ms)" in report.cases[0][1]  # fmt: skip


def _variant(body: str, comm: str = "gpu.Stream('comm')"):
    """A learner's loop written out: ``body`` runs for each layer (``i``, ``layer``), with
    ``compute``, ``comm`` (the expression ``comm``), ``grads`` (a list) and ``gpu`` at hand,
    and ``KEPT``, a dict that outlives a call; the final wait follows."""
    source = (
        "def overlapped_backward(gpu, layers):\n"
        f"    compute, comm, grads = gpu.current_stream(), {comm}, []\n"
        "    for i, layer in enumerate(layers):\n"
        + "".join(f"        {line}\n" for line in body.strip().splitlines())
        + "    compute.wait_stream(comm)\n"
    )
    scope: dict = {"KEPT": {}}
    exec(compile(source, "learner.py", "exec"), scope)  # noqa: S102 - the test's own code
    return scope["overlapped_backward"]


_RIGHT = """
grad = layer.backward(gpu)
wire = layer.pack(gpu, grad)
comm.wait_stream(compute)
with gpu.stream(comm):
    layer.all_reduce(gpu, wire, grad)
wire.record_stream(comm)
wire.free()
"""


def test_the_variant_helper_writes_a_step_that_passes():
    assert ok.grading.check_overlapped_backward(_variant(_RIGHT)).all_passed


def _stream_per_layer(wait_for_each: bool):
    def overlapped_backward(gpu, layers):
        compute, sides = gpu.current_stream(), []
        for layer in layers:
            grad = layer.backward(gpu)
            wire = layer.pack(gpu, grad)
            sides.append(gpu.Stream(f"comm {layer.name}"))
            sides[-1].wait_stream(compute)
            with gpu.stream(sides[-1]):
                layer.all_reduce(gpu, wire, grad)
            wire.record_stream(sides[-1])
            wire.free()
        for side in sides if wait_for_each else sides[-1:]:
            compute.wait_stream(side)

    return overlapped_backward


def test_a_stream_per_layer_passes_when_compute_waits_for_each_the_link_is_shared():
    report = ok.grading.check_overlapped_backward(_stream_per_layer(wait_for_each=True))
    assert report.all_passed, report.cases
    assert "step 16.0 ms" in report.cases[0][1]  # as one communication stream: one link


def test_a_stream_per_layer_with_only_the_last_waited_for_is_a_race_before_the_optimizer():
    failed_with(ok.grading.check_overlapped_backward(_stream_per_layer(wait_for_each=False)),
                "race: 'optimizer' on stream compute reads grad 4 while 'unpack 4' on stream "
                "comm 4")  # fmt: skip


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (_RIGHT + "return", ["'backward 3' was never queued on the device the check gave you"]),
        (_RIGHT.replace("layer.all_reduce(gpu, wire, grad)",
                        "layer.all_reduce(gpu, wire, grads[-1] if grads else grad)")
         + "grads.append(grad)", ["'unpack 3' reads wire 3; writes grad 4, where it should "
                                  "read wire 3 and write grad 3"]),
        (_RIGHT.replace("wire = layer.pack(gpu, grad)", "wire = grad").replace(
            "wire.free()", ""), ["'pack 4' was never queued"]),
        (_RIGHT.replace("layer.all_reduce(gpu, wire, grad)",
                        "layer.all_reduce(gpu, wire, grad)\n    layer.all_reduce(gpu, wire, grad)"),
         ["'all-reduce 4' was queued 2 times"]),
        ("with gpu.stream(comm):\n" + "".join("    " + ln + "\n" for ln in
                                               _RIGHT.strip().splitlines()[:2])
         + "with gpu.stream(comm):\n    layer.all_reduce(gpu, wire, grad)\nwire.free()",
         ["'backward 4' ran on stream comm: queue the backward and the pack on the compute "
          "stream"]),
        (_RIGHT.replace("comm.wait_stream(compute)\nwith gpu.stream(comm):",
                        "with gpu.stream(comm):\n    comm.wait_stream(compute)")
         .replace("wire = layer.pack(gpu, grad)\n", "")
         .replace("    comm.wait_stream(compute)", "    comm.wait_stream(compute)\n"
                  "    wire = layer.pack(gpu, grad)"),
         ["'pack 4' ran on stream comm"]),
    ],
    ids=["returns after one layer", "sums into another layer's grad", "no pack",
         "all-reduce queued twice", "everything on comm", "pack on comm"],
)  # fmt: skip
def test_a_step_that_is_not_every_layers_own_step_is_named(body, words):
    failed_with(ok.grading.check_overlapped_backward(_variant(body)), *words)


def test_a_stream_kept_from_an_earlier_call_is_named():
    kept = _variant(_RIGHT, comm="KEPT.setdefault('comm', gpu.Stream('comm'))")  # made once
    failed_with(
        ok.grading.check_overlapped_backward(kept),
        "a stream, event or buffer of another device",
        "make them inside the function",
    )


def test_some_all_reduces_on_the_compute_stream_are_named():
    first_only = "with gpu.stream(comm if i == 0 else compute):"
    split = _RIGHT.replace("with gpu.stream(comm):", first_only)
    failed_with(ok.grading.check_overlapped_backward(_variant(split)),
                "'all-reduce 3' ran on the compute stream: queue every all-reduce and unpack "
                "on your communication stream")  # fmt: skip


def test_a_host_that_waits_for_the_compute_stream_is_named_not_the_block_it_let_go():
    # the allocator then sees each wire's block free: no reuse to report, but a host wait
    waits = _variant(_RIGHT + "compute.synchronize()")
    failed_with(ok.grading.check_overlapped_backward(waits), "the host waited (a synchronize())")


def test_layers_queued_out_of_backward_order_are_named():
    def reversed_backward(gpu, layers):
        step(**{})(gpu, list(reversed(layers)))

    failed_with(ok.grading.check_overlapped_backward(reversed_backward),
                "the backwards were queued as backward 1, backward 2, backward 3, backward 4",
                "backward reaches the layers in the order given")  # fmt: skip


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
        ({"sync_each": True, "final_wait": False}, ["the host waited (a synchronize())"]),
        ({"sync_end": True, "final_wait": False}, ["the host waited (a synchronize()) until "
                                                   "15.0 ms"]),
        ({"free": None}, ["wire 4, wire 3, wire 2, wire 1 never freed"]),
        ({"free": "before"}, ["your function raised RuntimeError",
                              "wire 4 was freed already"]),
    ],
    ids=["one stream", "no event", "event before pack", "no record_stream",
         "record_stream(compute)", "no final wait", "wait in the loop", "synchronize in loop",
         "synchronize at the end",
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
