"""What each rank of a check tells the others when it returns from the learner's function,
so that a rank still waiting can tell a wait that can never end from a slow one."""

from __future__ import annotations

import contextlib
import json
import time
import zlib

from .. import handles


class PeersReturned:
    """What each rank of a check tells the others when it returns from the learner's
    function (:meth:`post`: its counts of messages or collectives), so that a rank still
    waiting can tell a wait that can never end (the peer returned without what it waits
    for) from a slow one. The verdict comes from those counts, never from how long
    anything took.

    The counts travel as one message to every peer on the default process group, with a
    tag of their own (a learner's messages, tag 0, never meet them) and called on the
    group itself (no record of the learner's traffic sees them). Not through the group's
    store: a check's ranks can no longer reach it (:mod:`.nofiles`). Every rank makes its
    PeersReturned objects in the same order (the tags follow that order)."""

    SIZE = 4096  # bytes of a message: a length, then the counts as JSON
    _made: dict = {}  # lab -> how many this process made (each gets its own tag)

    def __init__(self, lab: str):
        import torch  # noqa: PLC0415
        import torch.distributed.distributed_c10d as c10d  # noqa: PLC0415

        self._pg = c10d._get_default_group()
        me, world = self._pg.rank(), self._pg.size()
        n = PeersReturned._made[lab] = PeersReturned._made.get(lab, 0) + 1
        self._tag = 0x6F6B0000 + (zlib.crc32(lab.encode()) % 0x100) * 0x100 + n % 0x100
        self._boxes = {r: torch.zeros(self.SIZE, dtype=torch.uint8)
                       for r in range(world) if r != me}  # fmt: skip
        self._pending: dict = {}
        for r, box in self._boxes.items():
            with contextlib.suppress(RuntimeError):  # a peer already gone: never heard of
                # polled (a gloo work's is_completed() alone never turns True)
                self._pending[r] = handles.Polled(self._pg.recv([box], r, self._tag))
        self._got: dict = {}
        self._sends: list = []  # kept until the process ends: a send's buffer must live
        # this rank's process stays until every peer has returned (or is gone): one that
        # ended first would close its connections under a peer still to post its counts
        from .. import rankhook  # noqa: PLC0415

        rankhook.at_end(self.linger)

    def post(self, rank: int, counts) -> None:
        import torch  # noqa: PLC0415

        data = json.dumps(counts).encode()
        if len(data) > self.SIZE - 4:
            raise ValueError(f"PeersReturned: counts of {len(data)} bytes do not fit")
        message = torch.zeros(self.SIZE, dtype=torch.uint8)
        message[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
        message[4 : 4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for peer in self._boxes:
            self._sends.append((self._pg.send([message], peer, self._tag), message))

    def of(self, rank: int):
        """What ``rank`` left when it returned, or None while it still runs (or ended
        without a word: the launcher names a rank that failed)."""
        if rank not in self._got:
            work = self._pending.get(rank)
            if work is None or not work.is_completed():
                return None
            try:
                work.wait()
            except RuntimeError:  # its connection closed: it ended without posting
                del self._pending[rank]
                return None
            raw = bytes(self._boxes[rank].tolist())
            self._got[rank] = json.loads(raw[4 : 4 + int.from_bytes(raw[:4], "little")])
        return self._got[rank]

    def linger(self, limit_s: float) -> None:
        """Wait until every peer has posted (or is gone), ``limit_s`` at most."""
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            if all(self.of(r) is not None for r in list(self._pending)):
                return
            time.sleep(0.005)
