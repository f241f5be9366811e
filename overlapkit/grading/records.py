"""What a lab's own helpers measured in a notebook, noted so a check can tell a number
that was measured from one that was typed.

A lab's measuring helper (lab 10's ``measure()``) notes each result here, in the
notebook's process; the lab's check compares the learner's table with the notes: a row
that no note holds was not measured there. ``python -m overlapkit.grade`` carries the
notes from the notebook's kernel to its judge as plain data (:func:`plain`, then
:func:`restore` there).

Not a seal: code in the notebook can write a note too. A note must still agree with what
the check re-measures, so forging one is no shorter than measuring; what notes stop is the
guess (a plausible table typed in, or copied from someone else's run).
"""

from __future__ import annotations

_PLAIN = (str, int, float, bool, type(None))

#: kind (e.g. "lab10.measure") -> the entries noted, oldest first
NOTES: dict[str, list[dict]] = {}


def note(kind: str, entry: dict) -> None:
    """Note one result of ``kind`` (a dict of plain values)."""
    NOTES.setdefault(kind, []).append(_plain_entry(entry))


def noted(kind: str) -> list[dict]:
    """Every entry of ``kind`` noted so far (in this process, or restored into it)."""
    return list(NOTES.get(kind, []))


def plain() -> dict:
    """The notes as plain data (what the grader saves from a notebook's kernel)."""
    return {str(k): [_plain_entry(e) for e in v if isinstance(e, dict)]
            for k, v in NOTES.items() if isinstance(v, list)}  # fmt: skip


def restore(notes) -> None:
    """In the judge: the notes a notebook left, read as plain data; anything else is
    dropped (a notebook that broke its notes has measured nothing)."""
    NOTES.clear()
    if isinstance(notes, dict):
        for kind, entries in notes.items():
            if isinstance(kind, str) and isinstance(entries, list):
                NOTES[kind] = [_plain_entry(e) for e in entries if isinstance(e, dict)]


def _plain_entry(entry: dict) -> dict:
    """Only plain values, one level of dicts deep (a configuration inside an entry)."""

    def value(v):
        if isinstance(v, dict):
            return {str(k): (x if type(x) in _PLAIN else repr(x)) for k, x in v.items()}
        return v if type(v) in _PLAIN else repr(v)

    return {str(k): value(v) for k, v in entry.items()}
