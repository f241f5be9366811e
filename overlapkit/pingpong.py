"""Ping-pong: the simplest measurement of a link's latency and bandwidth.

::

    rank 0  ──── S bytes ────►  rank 1
    rank 0  ◄─── S bytes ─────  rank 1        one round trip = 2 one-way times

Reference implementation, used by the demo, the benchmarks and the checks. It
sends through the kit's point-to-point layer, so under an ``ok.Link`` it
measures the emulated network.
"""

from __future__ import annotations

import statistics
import time

import torch

from . import p2p, runtime


def ping_pong(nbytes: int, iters: int = 10, warmup: int = 2, peer_ranks=(0, 1)) -> float | None:
    """One-way time (seconds, median over ``iters`` round trips / 2) between two ranks.

    Called on every rank; ranks other than ``peer_ranks`` return None at once.
    The first rank of ``peer_ranks`` returns the time, the second returns it too.
    """
    me = runtime.rank()
    a, b = peer_ranks
    if me not in peer_ranks:
        return None
    peer = b if me == a else a
    device = runtime.device()
    buf = torch.empty(max(nbytes, 0), dtype=torch.uint8, device=device)
    samples = []
    for i in range(warmup + iters):
        runtime.synchronize(device)
        start = time.perf_counter()
        if me == a:
            p2p.send(buf, peer)
            p2p.recv(buf, peer)
        else:
            p2p.recv(buf, peer)
            p2p.send(buf, peer)
        runtime.synchronize(device)
        if i >= warmup:
            samples.append((time.perf_counter() - start) / 2)
    return statistics.median(samples)


def sweep(sizes, iters: int = 10, warmup: int = 2) -> list[float | None]:
    """One-way times for each size in ``sizes`` (call on every rank)."""
    return [ping_pong(int(n), iters=iters, warmup=warmup) for n in sizes]


def default_sizes(smallest: int = 8, largest: int = 32 << 20) -> list[int]:
    """Powers of four from bytes to tens of megabytes."""
    sizes, n = [], smallest
    while n <= largest:
        sizes.append(n)
        n *= 4
    return sizes
