"""Check for lab 05's streams exercise: ``overlapped_backward(gpu, layers)`` queues a
data-parallel backward on a simulated GPU (:mod:`overlapkit.streams`), each gradient's
all-reduce on a second stream, and is judged by what the device saw::

    compute  │ backward 4 │ pack 4 │ backward 3 │ pack 3 │ … │ optimizer │
                          e4 ─┐             e3 ─┐            ▲ waits for comm
    comm                      │ all-reduce 4 │ unpack 4 │ all-reduce 3 │ …

A case passes with no race and no reuse, every wire buffer freed, and the step as short
as the overlapped order makes it. The ✘ line names the first thing wrong: which kernels
of which streams touch one buffer unordered, the block the allocator gave away too early
(``record_stream``), a wait inside the loop, a host that synchronized.
"""

from __future__ import annotations

from .. import streams
from ..launcher import LaunchError, LaunchTimeoutError
from .common import _learner_line, report_failure
from .exercises import answers_of
from .report import Report
from .traffic import run_recorded

#: the optimizer the check queues on the compute stream once the learner's step returned
OPTIMIZER_MS = 1.0
TIMEOUT_S = 30.0
_EPS = 1e-6


def _layers(spec) -> list[streams.Layer]:
    return [streams.Layer(str(n), b, a, mib) for n, b, a, mib in spec]


#: (what, layers in backward order: name, backward ms, all-reduce ms, MiB)
CASES = (
    ("4 layers, each all-reduce shorter than a backward",
     _layers([(4, 3.0, 2.0, 8), (3, 3.0, 2.0, 8), (2, 3.0, 2.0, 8), (1, 3.0, 2.0, 8)])),
    ("3 layers whose all-reduces outlast their backward",
     _layers([(3, 1.0, 4.0, 16), (2, 1.0, 4.0, 16), (1, 1.0, 4.0, 16)])),
    ("6 layers of two sizes",
     _layers([(6, 2.0, 1.0, 4), (5, 4.0, 3.0, 12), (4, 2.0, 1.0, 4), (3, 4.0, 3.0, 12),
              (2, 2.0, 1.0, 4), (1, 4.0, 3.0, 12)])),
    ("1 layer", _layers([(1, 2.0, 3.0, 4)])),
)  # fmt: skip


def _run_step(fn, layers) -> dict:
    """On the check's rank: the learner's step, then the optimizer on the compute stream
    (it reads every gradient); what the device saw, as plain data."""
    fn(streams.Device(), list(layers))  # a first device: what a call keeps must not leak
    gpu = streams.Device()
    compute = gpu.current_stream()
    fn(gpu, list(layers))
    grads = [b for b in gpu.buffers if b.name.startswith("grad ")]
    with gpu.stream(compute):
        gpu.run("optimizer", OPTIMIZER_MS, reads=grads)
    wires = [b for b in gpu.buffers if b.name.startswith("wire ")]
    return {
        "kernels": [(k.name, k.stream.name, k.start, k.end) for k in gpu.kernels],
        "touched": [([b.name for b in k.reads], [b.name for b in k.writes]) for k in gpu.kernels],
        "step": gpu.step_ms(),
        "hazards": gpu.hazards(),
        "unfreed": [b.name for b in wires if not b.freed],
        "recorded": {b.name: [s.name for s in b.recorded] for b in wires},
        "allocated_on": {b.name: b.stream.name for b in wires},
        "host": gpu.host,
    }


def overlapped_ms(layers) -> float:
    """The step when each all-reduce starts once its wire is packed and the previous one is
    done, and the optimizer once both streams are."""
    compute = comm = 0.0
    for layer in layers:
        compute += layer.backward_ms + streams.PACK_MS
        comm = max(comm, compute) + layer.all_reduce_ms + streams.PACK_MS
    return max(compute, comm) + OPTIMIZER_MS


def serial_ms(layers) -> float:
    kernels = sum(x.backward_ms + x.all_reduce_ms + 2 * streams.PACK_MS for x in layers)
    return kernels + OPTIMIZER_MS


def check_overlapped_backward(overlapped_backward) -> Report:
    """Check ``overlapped_backward(gpu, layers)`` on four backward passes of a simulated GPU."""
    report = Report("overlapped_backward")
    for what, layers in CASES:
        try:
            ((seen, _),) = run_recorded(_run_step, overlapped_backward, layers, world_size=1,
                                        timeout=TIMEOUT_S,
                                        forbid=answers_of("check_overlapped_backward"))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - one ✘ line, then stop
            if isinstance(exc, NotImplementedError):
                report.fail(f"{what}: not implemented yet (still raises NotImplementedError)")
            elif isinstance(exc, LaunchTimeoutError):
                report.fail(f"{what}: your function did not return within {TIMEOUT_S:g} s "
                            "(a loop that never ends, or a long sleep?)")  # fmt: skip
            elif isinstance(exc, LaunchError) or not hasattr(exc, "rank"):
                report_failure(report, what, exc, TIMEOUT_S)
            else:  # the learner's own exception, or the device's refusal
                report.fail(
                    f"{what}: your function raised {type(exc).__name__}: {exc}"
                    f"{_learner_line(exc)}{_explain(str(exc))}"
                )
            return report
        problem = _problem(seen, layers)
        if problem:
            report.fail(f"{what}: {problem}")
            return report  # one clear reason at a time
        report.ok(f"{what}: step {seen['step']:.1f} ms (one stream: {serial_ms(layers):.1f} ms), "
                  "no race, no reuse, every wire freed")  # fmt: skip
    return report


def _problem(seen: dict, layers) -> str:
    kernels = seen["kernels"]
    wrong = _shape(seen, layers)
    if wrong:
        return wrong
    if seen["hazards"]:
        first = seen["hazards"][0]
        return f"{first}. {_hint(first, seen)}"
    if seen["unfreed"]:
        return (f"{', '.join(seen['unfreed'])} never freed: in PyTorch a wire goes when its "
                "last reference does, at the loop's next turn; free it (wire.free()) once its "
                "kernels are queued")  # fmt: skip
    if seen["host"] > _EPS:
        return (f"the host waited (a synchronize()) until {seen['host']:.1f} ms: on a GPU "
                "the host then stops queueing work ahead of the kernels, and kernels it "
                "queues later cannot start before it; let the streams order the work (events, "
                "wait_stream), never the host")  # fmt: skip
    if len({stream for _, stream, *_ in kernels}) == 1:
        return (f"every kernel ran on the compute stream, one after another "
                f"({serial_ms(layers):.1f} ms): queue each all-reduce and unpack on a second "
                "stream (gpu.Stream()), inside `with gpu.stream(comm):`")  # fmt: skip
    step, best = seen["step"], overlapped_ms(layers)
    if step <= best + _EPS:
        return ""
    return f"step {step:.1f} ms, where the overlapped step takes {best:.1f} ms: " + _late(seen)


def _explain(text: str) -> str:
    if "'optimizer'" in text and "freed already" in text:
        return (": the optimizer the check queues after your function reads every gradient; "
                "free the wires, not the gradients")  # fmt: skip
    if "of another device" in text:
        return (": a stream, event or buffer of another device — one your function kept from "
                "an earlier call (the check calls it once per case, on a fresh device): make "
                "them inside the function, from the gpu it is given")  # fmt: skip
    return ""


#: each layer's kernels, what each reads and writes, and the stream the exercise puts it on
_KERNELS = (("backward", [], ["grad"], "compute"), ("pack", ["grad"], ["wire"], "compute"),
            ("all-reduce", ["wire"], ["wire"], "yours"),
            ("unpack", ["wire"], ["grad"], "yours"))  # fmt: skip


def _shape(seen: dict, layers) -> str:
    """Is every layer's step there, once, on its data, on its stream, in backward order?"""
    names = [k[0] for k in seen["kernels"]]
    where = {k[0]: k[1] for k in seen["kernels"]}
    touched = dict(zip(names, seen["touched"], strict=True))
    for layer in layers:
        for kind, reads, writes, stream in _KERNELS:
            name = f"{kind} {layer.name}"
            count = names.count(name)
            if count != 1:
                times = "was never queued" if count == 0 else f"was queued {count} times"
                return (f"{name!r} {times} on the device the check gave you: each layer's "
                        f"{kind} runs once (layer.backward, layer.pack and layer.all_reduce "
                        "for every layer of `layers`, on `gpu`)")  # fmt: skip
            want = [[f"{r} {layer.name}" for r in reads], [f"{w} {layer.name}" for w in writes]]
            if [list(t) for t in touched[name]] != want:
                modes = zip(("reads", "writes"), touched[name], strict=True)
                got = "; ".join(f"{mode} {', '.join(b) or 'nothing'}" for mode, b in modes)
                return (f"{name!r} {got}, where it should read {', '.join(want[0]) or 'nothing'} "
                        f"and write {', '.join(want[1])}: give each layer's calls that layer's "
                        "own grad and wire")  # fmt: skip
            if stream == "compute" and where[name] != streams.COMPUTE:
                return (f"{name!r} ran on stream {where[name]}: queue the backward and the pack "
                        f"on the compute stream (gpu.current_stream() as the call began), the "
                        "all-reduce and the unpack on your communication stream")  # fmt: skip
            mixed = len(set(where.values())) > 1  # (one stream for all: said below)
            if stream == "yours" and where[name] == streams.COMPUTE and mixed:
                return (f"{name!r} ran on the compute stream: queue every all-reduce and "
                        "unpack on your communication stream (gpu.stream(comm))")  # fmt: skip
    backwards = [n for n in names if n.startswith("backward ")]
    expected = [f"backward {layer.name}" for layer in layers]
    if backwards != expected:
        return (f"the backwards were queued as {', '.join(backwards)}: backward reaches the "
                f"layers in the order given ({', '.join(expected)}), each needing the gradient "
                "of the one before")  # fmt: skip
    return ""


def _hint(hazard: str, seen: dict) -> str:
    if hazard.startswith("reuse"):
        wire = hazard.split(" got the memory of ", 1)[1].split(",", 1)[0]
        streams_named = seen["recorded"].get(wire, [])
        if not streams_named:
            return (f"Tell the allocator which other stream uses {wire} before you free "
                    "it: wire.record_stream(comm)")  # fmt: skip
        own = seen["allocated_on"][wire]
        return (f"{wire} was recorded for {', '.join(streams_named)}"
                + (", the stream it was allocated on, which the allocator waits for anyway"
                   if set(streams_named) == {own} else "")
                + ": name the stream whose kernels use it after the free "
                "(wire.record_stream(comm))")  # fmt: skip
    if "'optimizer'" in hazard:
        return ("The optimizer (the check queues it on the compute stream once your function "
                "returns) reads every gradient: before you return, make the compute stream "
                "wait for the communication stream (compute.wait_stream(comm))")  # fmt: skip
    if "'pack " in hazard and "'all-reduce " in hazard:
        return ("The all-reduce must start after the pack wrote the wire: record an event on "
                "the compute stream after layer.pack(...) is queued, and make the "
                "communication stream wait for it (comm.wait_event(event))")  # fmt: skip
    return ("Order the two streams with an event: record it on the stream that goes first, "
            "after its kernel is queued; wait for it on the other")  # fmt: skip


def _late(seen: dict) -> str:
    """Why the step is longer than the overlapped one: the first kernel that started later
    than its own stream and the work it needs allowed."""
    ends: dict[str, float] = {}
    for name, stream, start, end in seen["kernels"]:
        idle = start - ends.get(stream, 0.0)
        if stream == streams.COMPUTE and name != "optimizer" and idle > _EPS:
            return (f"{name!r} started at {start:.1f} ms, {idle:.1f} ms after the compute "
                    "stream's previous kernel: the compute stream waited for communication "
                    "inside the loop; wait for it once, after the last layer")  # fmt: skip
        if name.startswith("all-reduce "):
            packed = next((e for n, _, _, e in seen["kernels"] if n == "pack " + name[11:]), 0.0)
            ready = max(packed, ends.get(stream, 0.0))
            if start - ready > _EPS:
                return (f"{name!r} started at {start:.1f} ms though its wire was packed at "
                        f"{packed:.1f} ms and its stream was free: it waited for an event "
                        "recorded later than needed (record it right after the pack)")  # fmt: skip
        ends[stream] = end
    return "some kernel waited longer than the work it needs"
