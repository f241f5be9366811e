"""ok.streams: a simulated GPU orders kernels as CUDA does and names races and early reuse."""

import pytest

from overlapkit import streams


def test_kernels_of_one_stream_run_in_order_and_two_streams_run_at_once():
    gpu = streams.Device()
    side = gpu.Stream("side")
    a = gpu.run("a", 2.0)
    with gpu.stream(side):
        b = gpu.run("b", 3.0)
    c = gpu.run("c", 1.0)
    assert (a.start, a.end, b.start, b.end, c.start, c.end) == (0, 2, 0, 3, 2, 3)
    assert gpu.step_ms() == 3.0


def test_an_event_makes_the_waiting_stream_start_after_the_marked_point():
    gpu = streams.Device()
    compute, side = gpu.current_stream(), gpu.Stream("side")
    x = gpu.empty(1, "x")
    w = gpu.run("write x", 2.0, writes=[x])
    done = gpu.Event()
    done.record(compute)
    gpu.run("later", 5.0)  # queued after the record: not waited for
    side.wait_event(done)
    with gpu.stream(side):
        r = gpu.run("read x", 1.0, reads=[x])
    assert r.start == w.end == 2.0 and r.after(w)
    assert gpu.hazards() == []


def _unordered(first: str, second: str) -> list[str]:
    """The hazards of x touched by a compute kernel (``first``: "reads" or "writes"), then by
    a kernel of another stream (``second``), with no event between them."""
    gpu = streams.Device()
    side = gpu.Stream("side")
    x = gpu.empty(1, "x")
    gpu.run(f"{first} x", 2.0, **{first: [x]})
    with gpu.stream(side):
        gpu.run(f"{second} x too", 1.0, **{second: [x]})
    return gpu.hazards()


def test_a_read_on_another_stream_without_an_event_is_a_race():
    assert _unordered("writes", "reads") == [
        "race: 'reads x too' on stream side reads x while 'writes x' on stream compute may "
        "still be running and writes it: no event orders them"
    ]


def test_two_reads_on_two_streams_are_no_race():
    assert _unordered("reads", "reads") == []


def _handed_to_side(record: bool):
    """A buffer made on compute, read on side, freed by the host, then another allocated."""
    gpu = streams.Device()
    compute, side = gpu.current_stream(), gpu.Stream("side")
    old = gpu.empty(4, "old")
    gpu.run("fill old", 1.0, writes=[old])
    side.wait_stream(compute)
    with gpu.stream(side):
        gpu.run("send old", 5.0, reads=[old])
    if record:
        old.record_stream(side)
    old.free()
    new = gpu.empty(4, "new")
    gpu.run("fill new", 1.0, writes=[new])
    return gpu, old, new


def test_a_freed_block_goes_to_the_next_buffer_of_its_stream_and_that_is_a_reuse_hazard():
    gpu, old, new = _handed_to_side(record=False)
    assert new.block == old.block
    assert gpu.hazards() == [
        "reuse: new got the memory of old, freed while 'send old' on stream side may still "
        "be running and reads it; 'fill new' on stream compute writes it"
    ]


def test_record_stream_keeps_the_block_from_reuse_until_that_stream_ran():
    gpu, old, new = _handed_to_side(record=True)
    assert new.block != old.block and gpu.hazards() == []
    gpu.synchronize()  # the host saw the side stream finish: the block is free again
    again = gpu.empty(4, "again")
    assert again.block == old.block


def _written_on_a_side_stream():
    """A device whose side stream writes x for 3 ms: (the device, x)."""
    gpu = streams.Device()
    side = gpu.Stream("side")
    x = gpu.empty(1, "x")
    with gpu.stream(side):
        gpu.run("write x", 3.0, writes=[x])
    return gpu, x


def test_after_the_host_synchronized_whatever_it_queues_comes_after():
    gpu, x = _written_on_a_side_stream()
    gpu.synchronize()
    r = gpu.run("read x", 1.0, reads=[x])
    assert r.start == 3.0 and gpu.hazards() == []


def test_misuse_is_an_error_naming_the_buffer():
    gpu = streams.Device()
    x = gpu.empty(1, "x")
    x.free()
    with pytest.raises(RuntimeError, match="kernel 'k': x was freed already"):
        gpu.run("k", 1.0, reads=[x])
    with pytest.raises(TypeError, match="'x' is not a buffer"):
        gpu.run("k", 1.0, reads=["x"])
    with pytest.raises(TypeError, match="<stream compute> is a stream of another device"):
        with gpu.stream(streams.Device().current_stream()):
            pass
    with pytest.raises(TypeError, match=r"gpu.stream\(\) takes a stream .*got 'comm'"):
        with gpu.stream("comm"):
            pass
    with pytest.raises(TypeError, match="wait_event\\(\\) takes an event"):
        gpu.current_stream().wait_event(gpu.current_stream())
    with pytest.raises(TypeError, match="wait_stream\\(\\) takes a stream"):
        gpu.current_stream().wait_stream(gpu.Event())


def test_a_layer_queues_backward_pack_all_reduce_and_unpack_on_the_current_stream():
    gpu = streams.Device()
    layer = streams.Layer("1", 3.0, 2.0, 8)
    grad = layer.backward(gpu)
    wire = layer.pack(gpu, grad)
    layer.all_reduce(gpu, wire, grad)
    assert [k.name for k in gpu.kernels] == ["backward 1", "pack 1", "all-reduce 1", "unpack 1"]
    assert (grad.mib, wire.mib) == (8, 4)
    assert gpu.step_ms() == pytest.approx(3.0 + 2.0 + 2 * streams.PACK_MS)
    tl = gpu.timeline()
    assert [(s.name, s.lane) for s in tl.spans][:2] == [("backward 1", "compute"),
                                                        ("pack 1", "compute")]  # fmt: skip


def test_kernels_on_the_link_run_one_at_a_time_whichever_stream_queued_them():
    gpu = streams.Device()
    a, b = gpu.Stream("a"), gpu.Stream("b")
    with gpu.stream(a):
        first = gpu.run("all-reduce 1", 2.0, link=True)
    with gpu.stream(b):
        second = gpu.run("all-reduce 2", 2.0, link=True)
        local = gpu.run("sum", 1.0)
    assert (first.start, second.start, local.start) == (0.0, 2.0, 4.0)


def test_an_event_records_the_current_stream_by_default_and_its_synchronize_orders_the_host():
    gpu, x = _written_on_a_side_stream()
    with gpu.stream(gpu.streams[1]):
        done = gpu.Event()
        done.record()  # on side, the current stream
    done.synchronize()
    r = gpu.run("read x", 1.0, reads=[x])
    assert (gpu.host, r.start) == (3.0, 3.0) and gpu.hazards() == []


def test_a_block_the_allocator_saw_finished_orders_what_the_host_queues_after_it():
    gpu = streams.Device()
    compute, side = gpu.current_stream(), gpu.Stream("side")
    old = gpu.empty(4, "old")
    side.wait_stream(compute)
    with gpu.stream(side):
        gpu.run("send old", 2.0, reads=[old])
    old.record_stream(side)
    old.free()
    gpu.run("busy", 5.0)
    compute.synchronize()  # by then the send is done: the allocator's event says so
    new = gpu.empty(4, "new")
    gpu.run("fill new", 1.0, writes=[new])
    assert new.block == old.block and gpu.hazards() == []
