"""A data-parallel step predicted: gradients in buckets, each bucket's AllReduce overlapped
with the rest of backward, and the bucket size with the shortest step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .collectives import ring_all_reduce

#: bucket sizes (MiB) the bench and the labs sweep
BUCKET_SWEEP_MB = (0.1, 0.25, 0.5, 1, 2, 4, 8, 25, 100)


def ddp_buckets(sizes: Sequence[int], bucket_mb: float | None) -> list[list[int]]:
    """Group gradients (bytes, in the order they become ready) into buckets as the
    wrappers do: consecutive, at most ``bucket_mb`` MiB, one per gradient too big.
    ``bucket_mb=None``: one bucket; ``0``: one per gradient (OverlapDDP)."""
    limit = math.inf if bucket_mb is None else bucket_mb * 2**20
    buckets: list[list[int]] = []
    size = 0.0
    for i, nbytes in enumerate(sizes):
        if buckets and size + nbytes <= limit:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size = nbytes
    return buckets


@dataclass(frozen=True)
class HostCost:
    """What one AllReduce costs the host beyond the link's α and β, measured once.

    ``per_op``: wall seconds per operation on an idle rank (issuing, bookkeeping, the
    kit's ring in Python: a fraction of a millisecond); ``per_op_busy``: the same while
    the rank computes (its threads then wait for a core; default ``per_op``);
    ``cpu_per_op`` and ``cpu_per_byte``: the rank's CPU time an operation takes
    (copies, sums, Python). Where each rank has about one core, that CPU time is taken
    from an overlapped backward; on a GPU (NCCL kernels, copy engines) it is ~0.
    """

    per_op: float = 0.0
    per_op_busy: float | None = None
    cpu_per_op: float = 0.0
    cpu_per_byte: float = 0.0

    def cpu(self, nbytes: float) -> float:
        return self.cpu_per_op + self.cpu_per_byte * nbytes


def _schedule(ready, sizes, groups, backward, N, alpha, beta, host: HostCost, naive: bool):
    """(start, end, bytes) per bucket on a link that carries one AllReduce at a time."""
    busy = host.per_op if host.per_op_busy is None else host.per_op_busy
    spans, end = [], 0.0
    for idx in groups:
        nbytes = sum(sizes[i] for i in idx)
        ready_at = backward if naive else max(ready[i][0] for i in idx)
        start = max(ready_at, end)
        overhead = busy if start < backward else host.per_op
        end = start + overhead + ring_all_reduce(nbytes, N, alpha, beta)
        spans.append((start, end, nbytes))
    return spans


def ddp_step(
    ready: Sequence[tuple[float, int]],
    forward: float,
    backward: float,
    N: int,
    alpha: float,
    beta: float,
    strategy: str = "bucketed",
    bucket_mb: float | None = 25,
    per_op: float = 0.0,
    host: HostCost | None = None,
) -> dict:
    """Predict one data-parallel step from when each gradient is ready during backward.

    ``ready``: (seconds after backward starts, bytes) per gradient in the order the
    buckets are filled (``ok.profile_backward`` measures it); ``per_op``: the
    software cost of one AllReduce beyond the α-β model; ``host`` (a
    :class:`HostCost`) instead, for a host whose CPU the communication shares.
    The AllReduces share one link and run one after another::

        backward |██████████████████|
        bucket 0      ready ─► |▒▒▒▒|
        bucket 1                ready ─► |▒▒▒▒▒|
        bucket 2 (last)                   ready ─►|▒▒▒▒▒▒|   ← the exposed tail

    bucket k starts at max(ready_k, end_{k−1}) and takes per_op + ring_all_reduce(S_k);
    naive starts every AllReduce after backward. With ``host``, the CPU time of the
    AllReduces that start during backward stretches it (one core per rank).
    step = forward + max(backward, end of the last AllReduce). Returns step, comm
    (sum of AllReduce times), exposed (comm not under backward), hidden_fraction, the
    buckets' (start, end, bytes), and the (stretched) backward.
    """
    if strategy not in ("naive", "overlap", "bucketed"):
        raise ValueError(f"strategy must be 'naive', 'overlap' or 'bucketed', got {strategy!r}")
    host = host or HostCost(per_op=per_op)
    sizes = [nbytes for _, nbytes in ready]
    groups = ddp_buckets(sizes, 0 if strategy != "bucketed" else bucket_mb)
    naive = strategy == "naive"
    spans = _schedule(ready, sizes, groups, backward, N, alpha, beta, host, naive)
    if not naive and backward > 0:
        # the AllReduces that start while backward runs take their CPU time from it
        stretch = sum(host.cpu(b) for s, _, b in spans if s < backward)
        if stretch:
            factor = (backward + stretch) / backward
            ready = [(t * factor, nbytes) for t, nbytes in ready]
            backward += stretch
            spans = _schedule(ready, sizes, groups, backward, N, alpha, beta, host, naive)
    comm = sum(e - s for s, e, _ in spans)
    finish = max(backward, spans[-1][1]) if spans else backward
    return {
        "step": forward + finish,
        "comm": comm,
        "exposed": finish - backward,
        "hidden_fraction": 1 - (finish - backward) / comm if comm else 1.0,
        "buckets": len(groups),
        "spans": spans,
        "forward": forward,
        "backward": backward,
    }


def best_bucket_mb(ready, forward, backward, N, alpha, beta, per_op=0.0, host=None,
                   candidates: Sequence[float] = BUCKET_SWEEP_MB) -> float:  # fmt: skip
    """The bucket size (among ``candidates``) with the shortest predicted step: big
    enough that per-message costs stop mattering, small enough that the first bucket
    starts early and the exposed last one is short."""

    def step(mb):
        return ddp_step(ready, forward, backward, N, alpha, beta, "bucketed", mb, per_op,
                        host)["step"]  # fmt: skip

    # sizes that make the same buckets predict the same step: name the largest of them
    return min(reversed(list(candidates)), key=step)
