"""The kit stream's operations: which kit collective runs on this thread (:class:`Op`),
and the error that ranks disagreeing on it get (:class:`CollectiveMismatchError`).

Kit collectives run one at a time per rank, in the order they were issued (see
:mod:`overlapkit.collectives`); each one first tells its peers which operation it is
(number, op, size, dtype, issuing thread and line) and checks what its peers announced,
so ranks that disagree get a clear error naming both calls instead of exchanging the
wrong bytes.
"""

from __future__ import annotations

import contextlib
import threading

import torch.distributed as dist

from .messages import _read_announcement


class Op:
    """A kit collective as its messages describe it: its number on its group and a
    signature of (collective, size, dtype, op, issuing thread), so that a peer
    running a different operation is told, not fed the wrong bytes."""

    def __init__(self, group, seq: int, signature: int, description: str):
        self.group, self.seq, self.signature = group, seq, signature
        self.description = description
        self.check = True
        self.described: set = set()  # peers whose first message carried the description
        self.announcements: list = []  # (peer, handle, buffer) of announcements not checked
        self.announcement_sends: list = []

    def finish(self) -> None:
        """At the op's end: announcements checked (also where no data was waited for)."""
        self.check_announcements()
        sends, self.announcement_sends = self.announcement_sends, []
        for handle in sends:
            handle.wait()

    def check_announcements(self) -> None:
        """Wait for the peers' announcements of their operation; raise if one differs."""
        pending, self.announcements = self.announcements, []
        for src, handle, box in pending:
            try:
                handle.wait()
            except CollectiveMismatchError:
                raise
            except RuntimeError as exc:  # data came where the announcement should be
                raise CollectiveMismatchError(
                    f"rank {dist.get_rank()} runs {self.description}, but rank {src} sent "
                    f"something else first ({exc})"
                ) from exc
            error = _mismatch(self, src, *_read_announcement(box)) if self.check else None
            if error is not None:
                raise error

    def introduce_to(self, peer: int) -> bytes:
        """The description for the first message to ``peer`` (b"" after that)."""
        if peer in self.described:
            return b""
        self.described.add(peer)
        return self.description.encode()


_local = threading.local()


def current_op() -> Op | None:
    """The kit collective running on this thread, if any: its messages go in the kit stream."""
    return getattr(_local, "op", None)


@contextlib.contextmanager
def running(op: Op | None):
    previous, _local.op = current_op(), op
    try:
        yield
    finally:
        _local.op = previous


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with tensors or ops that do not match."""


def _mismatch(op: Op, peer: int, seq: int, signature: int, description: str):
    me = dist.get_rank()
    if seq == op.seq and signature == op.signature:
        return None
    return CollectiveMismatchError(
        f"rank {me} and rank {peer} disagree on kit operation #{op.seq} of their group: "
        f"rank {me} runs {op.description}; rank {peer} runs "
        f"{description or 'something else'} (its operation #{seq}). Every rank must issue "
        "the same kit collectives, with the same size, dtype and op, in the same order "
        "(also when they are issued from several threads)."
    )
