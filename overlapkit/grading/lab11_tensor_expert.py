"""What lab 11's two checks share: the order of a rank's messages and computations, waits
that end at once when no peer can answer them, and the hint a failed case carries."""

from __future__ import annotations

import time

import torch

from .. import handles
from .common import (
    recorded_calls,
    wait_unless_stuck,
)
from .peers import PeersReturned
from .report import Report

# --------------------------------------------------------------------------- shared


def _forbidden(names: dict):
    """Record the learner's calls of the kit functions ``names`` (dotted on overlapkit)."""
    import overlapkit as ok  # noqa: PLC0415

    return recorded_calls(ok, names)


class _Log:
    """Message posts and waits (``ok.p2p`` and ``ok.all_to_all``) and compute calls, in the
    order they happened: one list of (time, event, index). Verdicts read the order (a
    position in the list), never the times, so that they do not depend on the machine's
    speed."""

    def __init__(self):
        self.events: list[tuple[float, str, int]] = []

    def mark(self, event: str, index: int) -> None:
        self.events.append((time.perf_counter(), event, index))

    def wrap_handle(self, handle, event: str, index: int):
        waited = []

        def wait(inner, timeout=None):
            result = inner(timeout)
            if not waited:  # the first wait is when the data was asked for
                waited.append(True)
                self.mark(event, index)
            return result

        # seen however the learner waits (handle.wait(), type(handle).wait(handle))
        return handles.wrap_wait(handle, wait)


def _tensors(args, kwargs) -> list:
    """The tensors among a call's arguments (also inside lists and tuples)."""
    found, todo = [], [*args, *(kwargs or {}).values()]
    while todo:
        a = todo.pop()
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            todo.extend(a)
    return found


def _rank_result(got, called, builtin, log: _Log) -> dict:
    """What a rank's run begins its result with: what it returned, what it called, its log."""
    return {
        "got": got if isinstance(got, torch.Tensor) else repr(got)[:80],
        "called": called,
        "builtin": builtin,
        "events": log.events,
    }


class _Stuck(Exception):
    """A rank waits for a message that its peer, already returned, will never send (or
    never receive): args (what, peer, n, the peer's counts)."""


class _Patient:
    """Counts the messages a rank posts to and from each peer, and waits for them so that
    a wait nobody can answer ends at once, not at the check's timeout: a rank that
    returned from the learner's function leaves how many messages it sent to and received
    from each rank (:class:`~.peers.PeersReturned`); a wait for the n-th message from (or
    to) a rank that returned having sent (received) fewer can never end."""

    def __init__(self, me: int):
        self.me = me
        self.counts: dict = {"send": {}, "recv": {}}
        self.returned = PeersReturned("lab11")

    def wrap(self, handle, kind: str, peer: int):
        mine = self.counts[kind]
        n = mine[peer] = mine.get(peer, 0) + 1
        inner = handle.wait
        other = "recv" if kind == "send" else "send"

        def stuck():
            theirs = self.returned.of(peer)
            if theirs is not None and theirs[other].get(str(self.me), 0) < n:
                raise _Stuck(kind, peer, n, theirs) from None

        def wait(*args, **kwargs):
            if args or kwargs:  # the learner's own timeout
                return inner(*args, **kwargs)
            return wait_unless_stuck(inner, stuck)

        handle.wait = wait
        return handle

    def done(self) -> None:
        self.returned.post(self.me, self.counts)


def _stuck_line(what: str, rank: int, stuck) -> str:
    """What a rank waited for that its peer will never send or receive."""
    kind, peer, n, theirs = stuck
    other = "recv" if kind == "send" else "send"
    k = theirs[other].get(str(rank), 0)
    partners = sorted(int(p) for p in theirs[other] if int(p) != rank)
    also = f" (its {'sends went' if other == 'send' else 'receives came'} " + (
        f"{'to' if other == 'send' else 'from'} rank {', '.join(map(str, partners))})"
        if partners else "nowhere else)")  # fmt: skip
    if kind == "recv":
        waits = (f"waits for message #{n} from rank {peer}, but rank {peer} returned having "
                 f"sent it {k} message(s){also}")  # fmt: skip
    else:
        waits = (f"waits for its message #{n} to rank {peer} to be received, but rank {peer} "
                 f"returned having received {k} message(s) from it{also}")  # fmt: skip
    return f"{what}: rank {rank} {waits}: that wait would never end"


def _hinted(message: str, hint: str) -> str:
    """``message`` with ``hint`` after it: on a line of its own after a traceback, as a
    sentence after a sentence, else after a dash."""
    if not hint:
        return message
    if "\n" in message:
        return f"{message}\n{hint[0].upper()}{hint[1:]}"
    if message.endswith((".", "?")):
        return f"{message} {hint[0].upper()}{hint[1:]}"
    return f"{message} — {hint}"


class _Hinted:
    """A report whose ✘ lines end with ``hint``."""

    def __init__(self, report: Report, hint: str):
        self.report, self.hint = report, hint

    def fail(self, message: str) -> None:
        self.report.fail(_hinted(message, self.hint))

    def ok(self, message: str) -> None:
        self.report.ok(message)


def _compute_calls(events, compute: str) -> list[tuple[int, int | None]]:
    """(start, end) positions in ``events`` of each ``compute`` call."""
    calls: list = []
    for at, (_, e, _) in enumerate(events):
        if e == compute + " start":
            calls.append([at, None])
        elif e == compute + " end" and calls:
            calls[-1][1] = at
    return [tuple(c) for c in calls]


def _in_flight_across(events, issued: str, waited: str, compute: str, only=None) -> list[int]:
    """The ``issued`` messages (those numbered in ``only``, if given) that were in flight,
    posted and not yet waited, across a whole ``compute`` call: their numbers."""
    starts = {i: at for at, (_, e, i) in enumerate(events)
              if e == issued and (only is None or i in only)}  # fmt: skip
    ends: dict = {}
    for at, (_, e, i) in enumerate(events):
        if e == waited:
            ends.setdefault(i, at)
    calls = _compute_calls(events, compute)
    return [
        i for i, a0 in starts.items()
        if any(a > a0 and b is not None and b < ends.get(i, len(events)) for a, b in calls)
    ]  # fmt: skip


def _overlapped(events, issued: str, waited: str, compute: str, only=None) -> int:
    """How many ``issued`` messages (those numbered in ``only``, if given) were in flight,
    posted and not yet waited, across a whole ``compute`` call."""
    return len(_in_flight_across(events, issued, waited, compute, only))


#: the 3-rank case runs once the 2-rank ones passed
_WORLD_HINT = "it passed on 2 ranks and fails on 3: did you write 2 where ok.world_size() belongs?"
