"""What the grader writes: JSON per notebook, Gradescope's results.json per submission, a
CSV gradebook, and the summary of a class (on stderr)."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

CSV_COLUMNS = ["student", "lab", "exercise", "points", "max_points", "notebook", "note"]


def by_student(results: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in results:
        out.setdefault(r.get("student") or "unknown", []).append(r)
    return out


# --------------------------------------------------------------------------- Gradescope


def gradescope(results: list[dict]) -> dict:
    """Gradescope's results.json for one submission (one student's results): one test per
    exercise (its ✔/✘ lines as ``output``; Gradescope marks it passed when ``score`` is
    ``max_score``), named ``lab: exercise`` when the submission holds more than one lab;
    what concerns a whole notebook (it could not be graded, its notes) goes to ``output``.
    Schema: https://gradescope-autograders.readthedocs.io/en/latest/specs/"""
    tests, output = [], []
    several = len(results) > 1
    for r in results:
        name = r.get("lab") or Path(r["notebook"]).stem
        if r.get("error"):
            output.append(f"{r['notebook']}: not graded: {r['error']}")
        output += [f"{r['notebook']}: {note}" for note in r.get("notes", [])]
        for ex in r["exercises"]:
            tests.append(
                {
                    "name": f"{name}: {ex['name']}" if several else ex["name"],
                    "score": ex["points"],
                    "max_score": ex["max_points"],
                    "output": ex["feedback"],
                }
            )
    out = {"score": round(sum(r["score"] for r in results), 4), "tests": tests}
    seconds = [r["seconds"] for r in results if "seconds" in r]
    if seconds:
        out["execution_time"] = round(sum(seconds))
    if output:
        out["output"] = "\n".join(output)
    return out


def write_gradescope(results: list[dict], output: Path, folder: bool) -> list[Path]:
    """One results.json at ``output`` (one submission), or with ``folder`` one per student:
    ``output/<student>/results.json``. Returns the files written."""
    groups = by_student(results) if folder else {"": results}
    written = []
    for student, rs in groups.items():
        path = output / student / "results.json" if folder else output
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(gradescope(rs), indent=2, ensure_ascii=False) + "\n")
        written.append(path)
    return written


# --------------------------------------------------------------------------- CSV gradebook


def failing_line(ex: dict) -> str:
    """Why an exercise lost points: its first ✘ line, else its first line (the reason it
    was not graded); empty when it scored full marks."""
    if ex["points"] >= ex["max_points"]:
        return ""
    lines = [ln.strip() for ln in ex["feedback"].splitlines() if ln.strip()]
    return next((ln for ln in lines if ln.startswith("✘")), lines[0] if lines else "no feedback")


def csv_rows(results: list[dict]) -> list[dict]:
    """A long gradebook: one row per (student, lab, exercise), then a ``total`` row per
    (student, lab); ``note`` holds the first failing line, or for a total the reason the
    notebook was not graded and its notes."""
    rows = []
    for r in results:
        base = {
            "student": r.get("student") or "",
            "lab": r.get("lab") or "",
            "notebook": r["notebook"],
        }
        for ex in r["exercises"]:
            rows.append(
                {
                    **base,
                    "exercise": ex["name"],
                    "points": ex["points"],
                    "max_points": ex["max_points"],
                    "note": failing_line(ex),
                }
            )
        notes = ([f"not graded: {r['error']}"] if r.get("error") else []) + r.get("notes", [])
        rows.append(
            {
                **base,
                "exercise": "total",
                "points": r["score"],
                "max_points": r["max_score"],
                "note": "; ".join(notes),
            }
        )
    return rows


def write_csv(results: list[dict], stream) -> None:
    writer = csv.DictWriter(stream, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(csv_rows(results))


# --------------------------------------------------------------------------- summary


def summary(results: list[dict], width: int = 90) -> str:
    """A class at a glance: per lab and exercise the number graded, mean, min and max
    points, and the most common failing line (with how many had it); then the notebooks
    that could not be graded, by reason."""
    per: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        for ex in r["exercises"]:
            per.setdefault((r.get("lab") or Path(r["notebook"]).stem, ex["name"]), []).append(ex)
    head = ("lab", "exercise", "n", "mean", "min", "max", "of", "most common failing line")
    rows = []
    for (lab, name), exs in per.items():
        points = [ex["points"] for ex in exs]
        fails = Counter(failing_line(ex) for ex in exs if failing_line(ex))
        common = ""
        if fails:
            line, count = fails.most_common(1)[0]
            line = line if len(line) <= width else line[: width - 1] + "…"
            common = f"({count}/{len(exs)}) {line}"
        rows.append(
            (
                lab,
                name,
                str(len(exs)),
                f"{sum(points) / len(points):.2f}",
                f"{min(points):g}",
                f"{max(points):g}",
                f"{exs[0]['max_points']:g}",
                common,
            )
        )
    students = len({r.get("student") for r in results})
    lines = [f"summary: {len(results)} notebooks, {students} students"]
    if rows:
        widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head) - 1)]
        for row in [head, *rows]:
            cells = [
                c.rjust(w) if 2 <= i <= 6 else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=False))
            ]
            lines.append("  ".join([*cells, row[-1]]).rstrip())
    errors = Counter(r["error"] for r in results if r.get("error"))
    for error, count in errors.most_common():
        lines.append(f"not graded ({count}): {error}")
    return "\n".join(lines)
