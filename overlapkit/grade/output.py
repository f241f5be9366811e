"""What the grader writes: JSON per notebook, Gradescope's results.json."""

from __future__ import annotations

from pathlib import Path


def gradescope(results: list[dict]) -> dict:
    """Gradescope's results.json: one test per exercise."""
    tests = []
    for r in results:
        name = Path(r["notebook"]).stem
        if r.get("error"):
            tests.append({"name": name, "score": 0, "max_score": 0, "output": r["error"]})
        for ex in r["exercises"]:
            tests.append({"name": f"{name}: {ex['name']}", "score": ex["points"],
                          "max_score": ex["max_points"], "output": ex["feedback"]})  # fmt: skip
    return {"score": round(sum(r["score"] for r in results), 4), "tests": tests}
