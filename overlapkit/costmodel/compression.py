"""Compressed gradient averaging on an α-β link: the bytes and time of each compressor
(half precision, top-k, PowerSGD) and the link speed below which it beats the plain ring."""

from __future__ import annotations

import math

from .collectives import ring_all_gather, ring_all_reduce


def top_k_count(numel: int, fraction: float) -> int:
    """How many entries top-k sends of ``numel``: the ``fraction`` rounded, at least one."""
    return max(1, min(numel, round(fraction * numel)))


def powersgd_split(shapes, rank: int, min_rate: float = 2.0) -> tuple[list[int], list[int]]:
    """Which gradients PowerSGD sends low-rank (their positions in ``shapes``) and which
    whole: an n×m matrix (a gradient of 2+ dimensions, its trailing ones flattened) goes
    low-rank when (n + m)·r·``min_rate`` < n·m, r = min(n, m, ``rank``), as PyTorch's
    ``powerSGD_hook`` decides; 1-D gradients always go whole."""
    low, whole = [], []
    for i, shape in enumerate(shapes):
        shape = tuple(shape)
        if len(shape) >= 2:
            n, m = shape[0], math.prod(shape[1:])
            if (n + m) * min(n, m, rank) * min_rate < n * m:
                low.append(i)
                continue
        whole.append(i)
    return low, whole


def compressed_all_reduce(kind: str, shapes, N: int, alpha: float, beta: float,
                          compute: float = 0.0, fraction: float = 0.01, rank: int = 1,
                          min_rate: float = 2.0, itemsize: int = 4) -> dict:  # fmt: skip
    """Averaging one bucket of float gradients (``shapes``) over N ranks with ``kind``
    (``ok.compression``): the bytes a rank sends and the time on an α-β link, plus
    ``compute`` (compressing and decompressing, as measured: ``stats["compute_s"]``)::

        none      ring AllReduce of S                      2(N−1)/N·S bytes
        half      ring AllReduce of S/2                    2(N−1)/N·S/2
        topk      AllGathers of k values and k int64s      (N−1)·k·(4 + 8)
        powersgd  AllReduces of the whole ones, P, Q       2(N−1)/N·(whole + Σ(n+m)·r)·4
    """
    sizes = [math.prod(tuple(s)) for s in shapes]
    numel = sum(sizes)
    if kind == "none":
        ops = [("all_reduce", numel * itemsize)]
    elif kind == "half":
        ops = [("all_reduce", numel * 2)]
    elif kind == "topk":
        k = top_k_count(numel, fraction)
        ops = [("all_gather", N * k * itemsize), ("all_gather", N * k * 8)]
    elif kind == "powersgd":
        low, whole = powersgd_split(shapes, rank, min_rate)
        p = q = 0  # P is n×r, Q is m×r for each low-rank matrix
        for i in low:
            n, m = tuple(shapes[i])[0], sizes[i] // tuple(shapes[i])[0]
            p, q = p + n * min(n, m, rank), q + m * min(n, m, rank)
        ops = [("all_reduce", sum(sizes[i] for i in whole) * itemsize)] if whole else []
        ops += [("all_reduce", p * itemsize), ("all_reduce", q * itemsize)] if low else []
    else:
        raise ValueError(f"kind must be none, half, topk or powersgd; got {kind!r}")
    time, sent = compute, 0.0
    for op, nbytes in ops:  # a ring AllReduce sends 2(N−1)/N of its S, an AllGather (N−1)/N
        if op == "all_reduce":
            time += ring_all_reduce(nbytes, N, alpha, beta)
            sent += 2 * (N - 1) / N * nbytes
        else:
            time += ring_all_gather(nbytes, N, alpha, beta)
            sent += (N - 1) / N * nbytes
    return {"bytes": sent, "time": time, "messages": len(ops)}


def compression_pays_below(kind: str, shapes, N: int, alpha: float, compute: float = 0.0,
                           **settings) -> float:  # fmt: skip
    """The link bandwidth (GB/s) below which averaging ``shapes`` with ``kind`` beats the
    plain ring AllReduce. Both times are a + B·β (a: the latencies and the compute, B: the
    bytes a rank sends), so they cross at β* = (a_kind − a_none) / (B_none − B_kind):
    ``inf`` where compression wins at any speed, 0 where it never does (no fewer bytes)."""
    plain = compressed_all_reduce("none", shapes, N, alpha, 0.0, **settings)
    small = compressed_all_reduce(kind, shapes, N, alpha, 0.0, compute, **settings)
    saved = plain["bytes"] - small["bytes"]
    if saved <= 0:
        return 0.0
    extra = small["time"] - plain["time"]
    return math.inf if extra <= 0 else saved / extra / 1e9
