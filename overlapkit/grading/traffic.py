"""Record the messages a rank sends and receives while a learner's function runs.

Checks wrap ``torch.distributed``'s point-to-point calls (and its collectives,
to notice a "from scratch" exercise that calls a built-in) so that feedback can
say "rank 0 sent 3 messages of 8 bytes, expected 8 of 1024" instead of "wrong".
Both spellings a learner may use are covered: ``dist.send(...)`` and
``from torch.distributed import send``, as long as the function is unpickled
after :func:`recording` starts (which :func:`run_recorded` arranges).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from dataclasses import dataclass, field

import cloudpickle
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .. import p2p, plaindata
from ..inflight import debug_races
from ..launcher import hide_frames_from
from ..sandbox import answers, nofiles, nosockets, sealed
from .peers import PeersReturned

P2P = ("send", "recv", "isend", "irecv")
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
)


KIT_COLLECTIVES = (
    "naive_all_reduce",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_all_gather",
    "bucketed_all_reduce",
)


@plaindata.allow  # a rank returns it; data only
@dataclass
class Traffic:
    """Messages of one rank: (peer, bytes) pairs, and the built-in collectives it called."""

    sent: list[tuple[int, int]] = field(default_factory=list)
    received: list[tuple[int, int]] = field(default_factory=list)
    collectives: list[str] = field(default_factory=list)
    #: with ``recording(payloads=True)``: a copy of what each message of ``sent`` carried,
    #: as it was when sent
    payloads: list = field(default_factory=list)
    #: the learner's code changed this record while it ran (the check's own copy replaced it)
    tampered: bool = False
    #: torch.distributed point-to-point calls made directly, not through ok.p2p
    direct: list[str] = field(default_factory=list)
    #: (call, peer, start, end) of each point-to-point message on the host clock
    #: (``time.perf_counter``): a blocking call ends when it returns, an isend/irecv when
    #: its handle's wait() returns (None while never waited)
    timed: list[list] = field(default_factory=list)

    def sent_to(self, peer: int) -> list[int]:
        return [n for p, n in self.sent if p == peer]

    def received_from(self, peer: int) -> list[int]:
        return [n for p, n in self.received if p == peer]


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _peer(args, kwargs, key) -> int:
    if len(args) > 1:
        return int(args[1])
    value = kwargs.get(key, kwargs.get("group_" + key))
    return -1 if value is None else int(value)


_kit_call = threading.local()  # set while an ok.p2p call runs: its inner dist calls are not counted
_timing = threading.local()  # set while a timed point-to-point call runs


_current: list[Traffic] = []  # the recordings running in this process, innermost last


def current() -> Traffic | None:
    """The innermost :func:`recording` running in this process (a check's runner reads the
    messages of each case from it), or None."""
    return _current[-1] if _current else None


class _Record:
    """The :class:`Traffic` a recording fills, and the copy of its own it keeps alongside."""

    def __init__(self, keep_payloads: bool):
        self.traffic = Traffic()
        # the learner's code can reach ``traffic`` (current()): what it records goes into a copy
        # of its own too, which is what the check gets, and a difference says it was changed
        self.kept = Traffic()
        self.keep_payloads = keep_payloads
        # an operation left running (an async op never waited) may still add from its thread
        # while the record is compared: both copies change together, never one alone
        self.lock = threading.Lock()

    def add(self, field: str, value) -> None:
        """Append ``value`` to ``field`` of both copies."""
        with self.lock:
            getattr(self.traffic, field).append(value)
            getattr(self.kept, field).append(value)

    def note(self, name, args, kwargs):
        """Note the message or collective of one call of ``name``."""
        if name in ("send", "isend"):
            tensor = args[0] if args else kwargs["tensor"]
            self.add("sent", (_peer(args, kwargs, "dst"), _nbytes(tensor)))
            if self.keep_payloads:
                self.add("payloads", tensor.detach().clone())
        elif name in ("recv", "irecv"):
            tensor = args[0] if args else kwargs["tensor"]
            self.add("received", (_peer(args, kwargs, "src"), _nbytes(tensor)))
        else:
            self.add("collectives", name)

    def timed(self, name, args, kwargs, call, kit=False):
        """Call a point-to-point function, noting when its message started and ended
        (once: torch's send may call its own isend, which is the same message)."""
        if getattr(_timing, "active", False):
            return call()
        entry = [name, _peer(args, kwargs, "src" if "recv" in name else "dst"),
                 time.perf_counter(), None]  # fmt: skip
        self.add("timed", entry)
        _timing.active = True
        try:
            result = call()
        finally:
            _timing.active = False
        if name in ("send", "recv"):
            entry[3] = time.perf_counter()
        elif kit:  # the kit's own handle keeps its type (checks and p2p look at it)
            result.wait = _timed_wait(result.wait, entry)
        elif result is not None:  # torch's Work takes no attributes: a stand-in
            result = _TimedWait(result, entry)
        return result

    def check_kept(self) -> None:
        """Put the kept copy back in each list the learner's code changed, and say so."""
        traffic = self.traffic
        with self.lock:
            for field in ("sent", "received", "collectives", "direct", "timed", "payloads"):
                seen, mine = getattr(traffic, field), getattr(self.kept, field)
                if len(seen) != len(mine) or any(
                    a is not b for a, b in zip(seen, mine, strict=True)
                ):
                    traffic.tampered = True
                    setattr(traffic, field, list(mine))


def _wrap_dist(record: _Record, name, original):
    """torch.distributed's ``original``, noting each call not made by an ok.p2p call."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if not getattr(_kit_call, "active", False):
            record.note(name, args, kwargs)
            if name in P2P:
                record.add("direct", f"torch.distributed.{name}")
                return record.timed(name, args, kwargs, lambda: original(*args, **kwargs))
        return original(*args, **kwargs)

    return wrapper


def _wrap_kit(record: _Record, name, original):
    """The kit's ``original``, noted as one call, whatever it calls inside."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if getattr(_kit_call, "active", False):  # the kit calling itself (send -> isend)
            return original(*args, **kwargs)
        record.note(name, args, kwargs)
        _kit_call.active = True
        try:
            if name in P2P:
                return record.timed(name, args, kwargs, lambda: original(*args, **kwargs), kit=True)
            return original(*args, **kwargs)
        finally:
            _kit_call.active = False

    return wrapper


def _patch(record: _Record, kit_collectives_are_builtins: bool) -> list:
    """Put the wrappers in place; returns the (module, name, original) to put back."""
    patched = []  # (module, name, original)
    for name in P2P + COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is not None:
            wrapped = _wrap_dist(record, name, original)
            for module in (c10d, dist):
                patched.append((module, name, getattr(module, name)))
                setattr(module, name, wrapped)
    for name in P2P:
        patched.append((p2p, name, getattr(p2p, name)))
        setattr(p2p, name, _wrap_kit(record, name, getattr(p2p, name)))
    # the kit's reference collectives are built-ins too, for a from-scratch exercise
    import overlapkit

    from .. import collectives

    for name in KIT_COLLECTIVES if kit_collectives_are_builtins else ():
        wrapped = _wrap_kit(record, f"ok.{name}", getattr(collectives, name))
        for module in (collectives, overlapkit):
            patched.append((module, name, getattr(module, name)))
            setattr(module, name, wrapped)
    return patched


def _note_unnamed(traffic: Traffic, count_ops, before: dict, kit_stats, kit_before: int) -> None:
    """Add to ``traffic.collectives`` the operations since ``before`` that no name saw."""
    # what torch's groups counted beyond the calls seen by name: a group's own
    # allreduce, torch.ops.c10d, … (each named call and each kit message counts one)
    ops = sum(n - before.get(g, 0) for g, n in count_ops().items())
    named = sum(1 for c in traffic.collectives if not c.startswith("ok.")) + len(traffic.direct)
    unnamed = ops - (kit_stats().user_group_messages - kit_before) - named
    if unnamed > 0:
        traffic.collectives.append(UNNAMED.format(unnamed))


@contextlib.contextmanager
def recording(kit_collectives_are_builtins: bool = True, payloads: bool = False):
    """Patch torch.distributed and ok.p2p in this process; yields the :class:`Traffic` it fills.

    A learner's ``ok.p2p.isend`` counts as one message, not as the header and
    data messages the kit sends for it. A call of the kit's own collectives
    (``ok.ring_all_reduce``, ...) counts as a built-in collective, unless
    ``kit_collectives_are_builtins=False``: then the messages it sends count.
    """
    record = _Record(payloads)
    traffic = record.traffic
    _current.append(traffic)
    count_ops, kit_stats = group_ops, p2p.stats  # as they are now, not as patched later
    patched = _patch(record, kit_collectives_are_builtins)
    before, kit_before = count_ops(), kit_stats().user_group_messages
    try:
        yield traffic
    finally:
        _current.remove(traffic)
        for module, name, original in reversed(patched):
            setattr(module, name, original)
        record.check_kept()
        _note_unnamed(traffic, count_ops, before, kit_stats, kit_before)


#: how :func:`recording` lists operations torch's process groups ran that no name saw
UNNAMED = "{} operation(s) straight on torch's process groups (a group's own allreduce, send, …)"


def shown(name: str) -> str:
    """A name of :attr:`Traffic.collectives` as a learner reads it: torch's own with their
    module (``torch.distributed.all_reduce``), the kit's and the unnamed as they are."""
    return name if name.startswith(("ok.", "torch")) or " " in name else f"torch.distributed.{name}"


def group_ops() -> dict:
    """Each process group of torch's registry: how many operations it has run (its
    sequence number; groups that keep none are left out). The kit's own groups are not
    in the registry."""
    counts = {}
    for group in list(getattr(getattr(c10d, "_world", None), "pg_map", {}) or {}):
        with contextlib.suppress(Exception):
            counts[id(group)] = int(group._get_sequence_number_for_group())
    return counts


def _timed_wait(wait, entry):
    """``wait`` that notes when it first returned in ``entry``."""

    @functools.wraps(wait)
    def timed_wait(*args, **kwargs):
        result = wait(*args, **kwargs)
        if entry[3] is None:
            entry[3] = time.perf_counter()
        return result

    return timed_wait


class _TimedWait:
    """torch's handle of a message, as the learner got it, noting when wait() returned."""

    def __init__(self, handle, entry):
        self._handle = handle
        self.wait = _timed_wait(handle.wait, entry)

    def __getattr__(self, name):
        return getattr(self._handle, name)


def _recorded(fn_bytes: bytes, args_bytes: bytes, forbid: tuple = (), payloads: bool = False,
              **mine):  # fmt: skip
    # no channel between the ranks but the kit's (and torch's, which the recorder counts):
    # from here on this process opens no socket (a process group of the learner's own)
    nosockets.forbid_new_sockets()
    # nor a file the other ranks can read: the group's own store was such a channel
    sealed = nofiles.seal_rank_files()
    # without its store a rank would end as soon as it returns, and a message still on
    # its way to it (a receive it posted but never waited, landed by its inbox thread)
    # would leave the sender waiting for its taker until the check's timeout, so that
    # the check named a hang, not the unwaited handle, one run in a few on a loaded
    # machine: each rank stays until every peer has returned (made before the learner's
    # function runs, told after it ends: outside anything a check counts)
    peers = PeersReturned("recorded") if sealed else None
    try:
        return _run_recording(fn_bytes, args_bytes, forbid, payloads, mine)
    finally:
        if peers is not None:
            peers.post(_rank(), {})


def _run_recording(fn_bytes, args_bytes, forbid, payloads, mine):
    # checks run with the read guard on: a tensor read before its operation's wait()
    # holds NaN every time, so a race fails the check every run, not one run in ten
    # the answers are looked up before the recorder replaces any of them
    with answers.running(forbid) as ran, recording(payloads=payloads) as traffic, debug_races():
        # loaded after patching, the function and its arguments alike (a check's runner
        # gets the learner's function as an argument): see the module docstring
        fn = cloudpickle.loads(fn_bytes)
        args, kwargs = cloudpickle.loads(args_bytes)
        # the watch can be neither switched off nor fooled by code put back (as in
        # lab 13): the same guard as a single-process check's, but for the kit's files
        try:
            value = sealed.call_guarded(fn, args, {**kwargs, **mine}, files=False)
        except Exception as exc:
            if ran:  # the answer's own error says less than that it ran
                raise answers.AnswerRan.on(_rank(), list(ran)) from exc
            raise
    if ran or traffic.tampered:
        raise answers.AnswerRan.on(_rank(), list(ran) + [answers.RECORD] * traffic.tampered)
    return value, traffic


def _rank() -> int:
    import torch.distributed as dist  # noqa: PLC0415

    return dist.get_rank() if dist.is_initialized() else 0


hide_frames_from(__file__)


def run_recorded(fn, *args, world_size: int, timeout: float, link=None, forbid=(),
                 rank_kwargs=None, payloads: bool = False, **kwargs):  # fmt: skip
    """``ok.launch`` ``fn`` with traffic recording; returns [(value, Traffic)] by rank.
    ``forbid``: the kit's answers (``exercises.ANSWERS``) whose code must not run meanwhile:
    if it does, the rank raises :class:`answers.AnswerRan`. ``rank_kwargs``: per rank, more
    keyword arguments of ``fn`` that only that rank gets (``ok.launch``'s). ``payloads``: keep
    a copy of each sent message (:attr:`Traffic.payloads`).
    ``link``: an ``ok.Link`` for the run's ok.p2p messages (checks use one that costs
    nothing, for its headers: a send and a receive that disagree are an error there,
    not a crash of the process)."""
    from ..launcher import dumps_keeping_filenames, heard, launch  # noqa: PLC0415

    # the ranks' own prints would make check output vary from run to run
    try:
        results = launch(
            _recorded,
            dumps_keeping_filenames(fn),
            dumps_keeping_filenames((args, kwargs)),
            tuple(forbid),
            payloads,
            world_size=world_size,
            timeout=timeout,
            quiet=True,
            link=link,
            rank_kwargs=rank_kwargs,
        )
    except Exception as exc:
        _judge_sightings(world_size, forbid, heard(), exc)
        raise
    _judge_sightings(world_size, forbid, heard(), None)
    return results


def _judge_sightings(world: int, forbid, sent, failure) -> None:
    """Raise :class:`answers.AnswerRan` for the first rank whose watch saw the kit's answer
    run (or was cut off): judged from what the watch sent out as it saw it, so that a rank
    whose code changed its own report still fails. (The rank raises it itself too; that is
    what a notebook without ranks' pipes relies on.)"""
    if failure is not None and answers.cut_off(failure):
        raise answers.AnswerRan.on(failure.rank, [answers.CUT_OFF]) from failure
    if not forbid or sent is None:
        return
    messages, garbled = sent
    for rank in range(world):
        (seen,) = answers.seen_by_watches(messages.get(rank, []), rank in garbled, [tuple(forbid)])
        if seen:
            raise answers.AnswerRan.on(rank, seen) from failure
