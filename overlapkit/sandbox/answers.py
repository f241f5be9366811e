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

A check names the answers to watch (the checks list them once, with their exercises), by
dotted name under ``overlapkit``: a module (every function and class defined in it), a
class (its methods, properties, static and class methods), or a function; "!name" leaves
one out.

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
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import difflib
import dis
import importlib
import inspect
import itertools
import marshal
import os
import struct
import sys
import threading
import types
import warnings

import torch

from .. import plaindata, warmup


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


def _answer(obj):
    """The functions an answer stands for (:func:`_functions`); a package (the cost model)
    stands for what each of its modules defines too, its private helpers included."""
    yield from _functions(obj)
    if isinstance(obj, types.ModuleType) and hasattr(obj, "__path__"):
        inside = obj.__name__ + "."
        for value in list(vars(obj).values()):
            if isinstance(value, types.ModuleType) and value.__name__.startswith(inside):
                yield from _answer(value)


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
        for fn in _answer(_resolve(dotted[1:]))
        for code in _nested(fn.__code__)
    }  # fmt: skip
    for dotted in (n for n in names if not n.startswith("!")):
        obj = _resolve(dotted)
        tables = _table_entries(obj)
        for fn in _answer(obj):
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
    """What a code object does, not where it was compiled nor what it is called: the kit's
    source compiled again (blank lines in front, another file or module name), or its code
    renamed (``co_name="<lambda>"``), has the same key."""
    consts = tuple(_key(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return (code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
            consts)  # fmt: skip


#: the least bytecode a function needs for its copy to be recognised (bytes_moved_per_rank
#: has 50: the smallest answer)
TELLING_BYTES = 48


def _telling(code: types.CodeType) -> bool:
    """Whether an *answer's* code is recognised in a copy: a function's, long enough (the
    kit's comprehensions and lambdas may read like a learner's ``[p for p in ...]``). A
    code object that runs is judged whatever its name: a name is the learner's to choose."""
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


def _tokens(code: types.CodeType, cache: dict | None = None) -> tuple:
    """What a function does, as its instructions (see :data:`_NAMED`); kept in ``cache``
    (by default the module's: only where no learner's code runs, the judge's process)."""
    cache = _tokens_of if cache is None else cache
    entry = cache.get(id(code))
    if entry is None or entry[0] is not code:  # (the entry keeps its code's id its own)
        out = []
        for ins in dis.get_instructions(code):
            if ins.opname in ("RESUME", "NOP", "CACHE", "EXTENDED_ARG"):
                continue
            # a global's name is the learner's to choose (an alias of the kit's own, in
            # lab 14 say); what it does with it is not
            arg = ins.argval if ins.opname in _NAMED and ins.opname != "LOAD_GLOBAL" else None
            if not isinstance(arg, (str, int, float, bool, type(None))):
                arg = type(arg).__name__
            out.append((ins.opname, arg))
        entry = cache[id(code)] = (code, tuple(out), collections.Counter(out))
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


def _copy_of(code: types.CodeType, shapes: list, cache: dict | None = None) -> str | None:
    """The answer (its label, and how much of it) that ``code`` is an edited copy of:
    ``code`` holds at least :data:`COPIED` of its instructions in their order."""
    # (an instruction takes two bytes or more: too short a function is let go before dis)
    if not shapes or len(code.co_code) < 2 * COPIED * COPY_MIN_TOKENS:
        return None
    # the global and attribute names it uses, at no cost: a copy keeps most of the answer's
    # (a lenient half, for renamed imports); torch's own functions, started by the hundred
    # under a watch, share few, and are let go before the costly disassembly. A copy whose
    # globals were all renamed (lab 14: plan_for's four through aliases) shares
    # none but is as long: the length lets it through to the instructions
    names, size = set(code.co_names), len(code.co_code)
    near = [s for s in shapes if len(names & s[2]) >= 0.5 * len(s[2])
            or 0.8 * s[4] <= size]  # fmt: skip
    if not near:
        return None
    cache = _tokens_of if cache is None else cache
    mine = _tokens(code, cache)
    counts = cache[id(code)][2]
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


_CTYPES_NAMES = frozenset({"memmove", "from_buffer", "addressof", "CDLL", "cdll", "PyDLL", "pydll",
                           "prctl", "fflush", "byref", "string_at", "c_void_p", "c_int", "c_uint",
                           "c_size_t", "c_char_p", "POINTER", "CFUNCTYPE"})  # fmt: skip
_library: list = []
#: where what is installed lives (Python's own modules, site-packages): a check's ranks
#: cannot write there (sandbox.nofiles)
_INSTALLED = tuple(
    {p + os.sep for base in (sys.prefix, sys.base_prefix) for p in (base, os.path.realpath(base))}
)


def library() -> tuple[frozenset[int], frozenset]:
    """(ids of the code objects of the libraries' functions as loaded — Python's own,
    torch's, numpy's: what is installed, not the kit —, those code objects of theirs and the
    kit's that call C through ctypes). Worked out once per process (the forkserver does it
    before it forks ranks: ``overlapkit._preload``), before any learner's code runs: by
    identity, so code compiled under a library's file name is not the library's. A watch
    neither sends nor walks the libraries' code (it is nobody's copy), and only the
    ctypes callers may call C while a learner's function runs (``sealed``)."""
    if not _library:
        roots = _INSTALLED
        ids, calls_c = set(), set()
        with warnings.catch_warnings():  # deprecated names say so when touched
            warnings.simplefilter("ignore")
            for name, module in list(sys.modules.items()):
                path = getattr(module, "__file__", None) or ""
                kit = name == "overlapkit" or name.startswith("overlapkit.")
                if getattr(module, "__name__", None) != name:
                    continue
                if not kit and not os.path.realpath(path).startswith(roots):
                    continue
                with contextlib.suppress(Exception):  # a module that cannot be looked into
                    for fn in _functions(module):
                        for code in _nested(fn.__code__):
                            if not kit:
                                ids.add(id(code))
                            if _CTYPES_NAMES & set(code.co_names):
                                calls_c.add(code)
        _library.append((frozenset(ids), frozenset(calls_c)))
    return _library[0]


#: module name -> (the module, the ids of its code objects), for :func:`_trusted`: filled
#: in the forkserver (``overlapkit._preload``) for what it loaded, so that a rank's watch
#: only looks into the modules loaded since (ids only: no code object is handed out here)
_trusted_by_module: dict[str, tuple] = {}


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
            known = _trusted_by_module.get(name)
            if known is None or known[0] is not module:  # (a module loaded afresh: looked into)
                ids = frozenset(id(c) for fn in _functions(module) for c in _nested(fn.__code__))
                known = _trusted_by_module[name] = (module, ids)
            found.update(known[1])
    # a thread's own start sets threading.setprofile's profiler (under the watch that
    # _raw_threads_watched gave it first)
    found.add(id(threading.Thread._bootstrap_inner.__code__))
    return frozenset(found)


#: the exit status of a rank whose watch could not send what it saw (its pipe closed or
#: replaced) or was interfered with (its generator closed or thrown into): no verdict
#: about that rank can be trusted, so the check fails
CUT = 87
#: what a rank's watch sends on the rank's channel (``launcher.heard``): a watch's
#: start (before the learner's code runs), an answer seen by identity, or a code object
#: that may be an answer's copy, for the check to judge outside the rank
START, NOTE, CODE = 0, 1, 2
#: what the audit hook of a learner's call sends (:func:`code_made_meanwhile`), for every
#: watch of the rank: source text compiled, a code object run by exec or unmarshalled,
#: the bytecode of a code object made by hand (``types.CodeType``, ``code.replace``)
SOURCE, MADE, BYTECODE = 3, 4, 5
EVERY_WATCH = 0xFFFFFFFF
_numbers = itertools.count()


def _sightings_pipe():
    """(fd, identity) of this rank's channel, where its watches write their sightings;
    None outside a launched rank."""
    from .. import rankhook  # noqa: PLC0415

    conn = rankhook.channel()
    if conn is None:
        return None
    st = os.fstat(conn.fileno())
    return conn.fileno(), (st.st_dev, st.st_ino)


def _writer(pipe, number: int):
    """``send(kind, data)``: one message on the sightings pipe ``pipe`` = (fd, identity),
    for the watch ``number``. Made, with all it calls bound, before the learner's code runs;
    it raises when the pipe is not the one it was given (closed, or another in its place)."""
    fd, identity = pipe
    fstat, write, pack, len_, memoryview_ = os.fstat, os.write, struct.pack, len, memoryview

    def send(kind, data):
        st = fstat(fd)
        if (st.st_dev, st.st_ino) != identity:
            raise OSError("the sightings pipe was replaced")
        message = pack("!BI", kind, number) + data
        view = memoryview_(pack("!i", len_(message)) + message)
        while len_(view):
            view = view[write(fd, view) :]

    return send


def code_made_meanwhile():
    """What the audit hook of a learner's call (``sealed._guard_the_call``) does with an
    event that makes code while the call runs, in any thread: ``made(event, args,
    caller_file)`` sends it out on the rank's sightings pipe for the check to judge (a
    copy of an answer compiled from text on a thread no profiler watches, a raw thread's
    or one torch started). Imports are let by (they load
    files; the guard refuses the kit's). Everything is bound now, before the learner's
    code runs; a pipe that cannot be written ends the process (:data:`CUT`)."""
    pipe = _sightings_pipe()
    if pipe is None:
        return lambda event, args, caller: None
    write, dumps, exit_, type_ = _writer(pipe, EVERY_WATCH), marshal.dumps, os._exit, type
    cut, source_kind, made_kind, bytecode_kind = CUT, SOURCE, MADE, BYTECODE
    str_, bytes_, code_t = str, bytes, types.CodeType
    importing = "<frozen importlib"

    def send(kind, data):
        try:
            write(kind, data)
        except BaseException:  # noqa: BLE001 - unseen is unjudged: end the process
            exit_(cut)

    def made(event, args, caller):
        if caller.startswith(importing):
            return
        if event == "compile":
            source = args[0]
            if type_(source) is str_:
                send(source_kind, source.encode("utf-8", "surrogatepass"))
            elif type_(source) is bytes_:
                send(source_kind, source)
            else:  # a syntax tree: compiled, it would be judged by nothing; refused
                raise RuntimeError(
                    "your function compiled a syntax tree: an exercise never needs to, and "
                    "the check could not see what it made"
                )
        elif event == "exec" and type_(args[0]) is code_t:
            send(made_kind, dumps(args[0]))
        elif event == "marshal.loads" and type_(args[0]) is bytes_:
            send(made_kind, args[0])
        elif event == "code.__new__" and type_(args[0]) is bytes_:
            send(bytecode_kind, args[0])

    return made


#: the opcodes :func:`_tokens` leaves out (CACHE: 3.11's inline caches, which dis hides)
_UNCOUNTED = frozenset(
    dis.opmap[name] for name in ("CACHE", "RESUME", "NOP", "EXTENDED_ARG") if name in dis.opmap
)


def _token_count(code: types.CodeType) -> int:
    """``len(_tokens(code))`` read off the bytecode's 2-byte units, without dis (which
    builds an object per instruction: most of a watch's start-up on every rank)."""
    ops = code.co_code[::2]
    return len(ops) - sum(ops.count(op) for op in _UNCOUNTED)


def _prefilter(codes: dict) -> tuple:
    """What a watch on a rank needs to choose the code objects worth sending out: the
    answers' bytecode sizes (a copy compiled anew has its answer's) and, per answer long
    enough for an edited copy to be told (:data:`COPY_MIN_TOKENS`), its global names and
    size."""
    sizes = frozenset(len(code.co_code) for code in codes if _telling(code))
    shapes = tuple(
        (frozenset(code.co_names), len(code.co_code))
        for code in codes
        if code.co_filename.startswith(_KIT) and _token_count(code) >= COPY_MIN_TOKENS
    )
    return sizes, shapes


def _watch(codes: dict, ran: list, before, counter):
    """A profile function that notes each start of a watched code object (its answer's
    name), a call of sys.setprofile or threading.setprofile from the learner's code
    (:data:`TAMPERED`), and a process-group operation the learner's code calls itself
    (:data:`GROUP`); every event goes on to the profiler that was there before (another
    watch, a learner's profiler). ``counter`` (an ``itertools.count`` that cannot be wound
    back) counts every note, so that notes taken out of ``ran`` afterwards show.

    On a launched rank (a check's) each note also leaves the process at once, on the
    rank's sightings pipe, with every code object that may be an edited or recompiled
    copy of an answer: the check judges those itself, from what left the rank
    (:func:`seen_by_watches`), not from what the rank's code reports at its end.

    Nothing of its state is within the learner's reach (a closure's cells are readable
    and writable, so none holds it): the profile function is a bound method of an
    immutable tuple, and the state lives in a generator's frame, which no attribute
    hands out while the learner's call runs (``gi_frame`` is refused, :func:`hide`).
    Everything it runs with was bound before the learner's code ran: the module's names
    (``answers._copy_of``, ``builtins.len``) may be rebound meanwhile, not these. A
    generator interfered with (closed, thrown into, sent what is not an event) ends the
    process (:data:`CUT`)."""
    from .. import rankhook  # noqa: PLC0415

    labels_by_id = {id(code): label for code, label in codes.items()}
    sizes, shapes = _prefilter(codes)
    pipe = _sightings_pipe()
    send = _writer(pipe, next(_numbers)) if pipe is not None else None
    # what tells the watch where the rank is once its block has closed: the block's own
    # frame (``running``'s, resumed to close it), another block's, the rank's entry point
    # (whose own calls after the check's function returned are the rank's tail) and the
    # flush that ends the tail just before the rank's value leaves
    between = frozenset(id(code) for code in _BETWEEN_BLOCKS)
    marks = (sys._getframe(1), running.__wrapped__.__code__, *rankhook.launcher_code(),
             between)  # fmt: skip
    state = _judge(
        labels_by_id, frozenset(labels_by_id), sizes, shapes, _trusted(), _group_ops(), ran,
        before, counter.__next__, send, library()[0],
        (sys.setprofile, threading.setprofile.__code__, len, id, set, frozenset, type,
         types.FrameType, str, marshal.dumps, TAMPERED, GROUP.format, _SCANNED_TYPES,
         dict.values, dict.get, SCAN_LIMIT, ValueError),
        marks,
    )  # fmt: skip
    next(state)  # runs to its first yield: everything bound, the start sent
    hide(state)
    # on a check's rank a watch that stopped seeing ends the process; elsewhere (a
    # notebook's kernel, the judge) it must not, and a check there has no ranks to trust
    end = os._exit if pipe is not None else int
    return types.MethodType(_entry, (state, _thread.RLock(), end))


def _entry(bound, frame, event, arg):
    """The profile function (bound to ``(generator, lock, os._exit)``): one event at a time
    into the generator. Any failure there, or a generator that has ended, ends the process:
    a watch that stopped seeing would pass what it missed. (The lock is re-entrant: called
    by the learner's code, outside a profile event, the call's own events come back here
    on the same thread, and find the generator running: that ends the process, not a
    deadlock.)"""
    try:
        with bound[1]:
            bound[0].send((frame, event, arg))
    except:  # noqa: E722 - a bare except: no name the learner's code could rebind
        bound[2](87)  # CUT, written out: a global is the learner's to rebind


_entry.propagates = True  # the kit's communication workers run an op under its watch


#: the kinds of object a watch walks for code objects (exactly these types: a subclass
#: could run the learner's code inside the watch), and the most objects one walk visits
_SCANNED_TYPES = (types.FunctionType, types.CodeType, types.CellType, types.MethodType, dict,
                  list, tuple, set, frozenset, type)  # fmt: skip
SCAN_LIMIT = 20000


def _judge(labels_by_id, answer_ids, sizes, shapes, trusted, ops, ran, before, tick, out,
           libraries, tools, marks):  # fmt: skip
    """The watch's state and work (see :func:`_watch`): a generator sent one
    ``(frame, event, arg)`` per profile event.

    A code object that starts is sent out when it may be an answer's copy (its size, or
    its names and length, are an answer's). And where the check's or the kit's code calls
    the learner's (its function, a callback), everything that function can reach (its
    constants, globals, closure, defaults, arguments) is walked for code objects, which go
    out the same way: a copy that will run on a thread no profile function reaches (one
    started from C) was already seen where it was handed over.

    On a check's rank the watch outlives its block (``running`` leaves it on, and the
    call's guard refuses switching it off from then on): code of the learner's may still
    run once the block has closed (a finaliser, a handle whose ``_wait`` the rank's end
    calls, a kit function rebound), and the answers are armed again then: the kit's
    answer run from a fake unwaited handle would pass labs 00, 03 and 08 in the grader.
    So an answer that starts after the block is noted too,
    until the rank's value is on its way (the flush before the send), except where the
    check's own code calls it (a function marked :func:`between_blocks`: lab 00 times the
    kit's ping-pong between its blocks), an answer does, or a later block is open (its
    own watch judges it)."""
    (setprofile, threading_setprofile, len_, id_, set_, frozenset_, type_, frame_type, str_,
     dumps, tampered, group, kinds, dict_values, dict_get, limit, value_error) = tools  # fmt: skip
    function_t, code_t, cell_t, method_t, dict_t, list_t, tuple_t, set_t, frozen_t, type_t = kinds
    block, running_code, main_code, flush_code, between = marks
    closed = tail = done = False  # the block closed; the rank's tail began; it ended
    blocks: dict = {}  # id of another block's frame -> the times it started (open, close)
    later = 0  # later blocks open now
    containers = (list_t, tuple_t, set_t, frozen_t)
    append = ran.append
    seen = set_()  # ids of the code objects looked at, kept alive by ``keep``
    keep = []
    sent = set_()  # labels sent out (once each: the check needs which, not how often)
    # the module's constants, bound now (before the learner's code runs, which could rebind them)
    start_kind, note_kind, code_kind, telling = START, NOTE, CODE, TELLING_BYTES
    min_copy = 2 * COPIED * COPY_MIN_TOKENS  # bytes of bytecode an edited copy needs
    torch_files = _TORCH + os.sep
    installed = _INSTALLED
    sends = out is not None  # (outside a check's rank the watch only notes)

    def send(kind, data):
        if sends:
            out(kind, data)

    def note(what):
        tick()
        append(what)
        if what not in sent:
            sent.add(what)
            send(note_kind, what.encode())

    def worth_sending(code):
        """May ``code`` be a copy of an answer (whatever its name: the learner's to choose)?"""
        size = len_(code.co_code)
        if size < telling:
            return False
        if size in sizes:  # an answer's own bytecode is this long
            return True
        if size < min_copy:
            return False
        mine = frozenset_(code.co_names)
        for their_names, their_size in shapes:
            if 2 * len_(mine & their_names) >= len_(their_names):
                return True
            # (no upper bound: unused lines added take nothing from a copy, and one
            # padded past 1.6× the answer's size is still one)
            if 0.8 * their_size <= size:
                return True
        return False

    def look(code):
        """Send ``code`` out (once) when it may be a copy."""
        key = id_(code)
        if key in seen:
            return False
        seen.add(key)
        keep.append(code)
        if key not in trusted and key not in libraries and key not in answer_ids and sends:
            if worth_sending(code):
                send(code_kind, dumps(code))  # the check judges it
        return True

    def walk(roots):
        """Every code object reachable from ``roots``, looked at (see the docstring)."""
        todo, visited, count = list_t(roots), set_(), 0
        while todo and count < limit:
            obj = todo.pop()
            key = id_(obj)
            if key in visited:
                continue
            visited.add(key)
            count += 1
            kind = type_(obj)
            if kind is code_t:
                look(obj)
                todo.extend(obj.co_consts)
            elif kind is function_t:
                code = obj.__code__
                if id_(code) in trusted or id_(code) in libraries:  # nothing of the learner's
                    continue
                todo.append(code)
                if code.co_filename.startswith(torch_files):
                    continue  # looked at (a copy may claim torch's file), not walked into
                todo.append(obj.__defaults__)
                todo.append(obj.__kwdefaults__)
                todo.append(obj.__closure__)
                scope = obj.__globals__
                if type_(scope) is dict_t:
                    for inner in (code, *code.co_consts):
                        if type_(inner) is code_t:
                            todo.extend(dict_get(scope, name) for name in inner.co_names)
            elif kind is cell_t:
                try:
                    todo.append(obj.cell_contents)
                except value_error:  # an empty cell
                    pass
            elif kind is method_t:
                todo.append(obj.__func__)
            elif kind is dict_t:
                todo.extend(dict_values(obj))
            elif kind in containers:
                todo.extend(obj)
            elif kind is type_t:
                todo.extend(obj.__dict__.values())

    send(start_kind, b"")
    while True:
        frame, event, arg = yield
        # what else the learner's code might send in (a frame-like object whose f_code,
        # a str whose __eq__, would run its code in here) ends the watch: see _entry
        if type_(frame) is not frame_type or type_(event) is not str_:
            raise TypeError("not a profile event")
        if event == "call":
            code = frame.f_code
            key = id_(code)
            if sends and not done:
                if frame is block:  # resumed to close: the learner's call is over
                    closed = True
                elif code is running_code:  # another block: opens, then closes
                    keep.append(frame)
                    blocks[id_(frame)] = blocks.get(id_(frame), 0) + 1
                    later += 1 if blocks[id_(frame)] == 1 else -1
                elif closed and frame.f_back is not None and frame.f_back.f_code is main_code:
                    tail = True  # the rank's entry point calls on: its value goes next
                if tail and code is flush_code:
                    done = True
            if key in answer_ids:
                # after the block an answer is the check's own only where its code calls
                # it (between_blocks) or an answer does: not one a finaliser started, nor
                # one started from C alone (a partial over map(answer, …))
                back = frame.f_back
                caller = id_(back.f_code) if back is not None else None
                if not closed or (
                    not done and not later and caller not in between and caller not in answer_ids
                ):
                    note(labels_by_id[key])
            elif code is threading_setprofile and (
                frame.f_back is None or id_(frame.f_back.f_code) not in trusted
            ):
                note(tampered)
            elif code.co_name == "<module>" and code.co_filename.startswith(installed):
                pass  # a library imported meanwhile: its functions run as it loads them
            elif look(code) and key not in trusted and key not in libraries and sends:
                back = frame.f_back
                # the learner's code entered from the check's or the kit's (not torch's
                # own functions, called from the kit by the hundred)
                if (back is not None and id_(back.f_code) in trusted
                        and not code.co_filename.startswith(torch_files)):  # fmt: skip
                    scope = frame.f_globals
                    roots = [code, *dict_values(frame.f_locals)]
                    for inner in (code, *code.co_consts):
                        if type_(inner) is code_t and type_(scope) is dict_t:
                            roots.extend(dict_get(scope, name) for name in inner.co_names)
                    walk(roots)
        elif event == "c_call" and id_(frame.f_code) not in trusted:
            if arg is setprofile:
                note(tampered)
            elif id_(arg) in ops:  # (a partial's call of one shows no event: lab 09 counts
                note(group(ops[id_(arg)]))  # the values the kit moved as well)
        if before is not None:
            before(frame, event, arg)


def _hider(hidden: set, keep: list, id_=id, frames=frozenset({"gi_frame", "cr_frame", "ag_frame"})):
    """An audit hook (PEP 578: never removed, never listed, so its state is out of reach)
    that refuses handing out the frame of an object hidden with :func:`hide`."""

    def hook(event, args):
        if event == "overlapkit.hide":
            keep.append(args[0])  # alive: its id stays its own
            hidden.add(id_(args[0]))
        elif event == "object.__getattr__" and args[1] in frames and id_(args[0]) in hidden:
            raise RuntimeError(
                "the check's watch is not yours to read: its frame is refused while a check "
                "runs (the watch judges your function; nothing in it helps the exercise)"
            )

    return hook


_hider_installed: list = []


def hide(obj) -> None:
    """From now on in this process, ``obj``'s frame (a generator's ``gi_frame``) is refused
    to everyone: the state a watch keeps there is out of reach."""
    if not _hider_installed:
        sys.addaudithook(_hider(set(), []))
        _hider_installed.append(True)
    sys.audit("overlapkit.hide", obj)


def seen_by_watches(messages: list[bytes], garbled: bool, requested: list) -> list[list[str]]:
    """What each of a rank's watches saw, judged here from what it sent out on the rank's
    channel (``launcher.heard``): ``requested``, the answers' names of each watch
    the check made on the rank, in the order it made them. An answer seen by identity is
    named by the rank; a code object sent out is named here when it is an answer's copy
    (compiled anew, or edited). A message that is not the watch's, or a pipe that carried
    anything else, makes every watch's list say :data:`TAMPERED`."""
    starts: list[int] = []
    notes: dict[int, list[str]] = {}
    codes: dict[int, list[bytes]] = {}
    made: list[tuple[int, bytes]] = []  # the call's audit hook's, for every watch
    broken = garbled
    for message in messages:
        try:
            kind, number = struct.unpack_from("!BI", message)
            data = message[5:]
            if kind == START:
                starts.append(number)
            elif kind == NOTE:
                notes.setdefault(number, []).append(data.decode())
            elif kind == CODE:
                codes.setdefault(number, []).append(data)
            elif kind in (SOURCE, MADE, BYTECODE) and number == EVERY_WATCH:
                made.append((kind, data))
            else:
                broken = True
        except (struct.error, UnicodeDecodeError):
            broken = True
    out = []
    for number, names in zip(starts, requested, strict=False):
        seen = list(notes.get(number, []))
        for blob in codes.get(number, []):
            try:
                label = _judged_copy(blob, tuple(names))
            except Exception:  # noqa: BLE001 - not a code object of the rank's: its code's
                label = TAMPERED
            if label is not None:
                seen.append(label)
        for kind, data in made:
            label = _judged_made(kind, data, tuple(names))
            if label is not None:
                seen.append(label)
        out.append(seen + [TAMPERED] * broken)
    out += [[TAMPERED] * broken for _ in requested[len(out) :]]
    return out


def _judged_made(kind: int, data: bytes, names: tuple) -> str | None:
    """The answer (of ``names``) that code made during the call copies, if any: source
    text compiled (here, never run), a code object's marshal, or bytecode made by hand."""
    if kind == BYTECODE:
        if names not in _judged:
            _remember(names, code_objects(names))
        for key, label in _judged[names][0].items():
            if key[0] == data:  # (_key's first field: the bytecode)
                return label
        return None
    try:
        if kind == SOURCE:
            code = compile(data, "<made during the call>", "exec", dont_inherit=True)
        else:
            code = marshal.loads(data)
    except Exception:  # noqa: BLE001 - text that is no program, data that is no code
        return None
    if not isinstance(code, types.CodeType):
        return None
    for inner in _nested(code):
        if len(inner.co_code) >= TELLING_BYTES:
            label = _judged_copy(marshal.dumps(inner), names)
            if label is not None:
                return f"{label}, made while your function ran"
    return None


_judged: dict = {}


def _remember(names: tuple, codes: dict) -> None:
    """What the answers ``names`` look like (``codes``: their code, not disarmed), for
    :func:`_judged_copy`: what a copy's key would be, and the long answers' shapes."""
    if names not in _judged:
        telling = {_key(code): label for code, label in codes.items() if _telling(code)}
        _judged[names] = (telling, _shapes(codes))


def _judged_copy(blob: bytes, names: tuple) -> str | None:
    """The answer (of ``names``) whose copy the marshalled code object ``blob`` is, or None.
    Worked out in the judging process, never on the rank."""
    key = (blob, names)
    if key not in _judged:
        if names not in _judged:  # (a check that watches here remembered them undisarmed)
            _remember(names, code_objects(names))
        telling, shapes = _judged[names]
        code = marshal.loads(blob)
        if not isinstance(code, types.CodeType):
            raise TypeError("not a code object")
        label = telling.get(_key(code))
        if label is None and len(code.co_code) >= TELLING_BYTES:  # whatever its name
            label = _copy_of(code, shapes, cache={})
        _judged[key] = label
    return _judged[key]


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
            + "        raise __import__('overlapkit.sandbox.answers', fromlist=['refused'])"
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
        for fn in _answer(_resolve(dotted)):
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
    if _sightings_pipe() is None:  # the judging side: the answers' code as it is now, whole
        _remember(tuple(names), codes)
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
        if _sightings_pipe() is None:
            sys.setprofile(before)
            threading.setprofile(before_threads)
        # else a check's rank: the watch stays on until the rank's value has left it (see
        # _judge: code of the learner's that runs after its call is noted)


@plaindata.allow  # raised on a rank, rebuilt by name in the caller
class AnswerRan(RuntimeError):
    """A rank ran the kit's own answer during the learner's function (one text argument,
    so that it travels back from a rank like any exception)."""

    @classmethod
    def on(cls, rank: int, ran: list[str]) -> AnswerRan:
        return cls(f"rank {rank} {said(ran)}")


#: what a watch notes when the learner's function took the watch away
TAMPERED = "sys.setprofile"
#: the check's functions that run the kit's answer on a rank between two watched calls of
#: the learner's (:func:`between_blocks`)
_BETWEEN_BLOCKS: set = set()


def between_blocks(fn):
    """Mark ``fn`` (a check's, run on a rank) as calling the kit's answers between two
    ``running`` blocks: lab 00 times the kit's ping-pong between the learner's. Elsewhere
    an answer that starts after a block has closed fails the check."""
    _BETWEEN_BLOCKS.add(fn.__code__)
    return fn


#: what a watch notes when the learner's code ran a process group's own operation
GROUP = "torch's {} (called on a process group directly)"


#: what :func:`traffic.recording` notes when the learner's code changed its record
RECORD = "traffic record"
#: what a check notes when a rank's watch was cut off (the rank ended with :data:`CUT`)
CUT_OFF = "watch cut off"


def cut_off(exc: BaseException) -> bool:
    """Whether a launch failed because a rank's watch was cut off (:data:`CUT`)."""
    return getattr(exc, "died", False) and getattr(exc, "exitcode", None) == CUT


def said(ran: list[str]) -> str:
    """What a learner is told about the answers ``ran`` (non-empty)."""
    if CUT_OFF in ran:
        return ("cut off the check's watch (its pipe out of the process closed or replaced, "
                "or its state interfered with), which ended the process: the check cannot see "
                "what ran, so it fails")  # fmt: skip
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
