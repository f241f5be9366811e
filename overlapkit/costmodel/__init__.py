"""The α-β cost model: time = α (latency) + β · bytes (β = 1 / bandwidth).

A point-to-point message of S bytes::

    sender   |──α──|───────── S·β ─────────|
    receiver                               ^ arrives

It starts with the model of one message and the fit of α and β from measurements
(:mod:`.alphabeta`); the collectives' formulas build on it (:mod:`.collectives`), and
on those the predicted steps of each way to train in parallel: data parallel with
overlapped buckets (:mod:`.data_parallel`), pipelines and the hybrid of both
(:mod:`.pipeline`), fully sharded (:mod:`.sharding`), a collective decomposed into
chunks under compute, tensor and expert parallel (:mod:`.decomposition`), and
compressed gradients (:mod:`.compression`). Every name is here, ``ok.costmodel.X``.

What the formulas leave out, and where it shows: the software on each end of
a message (for the kit's Python collectives, roughly 0.1–0.15 ms per ring step
and per operation on a 2-core VM; a fitted α absorbs the per-message part),
and the machine's own copies and sums when they, not the link, are the
bottleneck. ``python -m overlapkit bench collectives --link ...`` measures
both per row (``machine_ms``: the same algorithm over a link that costs
nothing), so a gap between model and measurement is named, not guessed.
"""

from .alphabeta import bandwidth_gbps, fit_alpha_beta, message_time
from .collectives import (
    ALGORITHMS,
    BUSBW_FACTOR,
    all_to_all,
    bucketed_all_reduce,
    bytes_moved_per_rank,
    halving_doubling_all_reduce,
    naive_all_reduce,
    project,
    recursive_doubling_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    tree_all_reduce,
)
from .compression import (
    compressed_all_reduce,
    compression_pays_below,
    powersgd_split,
    top_k_count,
)
from .data_parallel import BUCKET_SWEEP_MB, HostCost, best_bucket_mb, ddp_buckets, ddp_step
from .decomposition import CHUNK_SWEEP, collective_matmul, moe_best_chunks, moe_step
from .pipeline import hybrid_step, pipeline_bubble, pipeline_on_cores, pipeline_step
from .sharding import fsdp_step

__all__ = [
    "ALGORITHMS",
    "BUCKET_SWEEP_MB",
    "BUSBW_FACTOR",
    "CHUNK_SWEEP",
    "HostCost",
    "all_to_all",
    "bandwidth_gbps",
    "best_bucket_mb",
    "bucketed_all_reduce",
    "bytes_moved_per_rank",
    "collective_matmul",
    "compressed_all_reduce",
    "compression_pays_below",
    "ddp_buckets",
    "ddp_step",
    "fit_alpha_beta",
    "fsdp_step",
    "halving_doubling_all_reduce",
    "hybrid_step",
    "message_time",
    "moe_best_chunks",
    "moe_step",
    "naive_all_reduce",
    "pipeline_bubble",
    "pipeline_on_cores",
    "pipeline_step",
    "powersgd_split",
    "project",
    "recursive_doubling_all_reduce",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "top_k_count",
    "tree_all_reduce",
]
