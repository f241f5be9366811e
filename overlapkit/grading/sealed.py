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

import contextlib
import importlib

import cloudpickle

from .. import plaindata

#: a single-process exercise's call on its rank: microseconds of work, but a rank that
#: starts beside a loaded machine's other work (load 7 on 2 cores) once took over 30 s
CALL_TIMEOUT_S = 60.0

#: what the judge is watching right now: (what, list to extend) — see :func:`watching`
_watching: list[tuple[tuple, list]] = []


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


@contextlib.contextmanager
def watching(what: tuple, seen: list):
    """While the block runs, a :class:`Sealed` call also watches ``what`` on its rank and
    appends what it saw to ``seen``. ``what``: ``("attr", module, names, prefix)`` (calls of
    those attributes, as ``common.recorded_calls`` records them) or ``("answers", names)``
    (each time the code of one of the kit's answers ``names`` starts, under whatever name:
    ``answers.running``)."""
    _watching.append((what, seen))
    try:
        yield seen
    finally:
        _watching.remove((what, seen))


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
    watched = list(_watching)
    try:
        with plaindata.distrust():  # its value is read as plain data, in a notebook too
            value, seen = launch(
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
        if isinstance(fn, Sealed) and exc.died:  # its process ended: it did not raise
            fn.crashed = str(exc)
        unread = "rank 0 returned a value that cannot be read"
        if str(exc).startswith(unread):  # a single-process function has no rank to speak of
            raise TypeError(f"{name}() returned a value that cannot be read"
                            f"{str(exc)[len(unread):]}") from None  # fmt: skip
        raise
    for (_, into), got in zip(watched, _as_lists(seen, len(watched)), strict=True):
        into.extend(got)
    return value


def _as_lists(seen, n: int) -> list[list]:
    """What the rank says it saw: n lists of strings (anything else counts as nothing)."""
    if not isinstance(seen, list) or len(seen) != n:
        return [[] for _ in range(n)]
    return [[x for x in s if isinstance(x, str)] if isinstance(s, list) else [] for s in seen]


def _call_on_rank(fn_bytes: bytes, args_bytes: bytes, watch: list):
    """On the rank: start watching, then unpickle the student's function (so a name it
    imported is the watched one) and call it; returns (value, what each watch saw)."""
    from . import answers, nosockets  # noqa: PLC0415
    from .common import recorded_calls  # noqa: PLC0415

    nosockets.forbid_new_sockets()  # nothing to ask another process for the answer
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
        value = fn(*args, **kwargs)
    # read once every watch has closed (and added what it saw at its end: a list emptied
    # by the learner's function is noted then), not inside the block
    return value, [list(s) for s in seen]
