"""Which submissions look copied: from each other, from the kit's own code, from a
reference (the solutions, last term's submissions). A report for a person to read; it
scores nothing.

The checks run a student's code; they cannot tell a classmate's answer handed on, nor a
copy of one of the kit's short answers, from the student's own work (book/grading.md,
"What the checks cannot rule out"). This is the instructor's usual answer to that:
compare the code itself.

    notebook ──► cells that define the lab's exercise names ──► FOLDER/code/<lab>/<student>.py
    lab as handed out ──► the same cells ──► FOLDER/code/given/<lab>/<lab>.py (discounted)
    copydetect: every student against every other, the kit's package and the references
    ──► FOLDER/<lab>.html, and the pairs above the threshold printed

copydetect fingerprints each file's tokens with names and literals made uniform, so
renamed variables and reformatted lines still match (the winnowing MOSS uses); code the
lab handed out is boilerplate and counts for nobody.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

from .. import __file__ as _KIT_INIT
from .kernel import _defines
from .labs import _is_check_cell, exercises_of, identify
from .layout import Submission

KIT = Path(_KIT_INIT).resolve().parent
THRESHOLD = 0.5  # share of a student's tokens found in one other file, from which it is shown


@dataclass
class Pair:
    lab: str
    student: str
    other: str  # a student, "overlapkit/<file> (the kit)", or "<name> (reference)"
    share: float  # of the student's exercise code found in the other file
    other_share: float  # of the other file found in the student's code
    whose: str  # how the other file's share is named: "bob's", "the file's"


def exercise_code(nb: nbformat.NotebookNode, names: list[str]) -> str:
    """The code cells that define one of ``names``, check cells left out."""
    cells = [c.source for c in nb.cells if c.cell_type == "code" and not _is_check_cell(c)
             and _defines(c, names)]  # fmt: skip
    return "\n\n".join(cells) + "\n"


def _safe(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name).strip("_") or "unnamed"


def export(subs: list[Submission], labs: Path, folder: Path, lab=None) -> dict[str, list[Path]]:
    """Write each submission's exercise code to ``folder/<lab>/<student>.py`` and its lab's
    own to ``folder/given/<lab>/<lab>.py``, each lab read once; returns the files per lab.
    The lab is the one ``layout.find`` told (``Submission.lab``); a notebook that cannot be
    read or told apart is skipped with a line on stderr (``lab``: the ``--lab`` given, for
    what that line says)."""
    written: dict[str, list[Path]] = {}
    names: dict[str, list[str]] = {}  # the exercises' names, per lab
    for sub in subs:
        try:
            nb = nbformat.read(sub.path, as_version=4)
        except Exception as exc:  # noqa: BLE001 - say which file, go on with the rest
            print(f"similarity: skipped {sub.path}: cannot be read ({exc})", file=sys.stderr)
            continue
        if sub.lab is None:  # why not: identify says it in full
            why = identify(sub.path, labs, nb.metadata, lab).error
            print(f"similarity: skipped {sub.path}: {why}", file=sys.stderr)
            continue
        if sub.lab not in names:
            given = nbformat.read(labs / f"{sub.lab}.ipynb", as_version=4)
            names[sub.lab] = sorted({n for ex in exercises_of(given) for n in ex.names})
            boiler = folder / "given" / sub.lab / f"{sub.lab}.py"
            boiler.parent.mkdir(parents=True, exist_ok=True)
            boiler.write_text(exercise_code(given, names[sub.lab]), encoding="utf-8")
        out = folder / sub.lab / f"{_safe(sub.student)}.py"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(exercise_code(nb, names[sub.lab]), encoding="utf-8")
        written.setdefault(sub.lab, []).append(out)
    return written


def compare(code: Path, lab: str, references: Path | None, report: Path) -> list[Pair]:
    """Run copydetect on one lab's exported code: the students against each other, the
    kit's package and ``references/<lab>``; writes ``report`` (HTML) and returns the pairs
    at or above :data:`THRESHOLD`, most copied first."""
    try:
        from copydetect import CopyDetector  # noqa: PLC0415
    except ImportError as exc:
        raise SystemExit(
            "the similarity report needs copydetect: pip install 'overlapkit[grade]' "
            "(or pip install copydetect)"
        ) from exc
    refs = [code / lab, KIT] + (
        [references / lab] if references and (references / lab).is_dir() else []
    )
    detector = CopyDetector(
        test_dirs=[str(code / lab)], ref_dirs=[str(r) for r in refs],
        boilerplate_dirs=[str(code / "given" / lab)], extensions=["py"],
        display_t=THRESHOLD, autoopen=False, silent=True, out_file=str(report),
    )  # fmt: skip
    detector.run()
    detector.generate_html_report()
    pairs = []
    for row in detector.get_copied_code_list():
        share, other_share, mine, other = float(row[0]), float(row[1]), Path(row[2]), Path(row[3])
        name = _name(other, code / lab, references)
        whose = f"{name}'s" if other.parent.resolve() == (code / lab).resolve() else "the file's"
        pairs.append(Pair(lab, mine.stem, name, share, other_share, whose))
    return sorted(pairs, key=lambda p: -p.share)


def _name(path: Path, students: Path, references: Path | None) -> str:
    path = path.resolve()
    if path.parent == students.resolve():
        return path.stem
    if path.is_relative_to(KIT):
        return f"overlapkit/{path.relative_to(KIT)} (the kit)"
    if references is not None and path.is_relative_to(references.resolve()):
        return f"{path.stem} (reference)"
    return str(path)


def lines(pairs: list[Pair]) -> list[str]:
    """One line per pair, as printed."""
    return [f"{p.lab}: {p.student} ↔ {p.other}: {p.share:.0%} of {p.student}'s exercise code "
            f"matches, {p.other_share:.0%} of {p.whose}" for p in pairs]  # fmt: skip
