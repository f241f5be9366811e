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
under the caller's watch, see ``collectives._Executor``). A copy compiled anew from the
kit's source is recognised by what its code does (:func:`_key`); a copy edited a little
(unused lines added, names changed, a code object renamed: red team round 5) by how much
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

A profile function only sees the threads it was given; so, meanwhile, the answers are
also *disarmed*: each of their functions gets code that refuses to run (it notes the
answer and raises :class:`AnswerRan`) until the learner's call is over. That reaches every
thread of the process (one the watch never saw: ``_thread.start_new_thread``, a pool
started before the check) and every process forked from it, whatever turned the watch off.
Honest work never runs an answer while it is watched (the watch would fail it), so the
refusal takes nothing from it.
"""

from __future__ import annotations

import collections
import contextlib
import difflib
import dis
import importlib
import inspect
import itertools
import os
import sys
import threading
import types
import warnings

import torch

from .. import plaindata, warmup

#: per check: the kit's code that answers its exercise. A module stands for all it defines.
#: "from_scratch" is every collective a from-scratch exercise (labs 02, 03) must build itself.
ANSWERS: dict[str, tuple[str, ...]] = {
    "check_ping_pong": ("pingpong",),
    "check_fit_alpha_beta": ("costmodel.fit_alpha_beta",),
    # the whole cost model: its time models with α = 0, β = 1 are byte counts (the ring's,
    # halving-doubling's…), and its bus-bandwidth factors (BUSBW_FACTOR) are the answer
    "check_bytes_moved": ("costmodel",),
    # the whole module: its private helpers (_naive, _ring_reduce_scatter_flat, …) hold the
    # algorithms; chunk_bounds is the lab's own advice
    "from_scratch": ("collectives", "!collectives.chunk_bounds", "moe.AllToAll",
                     "training.builtin_all_reduce"),
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
    "check_fsdp_plan": ("costmodel.fsdp_step", "grading.lab12", "fsdp"),
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
            if isinstance(value, dict):  # a table of functions (costmodel.BUSBW_FACTOR)
                yield from (f for f in value.values() if inspect.isfunction(f)
                            and f.__module__ == obj.__name__)  # fmt: skip
            elif getattr(value, "__module__", None) == obj.__name__ and (
                inspect.isfunction(value) or inspect.isclass(value)
            ):
                yield from _functions(value)
    elif isinstance(obj, dict):
        yield from (_unwrapped(f) for f in obj.values() if inspect.isfunction(f))
    elif inspect.isclass(obj):
        for value in vars(obj).values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property):
                yield from (
                    f for f in (value.fget, value.fset, value.fdel) if inspect.isfunction(f)
                )
            elif inspect.isfunction(value):
                yield _unwrapped(value)
    elif inspect.isfunction(obj):
        # the original under a check's own recorder (functools.wraps): the recorder's code
        # is the same for every function it wraps, the learner's messages included
        yield _unwrapped(obj)


def _unwrapped(fn):
    original = inspect.unwrap(fn)
    return original if inspect.isfunction(original) else fn


def _table_entries(module) -> dict[int, str]:
    """id of each function a module holds in a dict -> its name there, ``TABLE['key']``."""
    if not isinstance(module, types.ModuleType):
        return {}
    found = {}
    for name, value in vars(module).items():
        if isinstance(value, dict):
            found.update(
                {id(f): f"{name}[{k!r}]" for k, f in value.items() if inspect.isfunction(f)}
            )
    return found


def code_objects(names) -> dict[types.CodeType, str]:
    """Each code object of the answers ``names`` (dotted under overlapkit), with the name
    a learner is told: ``ok.<dotted>``. A name that starts with "!" is allowed: its code
    is left out (a module's helper the lab tells the learner to use)."""
    codes = {}
    allowed = {
        code
        for dotted in names if dotted.startswith("!")
        for fn in _functions(_resolve(dotted[1:]))
        for code in _nested(fn.__code__)
    }  # fmt: skip
    for dotted in (n for n in names if not n.startswith("!")):
        obj = _resolve(dotted)
        tables = _table_entries(obj)
        for fn in _functions(obj):
            own = fn.__qualname__.split(".<locals>")[0]  # a table's lambda: TABLE['key']
            own = tables.get(id(fn), own) if own == "<lambda>" else own
            label = (
                f"ok.{dotted}" if not isinstance(obj, types.ModuleType) else f"ok.{dotted}.{own}"
            )
            for code in _nested(fn.__code__):
                if code not in allowed:
                    codes.setdefault(code, label)
    return codes


_KIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # overlapkit/
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))

#: the operations of torch's process groups, by the builtin function a call runs
_GROUP_OPS = ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
              "allgather_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter",
              "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "reduce", "alltoall",
              "alltoall_base", "send", "recv", "recv_anysource", "gather", "scatter", "barrier",
              "monitored_barrier")  # fmt: skip


def _group_ops() -> dict[int, str]:
    """id of each process-group operation's builtin function -> its name: a call of one
    from the learner's code is seen whatever group it is on (one made outside torch's
    registry too, which no sequence number of the registry's groups counts)."""
    import torch._C._distributed_c10d as c10d  # noqa: PLC0415

    found = {}
    kinds = ("ProcessGroup", "Backend", "ProcessGroupGloo", "ProcessGroupNCCL", "ProcessGroupMPI")
    for cls in (getattr(c10d, n, None) for n in kinds):
        for name in _GROUP_OPS if cls is not None else ():
            fn = getattr(vars(cls).get(name), "__func__", vars(cls).get(name))
            if fn is not None:
                found[id(fn)] = f"{cls.__name__}.{name}"
    return found


def _key(code: types.CodeType) -> tuple:
    """What a code object does, not where it was compiled: the kit's source compiled again
    (blank lines in front, another file or module name) has the same key."""
    consts = tuple(_key(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return (code.co_name, code.co_code, code.co_names, code.co_varnames, code.co_freevars,
            code.co_cellvars, consts)  # fmt: skip


#: the least bytecode a function needs for its copy to be recognised (bytes_moved_per_rank
#: has 50: the smallest answer)
TELLING_BYTES = 48


def _telling(code: types.CodeType) -> bool:
    return not code.co_name.startswith("<") and len(code.co_code) >= TELLING_BYTES


#: an answer's function is recognised in an edited copy only with at least this many
#: instructions: below, honest functions (the solutions', the tests' learners') hold up to
#: 95% of one (lab 07's greedy loop and ok.costmodel.ddp_buckets, 55); from 57 up, 67% at
#: most (measured over 1,076 functions, 165 answers)
COPY_MIN_TOKENS = 64
#: the share of such an answer's instructions, in order, that makes a function its copy;
#: unused lines added anywhere take nothing from it
COPIED = 0.85
#: instructions whose argument is kept: the names and constants a function uses (its own
#: variables' names and its jumps' targets are left out: a copy renames and moves those)
_NAMED = {"LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD", "LOAD_NAME", "IMPORT_NAME", "IMPORT_FROM",
          "STORE_ATTR", "LOAD_CONST", "KW_NAMES", "COMPARE_OP", "BINARY_OP"}  # fmt: skip
_tokens_of: dict[int, tuple] = {}


def _tokens(code: types.CodeType) -> tuple:
    """What a function does, as its instructions (see :data:`_NAMED`)."""
    entry = _tokens_of.get(id(code))
    if entry is None or entry[0] is not code:  # (the entry keeps its code's id its own)
        out = []
        for ins in dis.get_instructions(code):
            if ins.opname in ("RESUME", "NOP", "CACHE", "EXTENDED_ARG"):
                continue
            # a global's name is the learner's to choose (an alias of the kit's own: red
            # team, lab 14); what it does with it is not
            arg = ins.argval if ins.opname in _NAMED and ins.opname != "LOAD_GLOBAL" else None
            if not isinstance(arg, (str, int, float, bool, type(None))):
                arg = type(arg).__name__
            out.append((ins.opname, arg))
        entry = _tokens_of[id(code)] = (code, tuple(out), collections.Counter(out))
    return entry[1]


def _shapes(codes: dict) -> list:
    """The answers' functions an edited copy of which is recognised: the kit's own
    (not the methods dataclasses generate, alike in every dataclass), long enough."""
    found = []
    for code, label in codes.items():
        if code.co_filename.startswith(_KIT) and len(_tokens(code)) >= COPY_MIN_TOKENS:
            found.append((_tokens(code), _tokens_of[id(code)][2], frozenset(code.co_names),
                          label, len(code.co_code)))  # fmt: skip
    return found


def _copy_of(code: types.CodeType, shapes: list) -> str | None:
    """The answer (its label, and how much of it) that ``code`` is an edited copy of:
    ``code`` holds at least :data:`COPIED` of its instructions in their order."""
    # (an instruction takes two bytes or more: too short a function is let go before dis)
    if not shapes or len(code.co_code) < 2 * COPIED * COPY_MIN_TOKENS:
        return None
    # the global and attribute names it uses, at no cost: a copy keeps most of the answer's
    # (a lenient half, for renamed imports); torch's own functions, started by the hundred
    # under a watch, share few, and are let go before the costly disassembly. A copy whose
    # globals were all renamed (red team, lab 14: plan_for's four through aliases) shares
    # none but is as long: the length lets it through to the instructions
    names, size = set(code.co_names), len(code.co_code)
    near = [s for s in shapes if len(names & s[2]) >= 0.5 * len(s[2])
            or 0.8 * s[4] <= size <= 1.6 * s[4]]  # fmt: skip
    if not near:
        return None
    mine = _tokens(code)
    counts = _tokens_of[id(code)][2]
    for theirs, their_counts, _, label, _ in near:
        if len(mine) < COPIED * len(theirs):
            continue
        # the instructions both have, whatever the order: an upper bound, and cheap
        if sum((counts & their_counts).values()) < COPIED * len(theirs):
            continue
        blocks = difflib.SequenceMatcher(None, mine, theirs, autojunk=False).get_matching_blocks()
        held = sum(b.size for b in blocks) / len(theirs)
        if held >= COPIED:
            return f"{label} (an edited copy: {held:.0%} of its instructions, in their order)"
    return None


def _trusted() -> frozenset[int]:
    """The ids of the code objects of the kit's and torch.distributed's own modules, as
    loaded (by identity: code compiled elsewhere under their file names is not theirs):
    the frames from which a process-group operation or a profiler change is theirs."""
    kinds = ("overlapkit.", "torch.distributed")
    names = [m for m in list(sys.modules) if m == "overlapkit" or m.startswith(kinds)]
    found = set()
    with warnings.catch_warnings():  # torch.distributed's deprecated names say so when touched
        warnings.simplefilter("ignore")
        for name in names:
            module = sys.modules.get(name)
            path = getattr(module, "__file__", None) or ""
            if not path.startswith((_KIT, _TORCH)) or module.__name__ != name:
                continue
            for fn in _functions(module):
                found.update(id(c) for c in _nested(fn.__code__))
    # a thread's own start sets threading.setprofile's profiler (under the watch that
    # _raw_threads_watched gave it first)
    found.add(id(threading.Thread._bootstrap_inner.__code__))
    return frozenset(found)


def _watch(codes: dict, ran: list, before, counter):
    """A profile function that notes each start of a watched code object (its answer's
    name), a call of sys.setprofile or threading.setprofile from the learner's code
    (:data:`TAMPERED`), and a process-group operation the learner's code calls itself
    (:data:`GROUP`); every event goes on to the profiler that was there before (another
    watch, a learner's profiler). A closure over a frozen set: nothing on it to clear; and
    ``counter`` (an ``itertools.count`` that cannot be wound back) counts every note, so
    that notes taken out of ``ran`` afterwards show."""
    # a copy is recognised by what its functions do; comprehensions, lambdas and one-line
    # functions only by identity (a learner's `[p for p in ...]` may well read like the kit's)
    labels = {_key(code): label for code, label in codes.items() if _telling(code)}
    watched = frozenset(labels)
    shapes = tuple(_shapes(codes))  # and a copy edited a little, by what it holds of a long one
    # id(code) -> (code, its answer's name or None), worked out once per code object: a
    # code object hashes by value (its constants' tuple again on every call), an id does
    # not; the entry keeps the code alive, so that its id is not another's later
    known: dict = {}
    answer_ids = frozenset(id(code) for code in codes)
    labels_by_id = {id(code): label for code, label in codes.items()}
    trusted = _trusted()
    setprofile, threading_setprofile = sys.setprofile, threading.setprofile.__code__
    ops = _group_ops()
    tick = counter.__next__

    # bound now: the learner's code may rebind the module's names while it runs (red team,
    # lab 14: answers._copy_of = lambda *a: None), not these
    key_of, copy_of, telling = _key, _copy_of, _telling

    def answer(code):
        if id(code) in answer_ids:  # before the cache, which the learner's code can reach
            return labels_by_id.get(id(code), "ok.?")  # (through sys.getprofile's closure)
        entry = known.get(id(code))
        if entry is None:
            if id(code) in trusted:  # the kit's other code (a check's own) may do what an
                label = None  # answer does, in as many words
            else:
                key = key_of(code)
                label = labels.get(key, "ok.?") if key in watched else None
                if label is None and telling(code):
                    label = copy_of(code, shapes)
            entry = known[id(code)] = (code, label)
        return entry[1]

    def learners(frame) -> bool:
        return id(frame.f_code) not in trusted

    def note(what: str) -> None:
        tick()
        ran.append(what)

    def watch(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if (label := answer(code)) is not None:
                note(label)
            elif code is threading_setprofile and learners(frame.f_back):
                note(TAMPERED)
        elif event == "c_call" and learners(frame):
            if arg is setprofile:
                note(TAMPERED)
            elif id(arg) in ops:  # (a partial's call of one shows no event: lab 09 counts
                note(GROUP.format(ops[id(arg)]))  # the values the kit moved as well)
        if before is not None:
            before(frame, event, arg)

    watch.propagates = True  # the kit's communication workers run an op under its watch
    return watch


#: the lists of the watches open now: a refused answer is noted in each
_open: list[list[str]] = []


def refused(label: str) -> AnswerRan:
    """What a disarmed answer's code calls: notes ``label`` in every open watch and
    returns the exception it raises."""
    for ran in list(_open):
        ran.append(label)
    return AnswerRan(f"ran {label}, the kit's own answer, which refuses to run while a check "
                     "watches your function: write it yourself")  # fmt: skip


_refusals: dict[tuple[str, int], types.CodeType] = {}


def _refusal(label: str, free: int) -> types.CodeType:
    """Code that raises :func:`refused`'s exception, with ``free`` free variables (a
    function's code may only be replaced by code with as many)."""
    key = (label, free)
    if key not in _refusals:
        names = [f"_free{i}" for i in range(free)]
        source = (
            "def _outer():\n"
            + "".join(f"    {v} = None\n" for v in names)
            + "    def refusing(*args, **kwargs):\n"
            + (f"        ({', '.join(names)},)\n" if names else "")
            + "        raise __import__('overlapkit.grading.answers', fromlist=['refused'])"
            + f".refused({label!r})\n"
        )
        outer = compile(source, f"<the kit's answer {label}, disarmed>", "exec").co_consts[0]
        _refusals[key] = next(c for c in outer.co_consts if isinstance(c, types.CodeType))
    return _refusals[key]


def _answer_functions(names, codes: dict) -> list[tuple[types.FunctionType, str]]:
    """The functions whose code answers ``names`` (``codes``: their :func:`code_objects`),
    each once."""
    found, seen = [], set()
    for dotted in (n for n in names if not n.startswith("!")):
        for fn in _functions(_resolve(dotted)):
            if id(fn) not in seen and fn.__code__ in codes:
                seen.add(id(fn))
                found.append((fn, codes[fn.__code__]))
    return found


@contextlib.contextmanager
def _disarmed(names, codes: dict):
    """The answers' functions refuse to run while the block runs (module docstring)."""
    swapped = []
    try:
        for fn, label in _answer_functions(names, codes):
            original = fn.__code__
            fn.__code__ = _refusal(label, len(original.co_freevars))
            swapped.append((fn, original))
        yield
    finally:
        for fn, original in reversed(swapped):
            fn.__code__ = original


@contextlib.contextmanager
def _raw_threads_watched(watch):
    """Threads started with ``_thread.start_new_thread`` (which ``threading.setprofile``
    does not reach) start under ``watch`` too while the block runs: a copy of an answer
    recompiled from the kit's source and run on one was seen by nothing."""
    import _thread  # noqa: PLC0415

    def watched(original):
        def start_new_thread(function, args, kwargs=None):
            def run(*a, **k):  # (a threading.Thread then sets threading.setprofile's
                # watch again, if it is still there: threading._profile_hook = None is no door)
                sys.setprofile(watch)
                return function(*a, **k)

            return original(run, args, kwargs or {})

        return start_new_thread

    places = [(m, n) for m, n in ((_thread, "start_new_thread"), (_thread, "start_new"),
                                  (threading, "_start_new_thread")) if hasattr(m, n)]  # fmt: skip
    saved = [(m, n, getattr(m, n)) for m, n in places]
    for m, n, original in saved:
        setattr(m, n, watched(original))
    try:
        yield
    finally:
        for m, n, original in saved:
            setattr(m, n, original)


@contextlib.contextmanager
def running(names):
    """Watch the answers ``names`` while the block runs; yields the list of the answers'
    names, one entry per time their code started (see the module docstring for where),
    and what else the watch saw (:func:`said` words it)."""
    from . import sealed  # noqa: PLC0415

    ran: list[str] = []
    if not names:
        yield ran
        return
    if plaindata.trusting():  # the learner's code may run here (in a judge it runs on
        warmup.warm_torch()  # ranks): torch's start-up before the watch, once per process
    before, before_threads = sys.getprofile(), threading.getprofile()
    counter = itertools.count()
    codes = code_objects(names)
    watch = _watch(codes, ran, before, counter)
    _open.append(ran)
    sys.setprofile(watch)
    threading.setprofile(watch)
    try:
        # a sealed student function called meanwhile is watched on its own rank the same way
        with (_disarmed(names, codes), _raw_threads_watched(watch),
              sealed.watching(("answers", tuple(names)), ran)):  # fmt: skip
            yield ran
    finally:
        _open.remove(ran)
        # notes taken out of ``ran`` (or a list put in its place) leave the count higher
        if sys.getprofile() is not watch or next(counter) > len(ran):
            ran.append(TAMPERED)
        sys.setprofile(before)
        threading.setprofile(before_threads)


class AnswerRan(RuntimeError):
    """A rank ran the kit's own answer during the learner's function (one text argument,
    so that it travels back from a rank like any exception)."""

    @classmethod
    def on(cls, rank: int, ran: list[str]) -> AnswerRan:
        return cls(f"rank {rank} {said(ran)}")


#: what a watch notes when the learner's function took the watch away
TAMPERED = "sys.setprofile"
#: what a watch notes when the learner's code ran a process group's own operation
GROUP = "torch's {} (called on a process group directly)"


#: what :func:`traffic.recording` notes when the learner's code changed its record
RECORD = "traffic record"


def said(ran: list[str]) -> str:
    """What a learner is told about the answers ``ran`` (non-empty)."""
    if RECORD in ran:
        return ("changed the check's record of its messages (traffic.current()): the check "
                "cannot trust what it saw, so it fails")  # fmt: skip
    if TAMPERED in ran:
        return ("changed the profiler the check watches the kit's answers with "
                "(sys.setprofile / threading.setprofile): the check cannot see what ran, so "
                "it fails")  # fmt: skip
    groups = [r for r in ran if r.startswith("torch's ")]
    if groups:
        return (
            f"called {groups[0]}: a built-in collective or message by another door. Use "
            "ok.p2p for messages (and the kit's ops where the exercise allows them)"
        )
    first, *more = dict.fromkeys(ran)  # the first to start is the one called
    names = first + (f" (and {len(more)} more of the kit's functions)" if more else "")
    return (
        f"ran {names}, the kit's own answer (however it was reached: an alias, a subclass, a "
        "wrapper, a default argument or an edited copy runs the same code): write it yourself"
    )
