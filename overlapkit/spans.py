"""A span of work on one lane (compute, or communication on a group), and the algebra of
the time intervals spans cover: union, length, intersection and difference, which the
overlap measures of :mod:`overlapkit.timeline` and its pictures are made of."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

COMPUTE = "compute"
COMM = "comm"


def is_comm(lane: str) -> bool:
    """``"comm"``, or a communication lane of one group (``"comm dp"``, ``"comm pp"``):
    what the overlap metrics count and the pictures hatch where hidden under compute."""
    return lane == COMM or lane.startswith(COMM + " ")


@dataclass(frozen=True)
class Span:
    name: str
    start: float  # seconds on the perf_counter clock
    end: float
    lane: str = COMPUTE
    rank: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start


# --------------------------------------------------------------------------- interval algebra


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping intervals into a sorted list of disjoint ones."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(b - a for a, b in union(intervals))


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]):
    """Intersection of two *disjoint sorted* interval lists (two-pointer sweep)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]):
    """Parts of disjoint sorted ``a`` not covered by disjoint sorted ``b``."""
    out = []
    for start, end in a:
        cursor = start
        for bs, be in b:
            if be <= cursor or bs >= end:
                continue
            if bs > cursor:
                out.append((cursor, bs))
            cursor = max(cursor, be)
        if cursor < end:
            out.append((cursor, end))
    return out
