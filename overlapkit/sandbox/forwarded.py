"""The watches a sealed call carries to its rank: whatever watch is open in the caller when
a :class:`~overlapkit.sandbox.sealed.Sealed` call starts also watches that call on its own
rank, and what it saw there is added to the watch's list."""

from __future__ import annotations

import contextlib

#: the watches open right now: (what, list to extend) — see :func:`watching`
OPEN: list[tuple[tuple, list]] = []


@contextlib.contextmanager
def watching(what: tuple, seen: list):
    """While the block runs, a sealed call also watches ``what`` on its rank and appends
    what it saw to ``seen``. ``what``: ``("attr", module, names, prefix)`` (calls of those
    attributes, as :func:`~overlapkit.sandbox.sealed.recorded_calls` records them) or
    ``("answers", names)`` (each time the code of one of the kit's answers ``names``
    starts, under whatever name: ``answers.running``)."""
    OPEN.append((what, seen))
    try:
        yield seen
    finally:
        OPEN.remove((what, seen))
