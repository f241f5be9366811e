"""The answers *disarmed*: while a learner's call runs, each of their functions gets code
that refuses to run (it notes the answer in every open watch and raises
:class:`~overlapkit.sandbox.told.AnswerRan`). That reaches every thread of the process and
every process forked from it, whatever turned the watch off."""

from __future__ import annotations

import contextlib
import types

from .codes import _answer_functions
from .told import AnswerRan

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
            + "        raise __import__('overlapkit.sandbox.disarm', fromlist=['refused'])"
            + f".refused({label!r})\n"
        )
        outer = compile(source, f"<the kit's answer {label}, disarmed>", "exec").co_consts[0]
        _refusals[key] = next(c for c in outer.co_consts if isinstance(c, types.CodeType))
    return _refusals[key]


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
