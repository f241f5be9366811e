"""The one extension point of :func:`overlapkit.launch`: what a caller adds to its ranks.

A :class:`RankHook` passed as ``ok.launch(fn, ..., hook=h)`` says

* which modules every rank must have imported before ``fn`` runs (``preload``): the
  forkserver imports them once, so that what they work out at import is inherited by
  every rank it forks, not paid again per rank (:func:`overlapkit.launcher.preload`);
* what runs around ``fn`` on each rank (:meth:`RankHook.around`, a context manager);
* what the caller does with the bytes each rank sent on its *channel*
  (:meth:`RankHook.heard`).

The channel is a pipe from each rank to the caller, apart from the rank's value: what is
written there leaves the rank the moment it is written, whatever the rank's code does
afterwards, and the launcher carries it as opaque bytes (:func:`channel`, then
``hook.heard`` or :func:`overlapkit.launcher.heard` in the caller). Code on a rank can
also ask what runs once the rank's value has been sent (:func:`at_end`) and about the
rank it runs on (:func:`this_rank`).

    class Traces(ok.RankHook):                    # overlapkit.profiling.ProfileRanks
        def around(self):  ...                    # start a profiler, send its file's name
        def heard(self, by_rank, garbled): ...    # collect the names by rank

    ok.launch(step, world_size=2, hook=Traces())

A hook travels to the ranks by value (cloudpickle, as ``fn`` does); its ``around`` runs
there, its ``heard`` here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

from . import _rank

#: the longest message a rank's channel carries
CHANNEL_LIMIT = 4 << 20


class RankHook:
    """Subclass and override what you need; the defaults add nothing."""

    #: modules every rank imports before ``fn`` runs (the forkserver imports them once)
    preload: tuple[str, ...] = ()

    def around(self) -> contextlib.AbstractContextManager:
        """On each rank: the context ``fn`` runs in (entered after the process group is up)."""
        return contextlib.nullcontext()

    def heard(self, by_rank: dict[int, list[bytes]], garbled: set[int]) -> None:
        """In the caller, once the ranks have ended: each rank's channel messages in the
        order sent, and the ranks whose channel carried something that was not a whole
        message (cut short, or longer than :data:`CHANNEL_LIMIT`)."""


@dataclasses.dataclass(frozen=True)
class ThisRank:
    """The rank a piece of code runs on, as :func:`overlapkit.launch` started it."""

    rank: int
    world_size: int
    workdir: str  # the launch's private folder: its store and the ranks' logs
    shm_dir: str | None  # where the emulated link's bytes go
    timeout_s: float


def this_rank() -> ThisRank | None:
    """The launched rank this process is; None in the caller and in a torchrun worker
    (which runs ``fn`` in place and does not end with it)."""
    spec = _rank.spec_of_this_rank
    if not _rank.launched or spec is None:
        return None
    return ThisRank(
        rank=int(os.environ["OVERLAPKIT_RANK"]),
        world_size=spec.world_size,
        workdir=os.path.dirname(spec.store_path),
        shm_dir=spec.shm_dir,
        timeout_s=spec.timeout_s,
    )


def channel():
    """This rank's channel to the caller (a ``multiprocessing`` connection: write whole
    messages with ``send_bytes``), or None outside a launched rank."""
    conn = _rank.channel
    return None if conn is None or conn.closed else conn


def at_end(fn) -> None:
    """On a launched rank: call ``fn(limit_s)`` once the rank's value has been sent and
    before the rank leaves its process group (``limit_s``: the launch's timeout). ``fn``
    returns True when it has made the rank's store unreachable: the rank then ends at
    once, without the group's teardown, which would need the store."""
    _rank.at_end.append(fn)


def launcher_code() -> tuple:
    """The code of the launcher's own frames on a rank: its entry point, below ``fn``, and
    the flush that runs just before the rank's value leaves. For tools that walk a rank's
    stack and must tell the launcher's frames from the code it runs."""
    return _rank.main.__code__, _rank._flush_all.__code__
