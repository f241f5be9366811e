"""Where the submissions are, and whose they are.

A PATH on the command line is a notebook or a folder; in a folder every ``*.ipynb`` below
it counts (hidden files and folders, ``.ipynb_checkpoints`` and ``__MACOSX`` are skipped),
and where a notebook lies says whose it is:

* ``PATH/name.ipynb`` (a folder of files, one student each): the student is the file's
  stem, ``alice.ipynb`` → ``alice``; a notebook named as a lab (``03_ring_allreduce.ipynb``,
  ``03_ring_allreduce (1).ipynb``) names no student, so it is the folder's (``PATH``'s
  own name). A notebook given as a file is read the same way.
* ``PATH/<student>/*.ipynb`` (a folder per student): the student is the folder's name.
* ``PATH/<student>/<assignment>/*.ipynb`` (nbgrader's ``submitted/``): the student is the
  first folder. A PATH holding a ``submitted/`` folder is an nbgrader course: only
  ``submitted/`` is read.

``--student NAME`` makes every notebook found NAME's (one submission, as on Gradescope).

One result per student and lab: when a student handed in several notebooks of one lab
(found by ``labs.identify``: ``--lab``, the notebook's metadata, its file name), the newest
(by modification time) is graded and its result says which ones were not.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from .labs import identify

_SKIPPED = ("__MACOSX",)
_COPY = re.compile(r"(\s*\(\d+\)|[-_ ]?copy[-_ ]?\d*)+$", re.IGNORECASE)


@dataclass
class Submission:
    """One notebook to grade and whose it is."""

    path: Path
    student: str
    layout: str  # "file", "flat", "per-student", "nbgrader" (student/assignment/notebook)
    lab: str | None = None  # the lab it was made from, where it can be told before grading
    notes: list[str] = field(default_factory=list)


class NothingFound(Exception):
    """A PATH that holds no notebook; the message names it."""


def find(paths: list[str], labs: Path, lab=None, student: str | None = None) -> list[Submission]:
    """Every notebook under ``paths``, with its student; one per student and lab (the
    newest). Raises :class:`NothingFound` naming a PATH with no notebook in it."""
    found: list[Submission] = []
    lab_names = {p.stem.lower() for p in labs.glob("*.ipynb")}
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise NothingFound(f"{given}: no such file or folder")
        if path.is_file():
            found.append(Submission(path, _student_of_file(path, lab_names), "file"))
            continue
        subs = list(_in_folder(path, lab_names))
        if not subs:
            raise NothingFound(
                f"no notebooks in {given} (looked for *.ipynb in it, in a folder per student "
                f"and in nbgrader's submitted/<student>/<assignment>/; hidden files and "
                f".ipynb_checkpoints are skipped)"
            )
        found += subs
    if student is not None:
        for sub in found:
            sub.student = student
    for sub in found:
        sub.lab = _lab_of(sub.path, labs, lab)
    return newest_per_lab(found)


def _in_folder(folder: Path, lab_names: set[str]):
    if (folder / "submitted").is_dir():  # an nbgrader course: its submissions only
        folder = folder / "submitted"
    for path in sorted(folder.rglob("*.ipynb")):
        parts = path.relative_to(folder).parts
        if any(p.startswith(".") or p in _SKIPPED for p in parts) or not path.is_file():
            continue
        if len(parts) == 1:
            yield Submission(path, _student_of_file(path, lab_names), "flat")
        else:
            yield Submission(path, parts[0], "per-student" if len(parts) == 2 else "nbgrader")


def _student_of_file(path: Path, lab_names: set[str]) -> str:
    """A notebook's stem, or, for one named as a lab, the name of the folder it is in."""
    stem = _COPY.sub("", path.stem).strip()
    if stem.lower() in lab_names:
        return path.resolve().parent.name
    return path.stem


def _lab_of(path: Path, labs: Path, lab) -> str | None:
    try:
        metadata = json.loads(path.read_text(encoding="utf-8")).get("metadata", {})
    except (OSError, ValueError, AttributeError):
        metadata = {}
    identity = identify(path, labs, metadata if isinstance(metadata, dict) else {}, lab)
    return identity.path.stem if identity.path is not None else None


def newest_per_lab(subs: list[Submission]) -> list[Submission]:
    """One submission per (student, lab): the newest, with a note naming the others.
    Notebooks whose lab cannot be told are all kept (each is graded, and says why)."""
    groups: dict[tuple, list[Submission]] = {}
    for sub in subs:
        key = (sub.student, sub.lab) if sub.lab else (sub.student, str(sub.path))
        groups.setdefault(key, []).append(sub)
    kept = []
    for (student, lab), group in groups.items():
        group.sort(key=lambda s: (s.path.stat().st_mtime, str(s.path)))
        newest = group[-1]
        if len(group) > 1:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(newest.path.stat().st_mtime))
            older = ", ".join(str(s.path) for s in group[:-1])
            newest.notes.append(
                f"{student} handed in {len(group)} notebooks of {lab}: graded the newest, "
                f"{newest.path} (modified {when}); not graded: {older}"
            )
        kept.append(newest)
    return sorted(kept, key=lambda s: (s.student, s.lab or "", str(s.path)))
