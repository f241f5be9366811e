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
runs, and fails it when one starts: in the calling thread, in threads started meanwhile,
and in the kit's communication workers (an async op runs its task under the caller's
watch, see ``collectives._Executor``).

Each check's answers are listed once, in :data:`ANSWERS`, by dotted name under
``overlapkit``: a module (every function and class defined in it), a class (its methods,
properties, static and class methods), or a function.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import threading
import types

#: per check: the kit's code that answers its exercise. A module stands for all it defines.
#: "from_scratch" is every collective a from-scratch exercise (labs 02, 03) must build itself.
ANSWERS: dict[str, tuple[str, ...]] = {
    "check_ping_pong": ("pingpong",),
    "check_fit_alpha_beta": ("costmodel.fit_alpha_beta",),
    # the time models with α = 0, β = 1 are byte counts
    "check_bytes_moved": ("costmodel.bytes_moved_per_rank", "costmodel.ring_all_reduce",
                          "costmodel.ring_reduce_scatter", "costmodel.ring_all_gather",
                          "costmodel.naive_all_reduce"),
    "from_scratch": (
        "collectives.naive_all_reduce",
        "collectives.ring_all_reduce",
        "collectives.ring_reduce_scatter",
        "collectives.ring_all_gather",
        "collectives.bucketed_all_reduce",
        "moe.AllToAll",
        "training.builtin_all_reduce",
    ),
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
    "check_gpipe_step": ("pipeline._Run", "pipeline.PipelineStage", "pipeline.run_on_one_device"),
    "check_average_parameters": ("training._average_parameters", "training._averaged",
                                 "training.train"),
    "check_ag_matmul": ("tensor_parallel.all_gather_matmul", "tensor_parallel._AllGatherMatmul",
                        "tensor_parallel._checked_ring", "tensor_parallel.ColumnParallelLinear"),
    "check_chunked_moe": ("moe.MoELayer",),
}  # fmt: skip


def of(check: str) -> tuple[str, ...]:
    """The answers a check forbids (by its function's name)."""
    return ANSWERS[check]


def _resolve(dotted: str):
    """The object ``overlapkit.<dotted>``: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module("overlapkit." + ".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(f"overlapkit.{dotted}")


def _nested(code: types.CodeType):
    """``code`` and the code of every function, lambda and class body defined inside it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def _functions(obj):
    """The plain functions an object stands for (a class: its own methods of every kind)."""
    if isinstance(obj, types.ModuleType):
        for value in vars(obj).values():
            if getattr(value, "__module__", None) == obj.__name__ and (
                inspect.isfunction(value) or inspect.isclass(value)
            ):
                yield from _functions(value)
    elif inspect.isclass(obj):
        for value in vars(obj).values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property):
                yield from (f for f in (value.fget, value.fset, value.fdel) if f is not None)
            elif inspect.isfunction(value):
                yield inspect.unwrap(value)
    elif inspect.isfunction(obj):
        # the original under a check's own recorder (functools.wraps): the recorder's code
        # is the same for every function it wraps, the learner's messages included
        yield inspect.unwrap(obj)


def code_objects(names) -> dict[types.CodeType, str]:
    """Each code object of the answers ``names`` (dotted under overlapkit), with the name
    a learner is told: ``ok.<dotted>``."""
    codes = {}
    for dotted in names:
        obj = _resolve(dotted)
        for fn in _functions(obj):
            label = f"ok.{dotted}" if not isinstance(obj, types.ModuleType) else (
                f"ok.{dotted}.{fn.__qualname__.split('.<locals>')[0]}")  # fmt: skip
            for code in _nested(fn.__code__):
                codes.setdefault(code, label)
    return codes


class _Watch:
    """A profile function that notes each start of a watched code object, and passes every
    event on to the profiler that was there before (another watch, a learner's profiler)."""

    propagates = True  # the kit's communication workers run an op under its issuer's watch

    def __init__(self, codes: dict, ran: list, before):
        self.codes, self.ran, self.before = codes, ran, before

    def __call__(self, frame, event, arg):
        if event == "call":
            label = self.codes.get(frame.f_code)
            if label is not None:
                self.ran.append(label)
        if self.before is not None:
            self.before(frame, event, arg)


@contextlib.contextmanager
def running(names):
    """Watch the answers ``names`` while the block runs; yields the list of the answers'
    names, one entry per time their code started (see the module docstring for where)."""
    from . import sealed  # noqa: PLC0415

    ran: list[str] = []
    if not names:
        yield ran
        return
    codes = code_objects(names)
    before, before_threads = sys.getprofile(), threading.getprofile()
    watch = _Watch(codes, ran, before)
    sys.setprofile(watch)
    threading.setprofile(watch)
    try:
        # a sealed student function called meanwhile is watched on its own rank the same way
        with sealed.watching(("answers", tuple(names)), ran):
            yield ran
    finally:
        if sys.getprofile() is not watch:
            ran.append(TAMPERED)
        sys.setprofile(before)
        threading.setprofile(before_threads)


def watch_of_this_thread():
    """The watch on this thread, if any: what the kit's communication worker should run an
    async op under (``sys.setprofile`` is per thread)."""
    profile = sys.getprofile()
    return profile if getattr(profile, "propagates", False) else None


class AnswerRan(RuntimeError):
    """A rank ran the kit's own answer during the learner's function (one text argument,
    so that it travels back from a rank like any exception)."""

    @classmethod
    def on(cls, rank: int, ran: list[str]) -> AnswerRan:
        return cls(f"rank {rank} {said(ran)}")


#: what a watch notes when the learner's function took the watch away
TAMPERED = "sys.setprofile"


def said(ran: list[str]) -> str:
    """What a learner is told about the answers ``ran`` (non-empty)."""
    if TAMPERED in ran:
        return ("replaced the profiler the check watches the kit's answers with "
                "(sys.setprofile): the check cannot see what ran, so it fails")  # fmt: skip
    names = ", ".join(dict.fromkeys(ran))
    return (
        f"ran {names}, the kit's own answer (however it was reached: an alias, a subclass, a "
        "wrapper or a default argument runs the same code): write it yourself"
    )
