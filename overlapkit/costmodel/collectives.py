"""The collectives' costs on an α-β(-γ) link: each algorithm's time as a formula.

S: bytes per rank (the tensor being reduced), N: ranks, α: latency (s), β: seconds per byte
on a link, γ: seconds per byte to reduce (0 by default). Naive, ring, recursive doubling,
halving-doubling, tree and bucketed AllReduce, ring ReduceScatter and AllGather, the
all-to-all; the bytes a rank moves (nccl-tests' bus-bandwidth factors), and each
AllReduce's time projected to many ranks.
"""

from __future__ import annotations

import math


def naive_all_reduce(S: float, N: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Master–worker: N−1 messages into the root share its link, N−1 go back out.

    2α + 2(N−1)·S·β + (N−1)·S·γ — linear in N: the root's link is the bottleneck.
    """
    if N == 1:
        return 0.0
    return 2 * alpha + 2 * (N - 1) * S * beta + (N - 1) * S * gamma


def ring_reduce_scatter(S: float, N: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """(N−1) steps of a chunk S/N: (N−1)·(α + S/N·β + S/N·γ). S: the input per rank."""
    return (N - 1) * (alpha + S / N * (beta + gamma))


def ring_all_gather(S: float, N: int, alpha: float, beta: float) -> float:
    """(N−1) steps of a chunk S/N: (N−1)·(α + S/N·β). S: the gathered output per rank."""
    return (N - 1) * (alpha + S / N * beta)


def ring_all_reduce(S: float, N: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """ReduceScatter + AllGather: 2(N−1)·α + 2(N−1)/N·S·β + (N−1)/N·S·γ.

    The bandwidth term is bounded (below 2·S·β) however large N grows — the
    ring's virtue; the latency term grows with N — its cost.
    """
    return ring_reduce_scatter(S, N, alpha, beta, gamma) + ring_all_gather(S, N, alpha, beta)


def all_to_all(S: float, N: int, alpha: float, beta: float) -> float:
    """Pairwise exchange of S bytes per rank in N equal blocks: N−1 steps, each sending one
    block of S/N and receiving one: (N−1)·(α + S/N·β). The bytes equal an AllGather's; the
    latency grows with N, as the ring's does."""
    return (N - 1) * (alpha + S / N * beta)


def recursive_doubling_all_reduce(
    S: float, N: int, alpha: float, beta: float, gamma: float = 0.0
) -> float:
    """log₂N rounds, each exchanging the whole vector: log₂N·(α + S·β + S·γ). Best for small S."""
    return math.ceil(math.log2(N)) * (alpha + S * (beta + gamma)) if N > 1 else 0.0


def halving_doubling_all_reduce(
    S: float, N: int, alpha: float, beta: float, gamma: float = 0.0
) -> float:
    """Rabenseifner: recursive-halving ReduceScatter + recursive-doubling AllGather.

    2·log₂N·α + 2(N−1)/N·S·β + (N−1)/N·S·γ: the ring's bandwidth with log latency.
    """
    if N == 1:
        return 0.0
    return 2 * math.ceil(math.log2(N)) * alpha + (N - 1) / N * S * (2 * beta + gamma)


def tree_all_reduce(
    S: float, N: int, alpha: float, beta: float, gamma: float = 0.0, chunks: int | None = None
) -> float:
    """Reduce up a binary tree, broadcast down it, the vector cut into ``chunks`` pipelined pieces.

    Depth d = ⌈log₂N⌉; each direction takes (d + k − 1) steps of a piece S/k:
    2·(d + k − 1)·(α + S/k·β) + (d + k − 1)·S/k·γ. ``chunks=None`` uses the
    best k, √((d − 1)·S·β / α) rounded, as a tuned library would; ``chunks=1``
    is the unpipelined tree.
    """
    if N == 1:
        return 0.0
    depth = math.ceil(math.log2(N))
    if chunks is None:
        best = math.sqrt((depth - 1) * S * beta / alpha) if alpha > 0 else float(depth)
        candidates = {max(1, math.floor(best)), max(1, math.ceil(best))}
        return min(tree_all_reduce(S, N, alpha, beta, gamma, k) for k in candidates)
    k = max(1, chunks)
    steps = depth + k - 1
    return 2 * steps * (alpha + S / k * beta) + steps * S / k * gamma


def bucketed_all_reduce(
    S: float, N: int, n_buckets: int, alpha: float, beta: float, gamma: float = 0.0
) -> float:
    """n ring AllReduces of S/n bytes each: n·2(N−1)·α + 2(N−1)/N·S·β (+ γ term)."""
    return n_buckets * ring_all_reduce(S / n_buckets, N, alpha, beta, gamma)


#: nccl-tests' bus-bandwidth factors: busbw = algbw × factor
BUSBW_FACTOR = {
    "all_reduce": lambda N: 2 * (N - 1) / N,
    "reduce_scatter": lambda N: (N - 1) / N,
    "all_gather": lambda N: (N - 1) / N,
}


def bytes_moved_per_rank(collective: str, S: float, N: int) -> float:
    """Bytes each rank sends (= receives) in the ring algorithm for a tensor of S bytes.

    AllReduce 2(N−1)/N·S — bounded, not O(1) and not zero; ReduceScatter and
    AllGather (N−1)/N·S each, where S is the full (unsharded) size.
    """
    return BUSBW_FACTOR[collective](N) * S


ALGORITHMS = {
    "naive": naive_all_reduce,
    "ring": ring_all_reduce,
    "recursive_doubling": recursive_doubling_all_reduce,
    "halving_doubling": halving_doubling_all_reduce,
    "tree": tree_all_reduce,
}


def project(
    S: float, ranks, alpha: float, beta: float, algorithms=("naive", "ring", "tree")
) -> list[dict]:
    """AllReduce time of each algorithm for each world size in ``ranks`` (e.g. up to 1024)."""
    return [
        {"ranks": N, **{a: ALGORITHMS[a](S, N, alpha, beta) for a in algorithms}} for N in ranks
    ]
