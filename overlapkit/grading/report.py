"""What a check prints: one ✔/✘ line per case, and a score.

Lines print as the cases run (a learner sees progress), and every ✔ line is
deterministic, so a notebook's check-cell output can be compared by nbval.
Failure lines carry the numbers that differ.
"""

from __future__ import annotations

import sys


class Report:
    """The outcome of one exercise check."""

    def __init__(self, exercise: str, file=None):
        self.exercise = exercise
        self.cases: list[tuple[bool, str]] = []
        self._file = file
        #: why the exercise earns nothing whatever its ✔ lines (a check whose ✔ lines
        #: only confirm what its goal is judged on sets it when the goal is missed)
        self.void: str | None = None

    def _print(self, line: str) -> None:
        print(line, file=self._file or sys.stdout, flush=True)

    def ok(self, message: str) -> None:
        self.cases.append((True, message))
        self._print(f"✔ {message}")

    def fail(self, message: str) -> None:
        self.cases.append((False, message))
        self._print(f"✘ {message}")

    def check(self, condition: bool, passed: str, failed: str) -> bool:
        (self.ok if condition else self.fail)(passed if condition else failed)
        return condition

    @property
    def passed(self) -> int:
        return sum(ok for ok, _ in self.cases)

    @property
    def total(self) -> int:
        return len(self.cases)

    @property
    def score(self) -> float:
        """Fraction of cases passed (0 when nothing ran, or when :attr:`void`)."""
        if self.void is not None:
            return 0.0
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    def __repr__(self) -> str:
        void = f"; it scores 0: {self.void}" if self.void is not None else ""
        return f"{self.exercise}: {self.passed}/{self.total} checks passed{void}"

    def to_dict(self) -> dict:
        return {
            "exercise": self.exercise,
            "passed": self.passed,
            "total": self.total,
            "score": self.score,
            "cases": [{"passed": ok, "message": m} for ok, m in self.cases],
        }
