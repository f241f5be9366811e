"""Checks for lab 01: an AllReduce made of ReduceScatter + AllGather, and the exact
number of bytes each rank moves in the ring collectives.

The AllReduce is checked by :func:`~overlapkit.grading.check_all_reduce` with
``made_of=("reduce_scatter", "all_gather")``; this module holds what that adds: which
collectives each call of the learner's function calls (each call once, not those the
kit calls inside it), the refusal of ReduceScatter / AllGather sizes that do not fit
(gloo stops the whole process on them, with a fatal check that says nothing of
padding), and the messages.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import threading

import torch

from ..costmodel import bytes_moved_per_rank
from ..sandbox.sealed import seal
from .cases import not_reached
from .common import Unfinished, call_or_report, plain_number
from .exercises import answers_of
from .report import Report
from .traffic import COLLECTIVES, KIT_COLLECTIVES

#: the collectives an AllReduce may be ``made_of``, by the names a learner calls them:
#: torch.distributed's (every spelling, also through distributed_c10d), ok.builtin's, the kit's
PARTS = {
    "reduce_scatter": ("dist.reduce_scatter", "dist.reduce_scatter_tensor",
                       "dist.reduce_scatter_single", "ok.builtin.reduce_scatter_tensor",
                       "ok.ring_reduce_scatter"),
    "all_gather": ("dist.all_gather", "dist.all_gather_into_tensor", "dist.all_gather_single",
                   "ok.builtin.all_gather_tensor", "ok.ring_all_gather"),
}  # fmt: skip
PART_NAMES = {"reduce_scatter": "ReduceScatter", "all_gather": "AllGather"}
#: what an AllReduce made of parts must not call: an AllReduce
WHOLE = ("dist.all_reduce", "dist.all_reduce_coalesced", "ok.ring_all_reduce",
         "ok.naive_all_reduce", "ok.bucketed_all_reduce")  # fmt: skip
#: tensor collectives whose sizes must fit (gloo stops the process with a fatal check else)
_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_single")
_GATHERS = ("all_gather_into_tensor", "all_gather_single", "all_gather_tensor")
_HOW = (
    "the exercise builds AllReduce from ReduceScatter + AllGather: call "
    "ok.builtin.reduce_scatter_tensor (rank r keeps the sum of chunk r), then "
    "ok.builtin.all_gather_tensor (every rank gets every summed chunk)"
)


def _arg(args, kwargs, index, *names):
    if len(args) > index:
        return args[index]
    return next((kwargs[n] for n in names if n in kwargs), None)


def refuse_misfit(label: str, args, kwargs) -> None:
    """Raise a ValueError that says how the sizes of a ReduceScatter / AllGather call do
    not fit, before gloo sees them (gloo stops the whole process on a misfit)."""
    import torch.distributed as dist  # noqa: PLC0415

    base = label.rsplit(".", 1)[-1]
    lists = ("reduce_scatter", "all_gather")
    if label.startswith("ok.ring") or base not in _SCATTERS + _GATHERS + lists:
        return  # the kit's rings raise their own clear errors
    scatters = base in _SCATTERS + ("reduce_scatter",)
    group = kwargs.get("group")
    if group is None and len(args) > (3 if scatters else 2):
        group = args[3 if scatters else 2]
    try:
        world, me = dist.get_world_size(group), dist.get_rank(group)
    except Exception:  # noqa: BLE001 - not a group: the collective says what is wrong
        return
    first = _arg(args, kwargs, 0, "output", "output_tensor", "tensor_list")
    second = _arg(args, kwargs, 1, "input", "input_tensor", "tensor", "input_list")
    if base in lists:
        parts, mine = (second, first) if scatters else (first, second)
        if not isinstance(parts, (list, tuple)) or not isinstance(mine, torch.Tensor):
            return
        sizes = [t.numel() if isinstance(t, torch.Tensor) else None for t in parts]
        if len(sizes) != world:
            raise ValueError(f"{label}: the list holds {len(sizes)} parts, not N = {world}")
        if scatters and sizes[me] != mine.numel():
            raise ValueError(
                f"{label}: the output has {mine.numel()} elements and this rank's part of the "
                f"input list {sizes[me]}: they must be the same size"
            )
        if not scatters and len(set(sizes) | {mine.numel()}) > 1:
            raise ValueError(
                f"{label}: the list holds parts of {sizes} elements and the input has "
                f"{mine.numel()}: every part must have the same size"
            )
        return
    if not (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)):
        return
    if scatters and second.numel() != world * first.numel():
        raise ValueError(
            f"{label}: the input has {second.numel()} elements, not N × the output's: "
            f"{world} × {first.numel()} = {world * first.numel()}"
        )
    if not scatters and first.numel() != world * second.numel():
        raise ValueError(
            f"{label}: the output has {first.numel()} elements, not N × the input's: "
            f"{world} × {second.numel()} = {world * second.numel()}"
        )


def _unwrapped(fn):
    """fn and every function it wraps (functools.wraps' ``__wrapped__`` chain)."""
    seen = []
    while callable(fn) and fn not in seen:
        seen.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return seen


@contextlib.contextmanager
def collective_calls(fn):
    """Wrap the collectives (torch.distributed's, ok.builtin's, the kit's) in this process
    and in ``fn``'s globals (a notebook's ``from torch.distributed import all_reduce``
    binds the function itself); yields the list of those the learner calls in this
    thread, each call once (not those the kit's functions call inside it). Sizes of a
    ReduceScatter / AllGather that do not fit are refused (:func:`refuse_misfit`)."""
    import torch.distributed as dist  # noqa: PLC0415
    import torch.distributed.distributed_c10d as c10d  # noqa: PLC0415

    import overlapkit  # noqa: PLC0415

    from .. import builtin, collectives  # noqa: PLC0415

    calls, inside, me = [], threading.local(), threading.get_ident()

    def wrap(label, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            depth = getattr(inside, "depth", 0)
            if depth == 0 and threading.get_ident() == me:
                calls.append(label)
            refuse_misfit(label, args, kwargs)
            inside.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                inside.depth = depth

        return wrapper

    targets = [((c10d, dist), n, f"dist.{n}") for n in COLLECTIVES + ("all_reduce_coalesced",)]
    targets += [((builtin,), n, f"ok.builtin.{n}") for n in ("reduce_scatter_tensor",
                                                           "all_gather_tensor")]  # fmt: skip
    targets += [((collectives, overlapkit), n, f"ok.{n}") for n in KIT_COLLECTIVES]
    saved, wrapper_of = [], {}
    for modules, name, label in targets:
        if not hasattr(modules[0], name):
            continue  # a spelling this torch does not have
        current = getattr(modules[0], name)
        wrapped = wrap(label, current)
        wrapper_of.update((id(f), wrapped) for f in _unwrapped(current))
        for module in modules:
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, wrapped)
    names = getattr(fn, "__globals__", {})
    for name, value in list(names.items()):
        if callable(value) and id(value) in wrapper_of:
            saved.append((names, name, value))
            names[name] = wrapper_of[id(value)]
    try:
        yield calls
    finally:
        for owner, name, original in reversed(saved):
            if isinstance(owner, dict):
                owner[name] = original
            else:
                setattr(owner, name, original)


def made_of_problem(results, world, made_of) -> str | None:
    """The first case, in the order of the check's sizes, where a rank called an AllReduce
    or left out one of the parts ``made_of``; None if none. ``results``: (rank, cases,
    traffic) triples, a case's fifth item the collectives it called."""
    for salt in range(max((len(cases) for _, cases, _ in results), default=0)):
        for rank, cases, _ in results:
            if salt >= len(cases):
                continue
            numel, calls = cases[salt][0], list(dict.fromkeys(cases[salt][4]))
            where = f"{world} ranks, a tensor of {numel} elements: rank {rank} calls"
            whole = [c for c in calls if c in WHOLE]
            if whole:
                return f"{where} {', '.join(whole)}: {_HOW}, and no AllReduce."
            missing = [PART_NAMES[p] for p in made_of if not set(calls) & set(PARTS[p])]
            if missing:
                said = ", ".join(calls) if calls else "no collective"
                return f"{where} {said}, no {' and no '.join(missing)}: {_HOW}."
    return None


def padding_advice(numel: int, world: int) -> str:
    """What to do with a tensor whose size does not divide by the world size."""
    padded = -(-numel // world) * world
    return (
        f" The tensor of {numel} elements on {world} ranks is not divisible by N: pad it "
        f"with zeros to a multiple of N ({padded} elements) before reduce_scatter_tensor, "
        f"and drop the padding after the AllGather (copy the first {numel} back into "
        "`tensor`)."
    )


CASES = [
    ("all_reduce", 1000, 4),
    ("all_reduce", 1000, 1),
    ("all_reduce", 2**20, 8),
    ("reduce_scatter", 1000, 4),
    ("all_gather", 1000, 4),
    ("all_gather", 3000, 3),
    ("all_reduce", 64e6, 1024),
]


def _bytes_hints(collective: str, nbytes: float, world: int, got, want: float) -> list:
    """What a wrong figure for ``bytes_moved`` may be made of: (kind, hint) for each typical
    mistake it equals, most telling first (one figure may fit more than one)."""
    if got is None:
        return [("none", " The function returned None: return the number of bytes.")]
    if not isinstance(got, (int, float)):
        return [("type", f" That is a {type(got).__name__}: return a number of bytes.")]

    def near(x):
        return math.isclose(got, x, rel_tol=1e-9, abs_tol=1e-9)

    out = []
    if world > 1 and near(want * world):
        out.append(("total", " That is the total over all ranks; the question is per rank."))
    if world > 1 and near(nbytes * (world - 1)):
        out.append(("whole", " Each step moves one chunk of S/N bytes, not the whole tensor."))
    if collective == "all_reduce" and near(want / 2):
        out.append(("phase", " That is one phase: an AllReduce is a ReduceScatter and then an "
                             "AllGather, N − 1 steps each."))  # fmt: skip
    if collective != "all_reduce" and near(want * 2):
        out.append(("two phases", f" That is an AllReduce's figure: a {collective} is one "
                                  "phase, N − 1 steps of one chunk (an AllReduce is two of "
                                  "them)."))  # fmt: skip
    if want and near(want * 2):
        out.append(("both ways", " That is twice the figure: what a rank sends and what it "
                                 "receives, counted together. The question counts what each "
                                 "rank sends; it receives as much again, on the other "
                                 "direction of its link."))  # fmt: skip
    if near(want * 8):
        out.append(("bits", " That is in bits: the question is in bytes."))
    if want and near(want / nbytes):
        out.append(("share", " That is the share of S each rank sends: multiply it by nbytes."))
    if world > 1 and got == 0:
        out.append(("zero", " Nothing moves only with one rank. Is it an integer division? "
                            "(N - 1) // N is 0: use /."))  # fmt: skip
    return out


def _fitting(hints: list[list]) -> list[str]:
    """One hint per wrong line, the same mistake on every line it fits: of each line's
    candidates, the kind that fits the most wrong lines (a tie: the line's own order). A
    figure wrong in one way may equal another mistake's on some lines (twice an AllReduce's
    figure on 4 ranks is also the whole tensor each step)."""
    counts: dict[str, int] = {}
    for line in hints:
        for kind, _ in line:
            counts[kind] = counts.get(kind, 0) + 1
    return [max(line, key=lambda h: counts[h[0]])[1] if line else "" for line in hints]


def check_bytes_moved(bytes_moved) -> Report:
    """Check ``bytes_moved(collective, nbytes, world)``: bytes each rank sends in the ring."""
    report = Report("bytes_moved")
    bytes_moved = seal(bytes_moved)  # called on a rank of its own, out of our reach
    labels = [f"bytes_moved({c!r}, {int(n):,}, {w})" for c, n, w in CASES]
    lines: list = []  # (passed, text, hint candidates): printed once every case has answered
    for k, (collective, nbytes, world) in enumerate(CASES):
        label = labels[k]
        quiet = Report(report.exercise, file=io.StringIO())
        try:
            fine, got = call_or_report(quiet, label, bytes_moved, collective, nbytes, world,
                                       forbid=answers_of("check_bytes_moved"))  # fmt: skip
        except Unfinished:  # the cases after it are not reached: each counts as failed
            lines.append((False, quiet.cases[-1][1], []))
            lines += [(False, not_reached(later), []) for later in labels[k + 1 :]]
            break
        if not fine:
            lines.append((False, quiet.cases[-1][1], []))
            continue
        want = bytes_moved_per_rank(collective, nbytes, world)
        if plain_number(got) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9):
            lines.append((True, f"{label} = {want:,.0f}", []))
            continue
        hints = _bytes_hints(collective, nbytes, world, got, want)
        lines.append((False, f"{label}: expected {want:,.0f}, got {got!r}.", hints))
    wrong = [hints for passed, _, hints in lines if not passed]
    chosen = iter(_fitting(wrong))
    for passed, text, _ in lines:
        (report.ok if passed else report.fail)(text if passed else text + next(chosen))
    return report
