"""ok.Link: the emulated network of the kit's point-to-point layer.

These check the model's guarantees (lower bounds, contention, no CPU burn), not
speed: each margin is several times the noise of a shared machine.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import overlapkit as ok
from overlapkit import p2p

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

MB = 2**20


def test_link_converts_units_and_rejects_nonsense():
    link = ok.Link(latency_us=50, bandwidth_gbps=2)
    assert link.alpha == pytest.approx(50e-6) and link.beta == pytest.approx(0.5e-9)
    assert link.message_time(4_000_000) == pytest.approx(50e-6 + 2e-3)
    assert str(link) == "Link(50 µs, 2 GB/s)"
    with pytest.raises(ValueError, match="bandwidth_gbps must be > 0"):
        ok.Link(1, 0)
    with pytest.raises(ValueError, match="latency_us must be >= 0"):
        ok.Link(-1, 1)


def _one_message(nbytes):
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    dist.barrier()
    start = time.perf_counter()
    if ok.rank() == 0:
        buf.fill_(7)
        p2p.send(buf, 1)
    else:
        p2p.recv(buf, 0)
    return start, time.perf_counter(), int(buf[-1])


def test_a_message_takes_at_least_latency_plus_size_over_bandwidth():
    link = ok.Link(latency_us=2000, bandwidth_gbps=0.1)  # 2 ms + 8 MB / 0.1 GB/s = 83.9 ms
    nbytes = 8 * MB
    (s0, e0, _), (s1, e1, byte) = ok.launch(_one_message, nbytes, world_size=2, link=link)
    assert byte == 7  # the real bytes arrived
    assert e1 - s0 >= link.message_time(nbytes) * 0.999
    assert e0 - s0 >= nbytes * link.beta * 0.999  # the sender is busy while its link is


def _into_root(nbytes):
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    dist.barrier()
    start = time.perf_counter()
    if ok.rank() == 0:
        bufs = [torch.empty_like(buf) for _ in range(ok.world_size() - 1)]
        p2p.wait_all([p2p.irecv(b, src) for src, b in enumerate(bufs, start=1)])
    else:
        p2p.send(buf, 0)
    return time.perf_counter() - start


def test_messages_into_one_rank_share_its_incoming_link():
    link = ok.Link(latency_us=0, bandwidth_gbps=0.2)
    nbytes = 4 * MB  # 21 ms each
    root_time = ok.launch(_into_root, nbytes, world_size=4, link=link)[0]
    assert root_time >= 3 * nbytes * link.beta * 0.999


def _ring_step(nbytes):
    me, world = ok.rank(), ok.world_size()
    out, into = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dist.barrier()
    start = time.perf_counter()
    p2p.wait_all([p2p.isend(out, (me + 1) % world), p2p.irecv(into, (me - 1) % world)])
    return time.perf_counter() - start


def test_a_ring_step_is_not_contended():
    link = ok.Link(latency_us=0, bandwidth_gbps=0.2)
    nbytes = 4 * MB  # one message: 21 ms; contended, it would be 3x that at a root
    for step in ok.launch(_ring_step, nbytes, world_size=4, link=link):
        assert nbytes * link.beta * 0.999 <= step < 2 * nbytes * link.beta


def _cpu_while_waiting(nbytes):
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    if ok.rank() == 0:
        p2p.send(buf, 1)
    else:
        p2p.recv(buf, 0)
    return time.perf_counter() - wall, time.process_time() - cpu


def test_waiting_for_the_link_burns_no_cpu():
    link = ok.Link(latency_us=200_000, bandwidth_gbps=10)  # 0.2 s of pure latency
    # the sender is done once its last byte left; the receiver waits out the latency
    _, (wall, cpu) = ok.launch(_cpu_while_waiting, 1024, world_size=2, link=link)
    assert wall >= link.alpha * 0.999
    assert cpu < 0.25 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s of waiting"


def _overlap(nbytes, compute_s):
    me = ok.rank()
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    dist.barrier()
    start = time.perf_counter()
    handle = p2p.isend(buf, 1) if me == 0 else p2p.irecv(buf, 0)
    end = time.perf_counter() + compute_s
    while time.perf_counter() < end:  # "compute": a busy loop that needs the CPU
        pass
    handle.wait()
    return time.perf_counter() - start


def test_computation_runs_while_a_message_is_on_the_emulated_wire():
    link = ok.Link(latency_us=150_000, bandwidth_gbps=10)  # 0.15 s on the wire
    compute = 0.15
    for wall in ok.launch(_overlap, 1024, compute, world_size=2, link=link):
        assert wall < 0.8 * (compute + link.alpha), f"no overlap: {wall:.3f} s"


def _collectives_under_link():
    me = ok.rank()
    t = torch.arange(1001, dtype=torch.float32) * (me + 1)
    ok.ring_all_reduce(t)
    n = torch.full((5,), float(me))
    ok.naive_all_reduce(n, op="max")
    return t[:3].tolist(), n.tolist()


def test_collectives_stay_correct_over_an_emulated_link():
    world = 3
    for ring, naive in ok.launch(_collectives_under_link, world_size=world, link=ok.Link(20, 1)):
        assert ring == [0.0, 6.0, 12.0] and naive == [2.0] * 5


def test_no_link_means_plain_torch_distributed_handles():
    def kind():
        p2p.set_link(None)
        h = p2p.isend(torch.ones(1), 1) if ok.rank() == 0 else p2p.irecv(torch.ones(1), 0)
        h.wait()
        return type(h).__module__.startswith("torch")

    assert ok.launch(kind, world_size=2) == [True, True]
