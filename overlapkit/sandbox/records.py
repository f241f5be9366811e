"""What a lab's own helpers measured in a notebook, noted so a check can tell a number
that was measured from one that was typed.

A lab's measuring helper (lab 10's ``measure()``) notes each result here, in the
notebook's process; the lab's check compares the learner's table with the notes: a row
that no note holds was not measured there. The grader's judge reads (:func:`restore`) the
notes its witness took.

In a notebook this is not a seal: code in the notebook can write a note too (and could as
well print a ✔ of its own). Under ``python -m overlapkit.grade`` it is: the lab's
measurements are taken by the grader's witness, a process outside the kernel, and the
judge reads the witness's notes, never the kernel's (:mod:`.witness`).
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
