"""The race guard judges bytes, not buffers: views of one buffer in flight at once are
fine when disjoint, a race when they overlap and one writes; a write to a slice in
flight is told from a write to its neighbour by content (a signalling-NaN poison)."""

from __future__ import annotations

import pytest
import torch

import overlapkit as ok
from overlapkit import inflight

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")


def test_overlap_is_decided_by_the_bytes_two_views_share():
    buf = torch.zeros(6, 4)
    assert inflight.overlaps(buf[:3], buf[2:])
    assert not inflight.overlaps(buf[:3], buf[3:])
    assert not inflight.overlaps(buf[:, 0], buf[:, 1])  # interleaved columns share no byte
    assert inflight.overlaps(buf[:, 1], buf[2])  # a column crosses every row
    assert not inflight.overlaps(buf.view(-1)[1::2], buf.view(-1)[::2])
    as_bytes = buf.view(-1).view(torch.int8)  # by bytes, not elements:
    assert inflight.overlaps(as_bytes[5:6], buf[0, 1:2])
    assert not inflight.overlaps(as_bytes[3:4], buf[0, 1:2])
    assert not inflight.overlaps(buf, torch.zeros(6, 4))  # another buffer
    assert not inflight.overlaps(buf[:0], buf)  # nothing to share


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64]
)
def test_the_poison_reads_as_nan_and_any_arithmetic_on_it_shows(dtype):
    t = torch.ones(8, dtype=dtype)
    inflight.poison(t)
    assert t.isnan().all()
    assert inflight._still_poisoned(t)
    for write in (lambda x: x.div_(2), lambda x: x.add_(0), lambda x: x.mul_(1),
                  lambda x: x.fill_(float("nan"))):  # fmt: skip
        u = t.clone()
        assert inflight._still_poisoned(u)  # a copy keeps the bits
        write(u[3:5])
        assert u.isnan().all() and not inflight._still_poisoned(u)


def test_integer_poison_is_the_smallest_value_and_division_shows():
    t = torch.ones(4, dtype=torch.int32)
    inflight.poison(t)
    assert (t == torch.iinfo(torch.int32).min).all() and inflight._still_poisoned(t)
    t[1:2] //= 2
    assert not inflight._still_poisoned(t)


def _chunks_of_one_buffer(private):
    """Two all-to-alls on disjoint halves of one buffer in flight at once, and a write to
    a third buffer's other half while an AllReduce on its first half is in flight."""
    with ok.debug_races(private):
        x = torch.arange(16.0) + 100 * ok.rank()
        out = torch.empty(16)
        handles = [
            ok.all_to_all(
                out[c * 8 : c * 8 + 8], x[c * 8 : c * 8 + 8], [4, 4], [4, 4], async_op=True
            )  # fmt: skip
            for c in range(2)
        ]
        buf = torch.ones(16)
        reduce = ok.ring_all_reduce(buf[:8], async_op=True)
        buf[8:] += 1  # the next bucket's gradients arrive beside the one in flight
        for h in handles:
            h.wait()
        reduce.wait()
        return out.tolist(), buf.tolist()


@pytest.mark.parametrize("private", [True, False], ids=["debug_races", "plain"])
def test_disjoint_slices_of_one_buffer_may_be_in_flight_together(private):
    results = ok.launch(_chunks_of_one_buffer, private, world_size=2)
    for rank, (out, buf) in enumerate(results):
        # chunk c of rank r's output: 4 elements from each rank's chunk c, from slot r
        expected = [
            float(100 * src + 8 * c + 4 * rank + i)
            for c in range(2)
            for src in range(2)
            for i in range(4)
        ]
        assert out == expected, (rank, out)
        assert buf == [2.0] * 16, (rank, buf)


def _overlapping_then_reads():
    with ok.debug_races():
        buf = torch.ones(16)
        first = ok.ring_all_reduce(buf[:10], async_op=True)
        try:
            ok.ring_all_reduce(buf[8:], async_op=True)
            refused = None
        except ok.RaceError as race:
            refused = str(race)
        first.wait()
        x = torch.full((4,), float(ok.rank() + 1))
        a, b = torch.empty(4), torch.empty(4)
        sends = [ok.all_to_all(a, x, [2, 2], [2, 2], async_op=True),
                 ok.all_to_all(b, x, [2, 2], [2, 2], async_op=True)]  # fmt: skip
        for h in sends:
            h.wait()
        return refused, a.tolist(), b.tolist()


def test_overlapping_views_one_writing_are_refused_and_two_reads_are_not():
    for refused, a, b in ok.launch(_overlapping_then_reads, world_size=2):
        assert refused is not None and "shape 8" in refused
        assert "is already in flight in an earlier operation that was not waited yet" in refused
        assert a == b == [1.0, 1.0, 2.0, 2.0]


def _write_before_wait(where):
    with ok.debug_races():
        buf = torch.ones(16)
        grad = buf[:8] if where == "slice" else buf
        h = ok.ring_all_reduce(grad, async_op=True)
        grad /= 2  # NaN / 2 is NaN: only its bits tell the write
        try:
            h.wait()
        except ok.RaceError as race:
            return str(race)
        return None


@pytest.mark.parametrize("where", ["slice", "whole"])
def test_dividing_a_tensor_in_flight_is_a_race_every_time_whether_slice_or_buffer(where):
    for message in ok.launch(_write_before_wait, where, world_size=2):
        assert message is not None and "was changed while ring_all_reduce" in message


def _zero_while_running(delay_s: float):
    """The write race without the debug guard: the gradient zeroed ``delay_s`` after its
    AllReduce was issued, when the communication worker has begun it."""
    import time

    grad = torch.ones(1 << 20)
    handle = ok.ring_all_reduce(grad, async_op=True)
    time.sleep(delay_s)
    grad.zero_()
    try:
        handle.wait()
    except ok.RaceError as race:
        return str(race)
    return None


@pytest.mark.parametrize("delay_s", [0.0, 0.01])
def test_a_write_is_caught_whether_it_lands_before_the_op_began_or_while_it_runs(delay_s):
    # 4 MiB over this link takes about 20 ms: 10 ms after the issue the ring is running,
    # and its own writes (through aliases) must not hide the caller's
    results = ok.launch(_zero_while_running, delay_s, world_size=2, link=ok.Link(100, 0.25))
    for message in results:
        assert message is not None and "was changed while ring_all_reduce" in message
