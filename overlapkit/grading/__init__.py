"""Exercise checks: each prints ✔/✘ per case with what differs, never hangs, returns a Report.

Use in a notebook right after an exercise::

    ok.grading.check_ping_pong(ping_pong)
"""

from .. import launcher
from .exercises import POINTS, WITNESSED
from .lab00_ping_pong import check_fit_alpha_beta, check_ping_pong
from .lab01_patterns import check_bytes_moved
from .lab03_collectives import check_all_gather, check_all_reduce, check_reduce_scatter
from .lab04_zero1 import check_memory_per_rank, check_zero1_step
from .lab05_async import check_overlapped_step, check_timed_step
from .lab05_streams import check_overlapped_backward
from .lab06_ddp import check_hook_ddp
from .lab07_buckets import check_assign_buckets, check_bucketed_ddp
from .lab08_pipeline import check_1f1b_schedule, check_gpipe_step
from .lab09_local_sgd import check_average_parameters
from .lab10 import check_tuning
from .lab10_predict import check_predict_step
from .lab11_ag_matmul import check_ag_matmul
from .lab11_moe import check_chunked_moe
from .lab11_plan import check_moe_plan
from .lab12 import check_fsdp_plan
from .lab13_compression import check_topk_with_feedback
from .lab14 import check_hybrid_plan, check_mesh_groups
from .lab15_schedule import check_latency_hiding_order
from .report import Report

# every rank forked from now on has what the checks' watch works out at import
launcher.preload("overlapkit.grading.preload")

__all__ = [
    "POINTS",
    "WITNESSED",
    "Report",
    "check_ping_pong",
    "check_fit_alpha_beta",
    "check_all_reduce",
    "check_reduce_scatter",
    "check_all_gather",
    "check_bytes_moved",
    "check_zero1_step",
    "check_memory_per_rank",
    "check_overlapped_step",
    "check_timed_step",
    "check_overlapped_backward",
    "check_hook_ddp",
    "check_assign_buckets",
    "check_bucketed_ddp",
    "check_1f1b_schedule",
    "check_gpipe_step",
    "check_average_parameters",
    "check_predict_step",
    "check_tuning",
    "check_ag_matmul",
    "check_chunked_moe",
    "check_moe_plan",
    "check_fsdp_plan",
    "check_topk_with_feedback",
    "check_mesh_groups",
    "check_hybrid_plan",
    "check_latency_hiding_order",
]
