"""The kit's own answers, recognised by their code running, whatever name reached them.

Most exercises have a twin in the kit: lab 03's ring is ``ok.ring_all_reduce``, lab 06's
``HookDDP`` is ``ok.OverlapDDP``, lab 00's fit is ``ok.costmodel.fit_alpha_beta`` (and the
checks' own references are answers too). A check that replaced the answer on one module
would miss every other way to it::

    ok.ddp.ring_all_reduce(t)            # another module imported it by name
    class HookDDP(ok.OverlapDDP): pass   # a subclass runs the same methods
    f.__wrapped__, def f(x, g=ok.…): …   # a wrapper's original, a keyword default

All of them run the same *code objects*. So a check watches those (the answer's functions,
its classes' methods, and the functions nested in them) while the learner's function
runs, and fails it when one starts: in the calling thread, in threads started meanwhile
(``_thread``'s too), and in the kit's communication workers (an async op runs its task
under the caller's watch, see ``ordering.worker_code``). A copy compiled anew from the
kit's source is recognised by what its code does (:func:`_key`); a copy edited a little
(unused lines added, names changed, a code object renamed) by how much
of the answer's instructions it holds, in order (:func:`_copy_of`). That takes an answer
long enough that honest work never reads like it (:data:`COPY_MIN_TOKENS`): the short
ones (lab 07's greedy bucket loop, a byte count, a memory formula, lab 09's average) are
written the same way by everyone, our own solutions included, and a copy of those is
not told from the work.

Each check's answers are listed once, in :data:`ANSWERS`, by dotted name under
``overlapkit``: a module (every function and class defined in it), a class (its methods,
properties, static and class methods), or a function; "!name" leaves one out.

The watch also notes two things an exercise never needs: the learner's code changing the
profiler (``sys.setprofile``, ``threading.setprofile``), and calling an operation of a
torch process group itself (``group.allreduce``, also on a group made outside torch's
registry, which no sequence number counts).

On a check's rank the verdict is not the rank's to give. The watch sends what it sees out
of the process the moment it sees it, on the rank's channel to the caller
(``overlapkit.rankhook.channel``)::

    rank: learner's call ──► watch (profile fn) ──► pipe ──► check: which answers ran?
           an answer by identity: its name      ─┘           judged here, from the pipe:
           a code object that may be a copy: its marshal ─┘   key match, edited copy

so what the rank's code does afterwards to its own report (the lists it returns, the
builtins that build them) takes nothing back. The watch's state is out of that code's
reach, and a watch that was cut off ends the process (:func:`_watch`).

A profile function only sees the threads it was given; so, meanwhile, the answers are
also *disarmed*: each of their functions gets code that refuses to run (it notes the
answer and raises :class:`AnswerRan`) until the learner's call is over. That reaches every
thread of the process (one the watch never saw: ``_thread.start_new_thread``, a pool
started before the check) and every process forked from it, whatever turned the watch off.
Honest work never runs an answer while it is watched (the watch would fail it), so the
refusal takes nothing from it.

Each part has a module of its own: :mod:`.codes` (an answer's name to its code objects),
:mod:`.copies` (a copy told from the work), :mod:`.origins` (whose code a frame runs),
:mod:`.disarm` (the answers refusing to run), :mod:`.watch` (the watch itself),
:mod:`.sightings` (what a rank's watch sends out, and how the check reads it) and
:mod:`.told` (what a learner is told). This module lists each check's answers and keeps
every name the checks and tests use from here.
"""

from __future__ import annotations

# the names the checks, the guard and the tests use from here (each keeps its one home)
from .codes import code_objects  # noqa: F401
from .copies import COPY_MIN_TOKENS, _copy_of, _token_count, _tokens, _tokens_of  # noqa: F401
from .disarm import _disarmed, refused  # noqa: F401
from .origins import _trusted, library  # noqa: F401
from .sightings import code_made_meanwhile, seen_by_watches  # noqa: F401
from .told import CUT, CUT_OFF, GROUP, RECORD, TAMPERED, AnswerRan, cut_off, said  # noqa: F401
from .watch import _raw_threads_watched, between_blocks, hide, running  # noqa: F401

#: per check: the kit's code that answers its exercise. A module stands for all it defines.
#: "from_scratch" is every collective a from-scratch exercise (labs 02, 03) must build itself.
ANSWERS: dict[str, tuple[str, ...]] = {
    "check_ping_pong": ("pingpong",),
    "check_fit_alpha_beta": ("costmodel.fit_alpha_beta",),
    # the whole cost model: its time models with α = 0, β = 1 are byte counts (the ring's,
    # halving-doubling's…), and its bus-bandwidth factors (BUSBW_FACTOR) are the answer
    "check_bytes_moved": ("costmodel",),
    # the whole module: its private helpers (_naive, _ring_reduce_scatter_flat, …) hold the
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
    "check_zero1_step": ("sharded.ShardedOptimizer",),
    "check_memory_per_rank": ("grading.lab04.memory_reference", "sharded.ShardedOptimizer"),
    "check_overlapped_step": ("ddp._DataParallel", "ddp.NaiveDDP", "ddp.OverlapDDP",
                              "ddp.BucketedDDP", "ddp.ddp_comm_hook", "training.train"),
    "check_hook_ddp": ("ddp._DataParallel", "ddp.NaiveDDP", "ddp.OverlapDDP", "ddp.BucketedDDP",
                       "ddp.ddp_comm_hook"),
    "check_assign_buckets": ("costmodel.ddp_buckets",),
    "check_bucketed_ddp": ("ddp._DataParallel", "ddp.NaiveDDP", "ddp.OverlapDDP",
                           "ddp.BucketedDDP", "ddp.ddp_comm_hook", "costmodel.ddp_buckets"),
    "check_1f1b_schedule": ("pipeline.make_schedule",),
    # the cost model's simulated step lists each unit's gathers and compute in order, and the
    # wrapper's hooks take the same steps (a logged step of it is a plan)
    "check_fsdp_plan": ("costmodel.fsdp_step", "grading.lab12", "fsdp", "fsdp_plan",
                        "fsdp_units"),
    # lab 14: the kit's mesh and plans, and the check's own expected values
    "check_mesh_groups": ("hybrid.make_mesh", "grading.lab14.expected_groups"),
    "check_hybrid_plan": ("hybrid.plan_for", "hybrid.HybridStage", "grading.lab14.judge_plan"),
    "check_gpipe_step": ("pipeline",),
    "check_average_parameters": ("training._average_parameters", "training._averaged",
                                 "training.train"),
    "check_ag_matmul": ("tensor_parallel",),
    "check_chunked_moe": ("moe.MoELayer", "moe.reference_moe"),
    # lab 13: the kit's compressors (TopK is the answer) and the check's own references
    # (not its runner, which calls the learner's function)
    "check_topk_with_feedback": ("compression", "grading.lab13", "!grading.lab13._run",
                                 "!grading.lab13._gradients", "!grading.lab13._describe",
                                 "!grading.lab13._same_storage"),
}  # fmt: skip


def of(check: str) -> tuple[str, ...]:
    """The answers a check forbids (by its function's name)."""
    return ANSWERS[check]
