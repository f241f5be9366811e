"""NCCL's blocking rule for point-to-point messages, as a small simulator.

On NCCL a send or a receive holds its CUDA stream until the peer posts its match, and
a communicator's calls between two ranks run on one stream in the order they were
posted. The k-th send from a to b on a communicator matches the k-th receive at b from
a on it. Given what each rank posted (``overlapkit.routes.recording``), :func:`stuck`
replays that: it pairs the heads of the streams until nothing moves, and returns what is
left — nothing when the orders cannot hang, whatever the message sizes.
"""

from __future__ import annotations

from collections import Counter, deque


def directed(rank: int, route: tuple):
    """The stream of the kit's routes: one per communicator (one direction of a pair)."""
    return route


def pair_stream(rank: int, route: tuple):
    """The stream NCCL would use if both directions of a pair shared a communicator (what
    unbatched point-to-point on one group does)."""
    namespace, group, src, dst = route
    return (namespace, group, min(src, dst), max(src, dst))


def stuck(posts: dict[int, list], stream_of=directed) -> dict:
    """``posts``: rank -> the record of that rank (tuples ``(thread, kind, route, peer,
    nbytes, dtype)`` as ``overlapkit.routes`` writes them). Returns, per (rank, stream) that
    could not finish, the ops left on it (empty: no hang). Raises ValueError where a send
    and its receive disagree in size or dtype."""
    queues: dict = {}
    count: Counter = Counter()
    for rank, log in posts.items():
        for _thread, kind, route, peer, nbytes, dtype in log:
            src, dst = (rank, peer) if kind == "send" else (peer, rank)
            number = count[kind, route, src, dst]
            count[kind, route, src, dst] += 1
            op = (kind, route, src, dst, number)
            queues.setdefault((rank, stream_of(rank, tuple(route))), deque()).append(
                (op, nbytes, dtype)
            )
    moved = True
    while moved:
        moved = False
        heads = {q[0][0]: (key, q[0]) for key, q in queues.items() if q}
        for op, (key, (_, nbytes, dtype)) in heads.items():
            kind, route, src, dst, number = op
            partner = ("recv" if kind == "send" else "send", route, src, dst, number)
            if kind != "send" or partner not in heads:
                continue
            other, (_, got_bytes, got_dtype) = heads[partner]
            if (got_bytes, got_dtype) != (nbytes, dtype):
                raise ValueError(
                    f"message {number} from rank {src} to {dst} on {route}: sent {nbytes} B "
                    f"{dtype}, received into {got_bytes} B {got_dtype}"
                )
            if queues[key] and queues[key][0][0] == op and queues[other][0][0] == partner:
                queues[key].popleft()
                queues[other].popleft()
                moved = True
    return {key: [op for op, _, _ in q] for key, q in queues.items() if q}
