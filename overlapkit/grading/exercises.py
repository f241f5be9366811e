"""The exercises the checks judge, each declared once: its check, lab, points, the kit's
answers it forbids, whether its ranks build an optimizer, and who witnesses its measures.

Everything else reads these declarations: the grader its points (:data:`POINTS`), which
judges skip torch's warm-up (:data:`LIGHT`) and which modules' ``MEASURES`` its witness
takes (:data:`WITNESSED`); a check the answers it watches for (:func:`answers_of`, handed
to the sandbox's watch by name: the sandbox knows nothing of the checks).

An answer is a dotted name under ``overlapkit`` (see ``overlapkit.sandbox.answers``): a
module (every function and class defined in it), a class (its methods, properties, static
and class methods), or a function; "!name" leaves one out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    """One exercise, as its check judges it."""

    check: str  # the check's function name in ok.grading (the exercise's key everywhere)
    lab: int
    points: int  # what ``python -m overlapkit.grade`` awards it, times the share passed
    forbids: tuple[str, ...] = ()  # the kit's code that answers it: must not run meanwhile
    #: its check's ranks run no torch optimizer: the judge's forkserver skips torch's
    #: warm-up (overlapkit.warmup: 2.5 s of a core per judge; a learner's function that
    #: does build one pays it on its rank)
    light: bool = False
    #: the module whose ``MEASURES`` the grader's witness takes what the notebook measured
    #: with (``overlapkit.sandbox.witness``), for a check that asks what it measured
    witnessed: str | None = None


_DDP = ("ddp._DataParallel", "ddp.NaiveDDP", "ddp.OverlapDDP", "ddp.BucketedDDP",
        "ddp.ddp_comm_hook")  # fmt: skip

#: in the order the labs teach them
EXERCISES: tuple[Exercise, ...] = (
    Exercise("check_ping_pong", 0, 2, ("pingpong",), light=True),
    Exercise("check_fit_alpha_beta", 0, 2, ("costmodel.fit_alpha_beta",), light=True),
    # the whole cost model: its time models with α = 0, β = 1 are byte counts (the ring's,
    # halving-doubling's…), and its bus-bandwidth factors (BUSBW_FACTOR) are the answer
    Exercise("check_bytes_moved", 1, 2, ("costmodel",), light=True),
    # labs 01-03's collectives forbid an answer set by how they are built (ANSWER_SETS)
    Exercise("check_all_reduce", 3, 4, light=True),
    Exercise("check_reduce_scatter", 3, 3),
    Exercise("check_all_gather", 3, 3),
    Exercise("check_zero1_step", 4, 4, ("sharded.ShardedOptimizer",)),
    Exercise("check_memory_per_rank", 4, 2,
             ("grading.lab04_zero1.memory_reference", "sharded.ShardedOptimizer"), light=True),
    Exercise("check_overlapped_step", 5, 3, (*_DDP, "training.train")),
    Exercise("check_timed_step", 5, 2),  # timed: a watch slows each Python call
    Exercise("check_overlapped_backward", 5, 2, light=True),  # a simulated GPU's streams
    Exercise("check_hook_ddp", 6, 5, _DDP),
    Exercise("check_assign_buckets", 7, 3, ("costmodel.ddp_buckets",), light=True),
    Exercise("check_bucketed_ddp", 7, 5, (*_DDP, "costmodel.ddp_buckets")),
    Exercise("check_1f1b_schedule", 8, 3, ("pipeline.make_schedule",), light=True),
    Exercise("check_gpipe_step", 8, 5, ("pipeline",)),
    Exercise("check_average_parameters", 9, 3,
             ("training._average_parameters", "training._averaged", "training.train")),
    # the kit's step model (a schedule of buckets on one link) and the check's own
    Exercise("check_predict_step", 10, 2,
             ("costmodel.ddp_step", "costmodel.data_parallel._schedule",
              "grading.lab10_predict"), light=True),
    Exercise("check_tuning", 10, 4, witnessed="overlapkit.grading.lab10"),
    Exercise("check_ag_matmul", 11, 4, ("tensor_parallel",)),
    Exercise("check_moe_plan", 11, 2, ("moe.MoELayer", "moe.reference_moe")),
    Exercise("check_chunked_moe", 11, 3, ("moe.MoELayer", "moe.reference_moe")),
    # the cost model's simulated step lists each unit's gathers and compute in order, and
    # the wrapper's hooks take the same steps (a logged step of it is a plan)
    Exercise("check_fsdp_plan", 12, 5,
             ("costmodel.fsdp_step", "grading.lab12", "fsdp", "fsdp_plan", "fsdp_units")),
    # the kit's compressors (TopK is the answer) and the check's own references (not its
    # runner, which calls the learner's function)
    Exercise("check_topk_with_feedback", 13, 5,
             ("compression", "grading.lab13_compression", "!grading.lab13_compression._run",
              "!grading.lab13_compression._gradients", "!grading.lab13_compression._describe",
              "!grading.lab13_compression._same_storage"), light=True),
    # lab 14: the kit's mesh and plans, and the check's own expected values
    Exercise("check_mesh_groups", 14, 2, ("hybrid.make_mesh", "grading.lab14.expected_groups"),
             light=True),
    Exercise("check_hybrid_plan", 14, 5,
             ("hybrid.plan_for", "hybrid.HybridStage", "grading.lab14.judge_plan")),
    # lab 15: the kit's list scheduler (its simulation is the lab's tool, not the answer)
    Exercise("check_latency_hiding_order", 15, 4, ("scheduling.latency_hiding_order",),
             light=True),
)  # fmt: skip

#: answers a check forbids by how it is asked to judge, not by which exercise it is
ANSWER_SETS: dict[str, tuple[str, ...]] = {
    # every collective a from-scratch exercise (labs 02, 03) must build itself. The whole
    # module: its private helpers (_naive, _ring_reduce_scatter_flat, …) hold the
    # algorithms; chunk_bounds is the lab's own advice. And every ring of the kit's built of
    # messages: lab 11's decomposed matmuls with a 1×1 weight of ones are a ring AllGather
    # and ReduceScatter. With them the issue order they run through (ordering: numbering,
    # announcements, the communication worker), which no ring built of messages needs; its
    # counts (issued, worker_code) are read by the checks themselves and move no data
    "from_scratch": ("collectives", "!collectives.chunk_bounds", "ordering",
                     "!ordering.Issued", "!ordering.issued", "!ordering.worker_code",
                     "moe.AllToAll",
                     "training.builtin_all_reduce", "tensor_parallel"),
    # lab 01: an AllReduce built from a ReduceScatter and an AllGather (the kit's allowed),
    # never by the kit's whole AllReduce under another name (ok.ddp.ring_all_reduce)
    "made_of": ("collectives.ring_all_reduce", "collectives.naive_all_reduce",
                "collectives._naive", "collectives.bucketed_all_reduce",
                "training.builtin_all_reduce"),
}  # fmt: skip

BY_CHECK: dict[str, Exercise] = {ex.check: ex for ex in EXERCISES}

#: points per exercise (the check's name), the one place ``python -m overlapkit.grade``
#: reads them from; an exercise earns them times the share of its check's cases passed
POINTS: dict[str, int] = {ex.check: ex.points for ex in EXERCISES}

#: the checks whose ranks run no torch optimizer (see :attr:`Exercise.light`)
LIGHT: frozenset[str] = frozenset(ex.check for ex in EXERCISES if ex.light)

#: the checks that ask what the notebook measured, and the module whose ``MEASURES`` the
#: grader's witness takes those measurements with (``overlapkit.sandbox.witness``)
WITNESSED: dict[str, str] = {ex.check: ex.witnessed for ex in EXERCISES if ex.witnessed}

#: per check (and per answer set): the kit's code that answers it
ANSWERS: dict[str, tuple[str, ...]] = {
    **{ex.check: ex.forbids for ex in EXERCISES if ex.forbids},
    **ANSWER_SETS,
}


def answers_of(name: str) -> tuple[str, ...]:
    """The answers a check forbids (by its function's name: none for some), or an answer
    set's."""
    return BY_CHECK[name].forbids if name in BY_CHECK else ANSWER_SETS[name]
