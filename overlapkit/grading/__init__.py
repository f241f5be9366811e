"""Exercise checks: each prints ✔/✘ per case with what differs, never hangs, returns a Report.

Use in a notebook right after an exercise::

    ok.grading.check_ping_pong(ping_pong)
"""

from .collectives import check_all_gather, check_all_reduce, check_reduce_scatter
from .ddp import check_assign_buckets, check_bucketed_ddp, check_hook_ddp
from .lab00 import check_fit_alpha_beta, check_ping_pong
from .lab01 import check_bytes_moved
from .lab04 import check_zero1_step
from .lab05 import check_overlapped_step, check_timed_step
from .lab11 import check_ag_matmul, check_chunked_moe
from .pipeline import check_1f1b_schedule, check_gpipe_step
from .report import Report

__all__ = [
    "Report",
    "check_ping_pong",
    "check_fit_alpha_beta",
    "check_all_reduce",
    "check_reduce_scatter",
    "check_all_gather",
    "check_bytes_moved",
    "check_zero1_step",
    "check_overlapped_step",
    "check_timed_step",
    "check_hook_ddp",
    "check_assign_buckets",
    "check_bucketed_ddp",
    "check_1f1b_schedule",
    "check_gpipe_step",
    "check_ag_matmul",
    "check_chunked_moe",
]
