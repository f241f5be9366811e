"""Checks for collective exercises (labs 01-03): AllReduce, ReduceScatter, AllGather.

Each check runs the learner's function on several world sizes (3 included) and
awkward sizes (1 element, fewer elements than ranks, not divisible by the world
size), compares every rank's result with the truth, and says exactly what
differs: world size, size, rank, chunk and element, expected vs got. With
``from_scratch=True`` it also fails a function that calls a built-in
collective (or the kit's own) instead of sending and receiving. A hanging
attempt is stopped at ``timeout`` and the report says where each rank waited.

Inputs are small integers stored as floats, so sums are exact in any order and
the numbers in a message are readable.
"""

from __future__ import annotations

import torch

from ..collectives import chunk_bounds
from .common import run_or_report
from .report import Report

WORLD_SIZES = (2, 3, 4)


def _sizes(world: int) -> list[int]:
    return sorted({1, max(1, world - 1), world, 7, 1031})


def _input(rank: int, numel: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(-9, 10, (numel,), generator=g).float()


def _call(fn, op, *tensors):
    return fn(*tensors) if op == "sum" else fn(*tensors, op=op)


def _truth(world, numel, salt, op):
    stack = torch.stack([_input(r, numel, salt) for r in range(world)])
    return {
        "sum": stack.sum(0),
        "max": stack.amax(0),
        "min": stack.amin(0),
        "product": stack.prod(0),
        "avg": stack.sum(0) / world,
    }[op]


def _run_all_reduce(fn, op):
    import overlapkit as ok

    me, world, out = ok.rank(), ok.world_size(), []
    for salt, numel in enumerate(_sizes(world)):
        t = _input(me, numel, salt)
        returned = _call(fn, op, t)
        out.append((numel, t, returned if isinstance(returned, torch.Tensor) else None))
    return out


def _run_reduce_scatter(fn, op):
    import overlapkit as ok

    me, world, out = ok.rank(), ok.world_size(), []
    for salt, per_rank in enumerate(_sizes(world)):
        output = torch.full((per_rank,), float("nan"))
        _call(fn, op, output, _input(me, per_rank * world, salt))
        out.append((per_rank, output, None))
    return out


def _run_all_gather(fn, op):
    import overlapkit as ok

    me, world, out = ok.rank(), ok.world_size(), []
    for salt, per_rank in enumerate(_sizes(world)):
        output = torch.full((per_rank * world,), float("nan"))
        fn(output, _input(me, per_rank, salt))
        out.append((per_rank, output, None))
    return out


def _first_difference(got: torch.Tensor, want: torch.Tensor, bounds):
    """(index, chunk) of the first element that differs, or None."""
    bad = ~torch.isclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=False)
    if not bad.any():
        return None
    i = int(bad.nonzero()[0])
    chunk = next(c for c, (lo, hi) in enumerate(bounds) if lo <= i < hi)
    return i, chunk


def _first_problem(results, world, expected, op, from_scratch) -> str | None:
    """The first thing wrong, rank by rank and case by case, said precisely; None if none."""
    for rank, (cases, traffic) in enumerate(results):
        if from_scratch and traffic.collectives:
            called = ", ".join(sorted(set(traffic.collectives)))
            return f"rank {rank} called {called}: build it from send/recv (isend/irecv) only"
        for salt, (numel, got, returned) in enumerate(cases):
            want, bounds, what = expected(world, rank, numel, salt, op)
            diff = _first_difference(got, want, bounds)
            if diff is None:
                continue
            i, chunk = diff
            lo, hi = bounds[chunk]
            note = ""
            if returned is not None and torch.allclose(returned.reshape(-1).float(), want):
                note = " You returned the right values: the operation must be in place."
            return (
                f"{world} ranks, {what} of {numel} elements: rank {rank}, chunk {chunk} "
                f"(elements {lo}-{hi - 1}) differs first at element {i}: expected "
                f"{want[i].item():g}, got {got[i].item():g}.{note}"
            )
    return None


def _check(name, fn, runner, expected, world_sizes, op, from_scratch, timeout) -> Report:
    report = Report(name)
    for world in world_sizes:
        results = run_or_report(report, f"{name} on {world} ranks", runner, fn, op,
                                world_size=world, timeout=timeout)  # fmt: skip
        if results is None:
            return report
        problem = _first_problem(results, world, expected, op, from_scratch)
        if problem:
            report.fail(problem)
        else:
            sizes = ", ".join(map(str, _sizes(world)))
            report.ok(f"{world} ranks: correct on every rank for sizes {sizes}")
    return report


def check_all_reduce(fn, op: str = "sum", from_scratch: bool = True, world_sizes=WORLD_SIZES,
                     timeout: float = 30.0, name: str | None = None) -> Report:  # fmt: skip
    """Check an in-place AllReduce ``fn(tensor)`` (or ``fn(tensor, op=op)`` for op != "sum")."""

    def expected(world, rank, numel, salt, op):
        return _truth(world, numel, salt, op), chunk_bounds(numel, world), "a tensor"

    name = name or getattr(fn, "__name__", "all_reduce")
    return _check(name, fn, _run_all_reduce, expected, world_sizes, op, from_scratch, timeout)


def check_reduce_scatter(fn, op: str = "sum", from_scratch: bool = True, world_sizes=WORLD_SIZES,
                         timeout: float = 30.0, name: str | None = None) -> Report:  # fmt: skip
    """Check ``fn(output, input)``: output on rank r = op over ranks of chunk r of input."""

    def expected(world, rank, per_rank, salt, op):
        full = _truth(world, per_rank * world, salt, op)
        return full[rank * per_rank : (rank + 1) * per_rank], [(0, per_rank)], "an output"

    name = name or getattr(fn, "__name__", "reduce_scatter")
    return _check(name, fn, _run_reduce_scatter, expected, world_sizes, op, from_scratch, timeout)


def check_all_gather(fn, from_scratch: bool = True, world_sizes=WORLD_SIZES, timeout: float = 30.0,
                     name: str | None = None) -> Report:  # fmt: skip
    """Check ``fn(output, input)``: output = every rank's input, concatenated in rank order."""

    def expected(world, rank, per_rank, salt, op):
        want = torch.cat([_input(r, per_rank, salt) for r in range(world)])
        return want, [(r * per_rank, (r + 1) * per_rank) for r in range(world)], "an output"

    name = name or getattr(fn, "__name__", "all_gather")
    return _check(name, fn, _run_all_gather, expected, world_sizes, "sum", from_scratch, timeout)
