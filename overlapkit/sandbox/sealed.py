"""A student's exercise as the grader's judge holds it: sealed bytes that run only on ranks.

The judge (``python -m overlapkit.grade``'s check process) decides verdicts, so no code of
the student's may run there — not the function, not a ``__reduce__`` hidden in its
pickle, not a method of a value it returns. The judge therefore never unpickles the
student's objects. It holds a :class:`Sealed` in their place, and the checks use it as
they would the function itself:

* passed to ``ok.launch`` (as every multi-rank check does), it unpickles on the rank —
  where the student's code runs anyway — into the student's object;
* called (a single-process exercise: a schedule, a bucket assignment, a formula), it runs
  on a rank of its own (:func:`call`) and its value comes back as plain data
  (``overlapkit.plaindata``), with whatever the check was watching meanwhile (calls of
  the kit's own answer, by name or by its code running) recorded there and handed back.

Outside the grader (a notebook's check cell) the checks get the learner's real function
and none of this runs.
"""

from __future__ import annotations

import _thread
import contextlib
import gc
import importlib
import os
import sys

import cloudpickle

from .. import plaindata
from . import forwarded

#: a single-process exercise's call on its rank: microseconds of work, but a rank that
#: starts beside a loaded machine's other work (load 7 on 2 cores) once took over 30 s
CALL_TIMEOUT_S = 60.0


class Sealed:
    """A student's function or class, as bytes; ``name`` is what the notebook called it."""

    def __init__(self, name: str, data: bytes | None, shown: str | None = None):
        self.name, self.data = name, data
        self.__name__ = self.__qualname__ = shown or name
        self.hung: float | None = None  # the limit of a call that did not return
        self.crashed: str | None = None  # how a call's rank ended without returning
        self.unsendable: str | None = None  # why it could not be pickled (see seal())
        self.loud = False  # show what it prints (a notebook's own function: see seal())

    def __reduce__(self):
        # what travels to a rank is the student's own pickle: there it is the object again
        return (cloudpickle.loads, (self.data,))

    def __call__(self, *args, **kwargs):
        return call(self, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<{self.__name__} from the notebook>"


def seal(fn):
    """A learner's single-process function as a check calls it: on a rank of its own, in
    a notebook as under the grader (what it prints is shown). Nothing of the check's is
    then within its reach — not the check's frames and report, nor the values it wants —
    and what it returns comes back as plain data (a ``str`` whose ``==`` always agrees
    does not). Already sealed (the grader's judge), or not a function: as it is."""
    if isinstance(fn, Sealed) or not callable(fn):
        return fn
    from ..launcher import dumps_keeping_filenames  # noqa: PLC0415

    name = getattr(fn, "__name__", None) or "the function"
    try:
        sealed = Sealed(name, dumps_keeping_filenames(fn))
    except Exception as exc:  # noqa: BLE001 - said when it is called
        sealed = Sealed(name, None)
        sealed.unsendable = f"{type(exc).__name__}: {exc}"
    sealed.loud = True
    return sealed


def call(fn, *args, timeout: float = CALL_TIMEOUT_S, **kwargs):
    """``fn(*args, **kwargs)`` on a rank of its own; its value, read as plain data.

    Exceptions come back as their built-in (or kit) type with the rank's text, so a check's
    ``except NotImplementedError`` still works; a call that does not return within
    ``timeout`` seconds raises :class:`TimeoutError`.
    """
    from ..launcher import (  # noqa: PLC0415
        LaunchTimeoutError,
        RankFailedError,
        dumps_keeping_filenames,
        launch,
    )
    from . import answers  # noqa: PLC0415

    name = getattr(fn, "__name__", "the function")
    if getattr(fn, "hung", None) is not None:  # one hang is enough to wait for, not one per case
        raise TimeoutError(f"{name}() did not return within {fn.hung:g} s in an earlier case: "
                           "not called again")  # fmt: skip
    if getattr(fn, "crashed", None) is not None:  # it took its rank down: once is enough
        raise RuntimeError(f"{name}() ended its process in an earlier case ({fn.crashed}): "
                           "not called again")  # fmt: skip
    if getattr(fn, "unsendable", None) is not None:
        raise TypeError(f"{name} cannot be sent to the process the check runs it in: "
                        f"{fn.unsendable} (it must pickle: no open files, locks or sockets "
                        "in what it uses)")  # fmt: skip
    watched = list(forwarded.OPEN)
    reported: list | None = None
    try:
        with plaindata.distrust():  # its value is read as plain data, in a notebook too
            value, reported = launch(
                _call_on_rank,
                dumps_keeping_filenames(fn),
                dumps_keeping_filenames((args, kwargs)),
                [what for what, _ in watched],
                world_size=1,
                timeout=timeout,
                quiet=not getattr(fn, "loud", False),
            )[0]
    except LaunchTimeoutError:
        if isinstance(fn, Sealed):
            fn.hung = timeout
        raise TimeoutError(f"{name}() did not return within {timeout:g} s") from None
    except RankFailedError as exc:
        if answers.cut_off(exc):
            raise answers.AnswerRan(f"{name}() {answers.said([answers.CUT_OFF])}") from None
        if isinstance(fn, Sealed) and exc.died:  # its process ended: it did not raise
            fn.crashed = str(exc)
        unread = "rank 0 returned a value that cannot be read"
        if str(exc).startswith(unread):  # a single-process function has no rank to speak of
            raise TypeError(f"{name}() returned a value that cannot be read"
                            f"{str(exc)[len(unread):]}") from None  # fmt: skip
        raise
    finally:
        # what the rank's watches sent out as they saw it, raised or not; with what the
        # rank says at its end, which can add to that but not take from it
        _record(watched, reported)
    return value


def _record(watched: list, reported) -> None:
    from ..launcher import heard  # noqa: PLC0415
    from . import answers  # noqa: PLC0415

    said = _as_lists(reported, len(watched))
    answers_watched = [what[1] for what, _ in watched if what[0] == "answers" and what[1]]
    sent = heard()
    if sent is None:
        seen = [[] for _ in answers_watched]
    else:
        messages, garbled = sent
        seen = answers.seen_by_watches(messages.get(0, []), 0 in garbled, answers_watched)
    sent_lists = iter(seen)
    for (what, into), got in zip(watched, said, strict=True):
        if what[0] == "answers" and what[1]:
            got = next(sent_lists) + got
        into.extend(got)


def _as_lists(seen, n: int) -> list[list]:
    """What the rank says it saw: n lists of strings (anything else counts as nothing)."""
    if not isinstance(seen, list) or len(seen) != n:
        return [[] for _ in range(n)]
    return [[x for x in s if isinstance(x, str)] if isinstance(s, list) else [] for s in seen]


@contextlib.contextmanager
def recorded_calls(root, names, prefix: str = ""):
    """Replace the attributes ``names`` of ``root`` (dotted: ``"pipeline.make_schedule"``)
    by wrappers that record each call (``prefix + name``) and call through; yields the
    list of calls, and puts the originals back on exit."""
    called, saved = [], []
    for dotted in names:
        *path, attr = dotted.split(".")
        owner = root
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, attr)

        def recorder(*args, _name=prefix + dotted, _fn=original, **kwargs):
            called.append(_name)
            return _fn(*args, **kwargs)

        saved.append((owner, attr, original))
        setattr(owner, attr, recorder)
    try:
        # a sealed student function called meanwhile records the same on its own rank
        with forwarded.watching(("attr", root.__name__, list(names), prefix), called):
            yield called
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


def _call_on_rank(fn_bytes: bytes, args_bytes: bytes, watch: list):
    """On the rank: start watching, then unpickle the student's function (so a name it
    imported is the watched one) and call it; returns (value, what each watch saw)."""
    from . import answers, nosockets  # noqa: PLC0415

    # nothing to ask another process for the answer, no program to start (a fresh
    # interpreter is neither watched nor disarmed)
    nosockets.forbid_new_sockets(no_exec=True)
    with contextlib.ExitStack() as stack:
        seen = []
        for what in watch:
            if what[0] == "attr":
                _, module, names, prefix = what
                root = importlib.import_module(module)
                seen.append(stack.enter_context(recorded_calls(root, names, prefix)))
            else:
                seen.append(stack.enter_context(answers.running(what[1])))
        fn = cloudpickle.loads(fn_bytes)
        args, kwargs = cloudpickle.loads(args_bytes)
        value = call_guarded(fn, args, kwargs)
    # read once every watch has closed (and added what it saw at its end: a list emptied
    # by the learner's function is noted then), not inside the block
    return value, [list(s) for s in seen]


def call_guarded(fn, args, kwargs, files: bool = True):
    """``fn(*args, **kwargs)`` under :func:`_guard_the_call`'s hook; what the hook refused
    is raised as a PermissionError, also where the learner's code caught the refusal (then
    the work was not done here)."""
    _guard_the_call(files)
    try:
        value = _the_call(fn, args, kwargs)
    except Exception as exc:
        if _REFUSED:  # what the guard refused says more than what it became
            raise PermissionError(_REFUSED[0]) from exc
        raise
    if _REFUSED:
        raise PermissionError(_REFUSED[0])
    return value


def _the_call(fn, args, kwargs):
    """The learner's call: while this frame is on the stack, :func:`_guard_the_call`'s hook
    refuses what an exercise never needs (its frame cannot be taken off the stack)."""
    return fn(*args, **kwargs)


_GUARDED = (
    "sys.setprofile",
    "sys.settrace",
    "open",
    "object.__setattr__",
    "gc.get_objects",
    "gc.get_referrers",
    "gc.get_referents",
    # C code called through ctypes: a thread started from C runs Python no profile function
    # watches (pthread_create), and memory read by address bypasses
    # every guard of the watch's state
    "ctypes.dlopen",
    "ctypes.dlsym",
    "ctypes.dlsym/handle",
    "ctypes.call_function",
    "ctypes.cdata",
    "ctypes.cdata/buffer",
    "ctypes.addressof",
    "ctypes.string_at",
    "ctypes.wstring_at",
)
#: the audit events of switching the profiler (refused after the call too, see the hook)
_PROFILERS = frozenset({"sys.setprofile", "sys.settrace"})
#: the audit events of code made while the call runs (answers.code_made_meanwhile)
_MAKES_CODE = frozenset({"compile", "exec", "marshal.loads", "code.__new__"})
#: what the guard refused during the call, in words (a caught refusal still counts)
_REFUSED: list[str] = []


def _guard_the_call(files: bool = True) -> None:
    """An audit hook (PEP 578: it cannot be removed, and fires however a call is reached,
    ``functools.partial(sys.setprofile, None)`` too) that refuses, while the learner's
    call runs (in any thread): switching the watch (the profiler) off or another on, but
    where a new thread takes the watch on (``answers`` starts every thread under it, the
    kit's communication worker carries it to each task); giving a function other code
    (``f.__code__ = …``: the disarmed answers' own code put back); and, with ``files``,
    opening the kit's own files (a fresh copy of one of its modules is not disarmed). In
    lab 12, the profiler switched off through a partial, then ``costmodel`` loaded afresh
    from its file, would pass the check; in lab 13, on a check's ranks, the profiler
    switched off and the answers re-armed through ``__code__``. (The ranks of a recorded
    check import the kit's modules lazily, so there ``files`` is off: a copy loaded
    afresh is still recognised by the watch, which can no longer be switched off.)"""
    import threading  # noqa: PLC0415

    import overlapkit  # noqa: PLC0415

    from . import answers  # noqa: PLC0415

    kit = os.path.dirname(os.path.realpath(overlapkit.__file__)) + os.sep
    main = threading.get_ident()  # the call runs in this thread
    inside = _inside_the_call(main)
    takes_the_watch_on = _watch_takers()
    guarded = (kit, files, answers.library()[1], takes_the_watch_on)
    made = answers.code_made_meanwhile()
    # what may move the profiler once the call is over: on a check's rank the watch stays
    # on until the rank's value has left (answers.running), so that a finaliser or a handle
    # the rank waits for at its end cannot switch it off and run the kit's answer unseen
    moves_the_watch = {*takes_the_watch_on, answers.running.__wrapped__.__code__}

    def hook(event, args):
        if event in _MAKES_CODE:
            if inside():
                made(event, args, sys._getframe(1).f_code.co_filename)
            return
        if event in _PROFILERS and not inside():
            if sys._getframe(1).f_code in moves_the_watch:
                return
            raise _refusal(RuntimeError, f"your code called {event} after your function had "
                           "returned: the check's watch stays the profiler until the rank's "
                           "value has left")  # fmt: skip
        if event not in _GUARDED or not inside():
            return
        elsewhere = threading.get_ident() != main
        refused = _refusal_of(event, args, sys._getframe(1), elsewhere, guarded)
        if refused is not None:
            raise refused

    sys.addaudithook(hook)


def _inside_the_call(main: int):
    """``inside()``: is the learner's call running (seen from the thread that runs it,
    ``main``)? Called by the guard's hook, from the frame of the audited operation."""
    import threading  # noqa: PLC0415

    marker = _the_call.__code__
    frames_of_threads = _frames_of_threads()

    def inside() -> bool:
        if threading.get_ident() == main:
            frame = sys._getframe(2)
        else:
            frame = frames_of_threads().get(main)
        while frame is not None:
            if frame.f_code is marker:
                return True
            frame = frame.f_back
        return False

    return inside


def _watch_takers() -> set:
    """The code that puts a new thread under the watch: threading's start, ``answers``'
    raw threads, the kit's communication worker."""
    import threading  # noqa: PLC0415

    from ..ordering import worker_code  # noqa: PLC0415
    from . import answers  # noqa: PLC0415

    raw = answers._raw_threads_watched.__wrapped__.__code__
    return {threading.Thread._bootstrap_inner.__code__, *_nested_code(raw, "run"),
            worker_code()}  # fmt: skip


def _refusal(kind: type, text: str) -> BaseException:
    """The exception the guard raises, its text noted (a caught refusal still counts)."""
    _REFUSED.append(text)
    return kind(text)


def _refusal_of(event, args, caller, elsewhere: bool, guarded: tuple) -> BaseException | None:
    """What the guard raises for a guarded ``event`` while the learner's call runs (None:
    let by). ``caller``: the frame of the audited operation; ``elsewhere``: on another
    thread than the call's; ``guarded``: (the kit's directory, ``files``, the code that
    may call C, the code that puts a new thread under the watch)."""
    kit, files, calls_c, takes_the_watch_on = guarded
    if event == "object.__setattr__":
        if args[1] in ("__code__", "__globals__", "__closure__"):
            return _refusal(RuntimeError, f"your function set a function's {args[1]}: while "
                            "it runs, the check's answers keep the code they have")  # fmt: skip
        return None
    if event == "open":
        return _opening(args[0], caller, kit, files)
    if event.startswith("ctypes."):
        frame = caller
        for _ in range(4):  # (through ctypes' own Python: CDLL() opens the library)
            if frame is None:
                break
            if frame.f_code in calls_c:  # the kit's own shared-memory link, timer slack
                return None
            frame = frame.f_back
        return _refusal(RuntimeError, f"your function called C code through ctypes ({event}): "
                        "an exercise never needs it (a thread started from C, or memory read "
                        "by its address, is out of the check's sight)")  # fmt: skip
    if event.startswith("gc."):  # what finds the watch's state by its references
        return _refusal(RuntimeError, f"your function called {event}: an exercise never needs "
                        "the garbage collector's view of the check")  # fmt: skip
    if not (elsewhere and caller.f_code in takes_the_watch_on):
        return _refusal(RuntimeError, f"your function called {event}: while it runs, the "
                        "check's watch is the profiler")  # fmt: skip
    return None


def _opening(path, caller, kit: str, files: bool) -> BaseException | None:
    """What the guard raises when the learner's call opens ``path`` from ``caller``: the
    kit's own files are refused (None: let by)."""
    if isinstance(path, int):
        return None
    try:  # (a link to the kit's file is the kit's file)
        path = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return None
    if not path.startswith(kit):
        return None
    # source lines, read for a warning or a traceback (linecache, tokenize), are
    # refused without a verdict: linecache then shows no line; and a copy of the
    # kit's source taken that way (inspect.getsource) is none to be had
    if caller.f_code.co_filename.endswith(_LINE_READERS):
        return PermissionError("the kit's source is not read while a check runs")
    # without ``files`` (a recorded check's ranks import the kit lazily): only a
    # module already imported, whose fresh copy would not be disarmed (in lab 13,
    # compression.py loaded again under another name and run on a thread
    # started from C, which no profiler watches)
    if not files and not _imported(path[len(kit) :]):
        return None
    return _refusal(PermissionError, f"your function opened the kit's own file "
                    f"{path[len(kit) :]}: an exercise is written, not loaded from the "
                    "kit")  # fmt: skip


def _frames_of_threads():
    """``sys._current_frames``, safe to call from any thread at any time. Up to Python 3.11
    it holds the interpreter's lock on its list of threads while it makes frame objects;
    a garbage collection that one of those allocations starts may free a thread-local,
    which takes that lock again, and the process freezes for good (CPython gh-106883: a
    thread started while a check runs could freeze its rank so). There the
    collector pauses for the call, one caller at a time so that none turns it back on
    under another; the lock is re-entrant, and a nested caller leaves it off."""
    frames = sys._current_frames
    if sys.version_info >= (3, 12):  # collections start only between instructions there
        return frames
    lock, isenabled, disable, enable = _thread.RLock(), gc.isenabled, gc.disable, gc.enable

    def paused():
        with lock:
            was = isenabled()
            disable()
            try:
                return frames()
            finally:
                if was:
                    enable()

    return paused


_LINE_READERS = (os.sep + "linecache.py", os.sep + "tokenize.py")


def _imported(relative: str) -> bool:
    """Whether the kit's file at ``relative`` (to the package: ``compression.py``,
    ``grading/__pycache__/lab13.cpython-311.pyc``) is a module already imported."""
    parts = relative.split(os.sep)
    if "__pycache__" in parts:
        parts = [*parts[: parts.index("__pycache__")], parts[-1].split(".")[0]]
    else:
        parts[-1] = parts[-1].rsplit(".", 1)[0]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["overlapkit", *parts]) in sys.modules


def _nested_code(code, name: str) -> list:
    """The code objects called ``name`` defined (at any depth) inside ``code``."""
    found = []
    for const in code.co_consts:
        if hasattr(const, "co_consts"):
            found += [const] if const.co_name == name else []
            found += _nested_code(const, name)
    return found
