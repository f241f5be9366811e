"""Checks for lab 01: the exact number of bytes each rank moves in the ring collectives."""

from __future__ import annotations

import math

from ..costmodel import bytes_moved_per_rank
from .report import Report

CASES = [
    ("all_reduce", 1000, 4),
    ("all_reduce", 1000, 1),
    ("all_reduce", 2**20, 8),
    ("reduce_scatter", 1000, 4),
    ("all_gather", 1000, 4),
    ("all_gather", 3000, 3),
    ("all_reduce", 64e6, 1024),
]


def check_bytes_moved(bytes_moved) -> Report:
    """Check ``bytes_moved(collective, nbytes, world)``: bytes each rank sends in the ring."""
    report = Report("bytes_moved")
    for collective, nbytes, world in CASES:
        label = f"bytes_moved({collective!r}, {int(nbytes):,}, {world})"
        try:
            got = bytes_moved(collective, nbytes, world)
        except NotImplementedError:
            report.fail(
                f"{label}: not implemented yet (the function still raises NotImplementedError)"
            )
            return report
        except Exception as exc:
            report.fail(f"{label} raised {type(exc).__name__}: {exc}")
            continue
        want = bytes_moved_per_rank(collective, nbytes, world)
        if isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9):
            report.ok(f"{label} = {want:,.0f}")
            continue
        hint = ""
        if (
            isinstance(got, (int, float))
            and world > 1
            and math.isclose(got, want * world, rel_tol=1e-9)
        ):
            hint = " That is the total over all ranks; the question is per rank."
        elif isinstance(got, (int, float)) and math.isclose(
            got, nbytes * (world - 1), rel_tol=1e-9
        ):
            hint = " Each step moves one chunk of S/N bytes, not the whole tensor."
        elif (
            isinstance(got, (int, float))
            and collective == "all_reduce"
            and math.isclose(got, want / 2, rel_tol=1e-9)
        ):
            hint = (
                " That is one phase: an AllReduce is a ReduceScatter and then an AllGather, "
                "N − 1 steps each."
            )
        elif isinstance(got, (int, float)) and math.isclose(got, want * 8, rel_tol=1e-9):
            hint = " That is in bits: the question is in bytes."
        report.fail(f"{label}: expected {want:,.0f}, got {got!r}.{hint}")
    return report
