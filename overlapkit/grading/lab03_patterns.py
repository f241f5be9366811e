"""The messages labs 02 and 03 teach, checked: the root's (every rank sends its tensor to rank
0 and gets the sum back) and the ring's (each rank only to its right neighbour and from its
left, one chunk of about S/N a step, 2(N−1) steps), what each message carries included."""

from __future__ import annotations

import torch

from ..collectives import chunk_bounds


def _pattern_problem(results, world: int, pattern: str | None, inputs) -> str | None:
    """The first case whose messages are not the ``pattern`` the lab teaches (the values
    were right: :func:`_first_problem` found nothing), said precisely; None if none. The
    messages are judged by where they went, their sizes and what they carried."""
    if pattern is None or world < 2:
        return None
    for rank, cases, _ in results:
        for salt, case in enumerate(cases):
            numel, (sent, received, carried) = case[0], case[5]
            where = f"{world} ranks, {numel} elements: rank {rank}"
            problem = (_ring_problem if pattern == "ring" else _root_problem)(
                rank, world, numel, sent, received)  # fmt: skip
            if not problem:
                parts = inputs(world, numel, salt)
                problem = (_ring_content if pattern == "ring" else _root_content)(
                    rank, world, numel, carried, parts)  # fmt: skip
            if problem:
                return f"{where} {problem}"
    return None


def _ring_content(rank: int, world: int, numel: int, carried, parts) -> str | None:
    """Each message of a ring carries, in one chunk, the sum of a run of ranks ending at
    the sender: k + 1 of them in reduce-scatter step k, all of them in all-gather. (Where
    some chunks are empty and skipped, the steps are not told apart: any run will do.)"""
    bounds = chunk_bounds(numel, world)
    runs = [sum(parts[(rank - j) % world] for j in range(n)) for n in range(1, world + 1)]
    steps = numel >= world and len(carried) == 2 * (world - 1)
    for k, message in enumerate(carried):
        flat = message.reshape(-1).float() if hasattr(message, "reshape") else None
        if flat is None or flat.numel() == 0:
            continue
        allowed = [runs[min(k, world - 1)]] if steps else runs
        if not any(torch.equal(flat, run[lo:hi]) for run in allowed for lo, hi in bounds
                   if hi - lo == flat.numel()):  # fmt: skip
            return (
                f"sent a message (#{k + 1}) whose values are not a chunk of a partial sum: a "
                "ring step sends the chunk it has summed so far (its own, then its own plus "
                "what came from the left, …; in all-gather the finished sums). Messages that "
                "carry something else (zeros, a copy made elsewhere) are not the ring"
            )
    return None


def _root_content(rank: int, world: int, numel: int, carried, parts) -> str | None:
    """Every other rank sends its own tensor; rank 0 sends the sum."""
    want = sum(parts) if rank == 0 else parts[rank]
    for message in carried:
        flat = message.reshape(-1).float() if hasattr(message, "reshape") else None
        if flat is not None and not torch.equal(flat, want):
            what = "the sum" if rank == 0 else "its own tensor"
            return (
                f"sent a message that is not {what}: in the master-worker AllReduce every "
                "other rank sends its input to rank 0, and rank 0 sends the sum"
            )
    return None


def _ring_problem(rank: int, world: int, numel: int, sent, received) -> str | None:
    right, left, steps = (rank + 1) % world, (rank - 1) % world, 2 * (world - 1)
    chunk = -(-numel // world) * 4  # the largest chunk, in bytes (float32)
    ring = (f"In a ring each rank sends only to its right neighbour ({right}) and receives "
            f"only from its left ({left}), one chunk of about S/N a step, 2(N−1) = {steps} "
            "steps: the sum is right, but it did not travel round the ring")  # fmt: skip
    if others := sorted({p for p, _ in sent if p != right}):
        return f"sent to rank {others[0]}. {ring}."
    if others := sorted({p for p, _ in received if p != left}):
        return f"received from rank {others[0]}. {ring}."
    if big := [n for _, n in sent if n > chunk]:
        return (f"sent a message of {big[0]} bytes, more than the largest chunk ({chunk} "
                f"bytes: ⌈{numel}/{world}⌉ elements). {ring}.")  # fmt: skip
    if len(sent) > steps:
        return (f"sent {len(sent)} messages where a ring needs 2(N−1) = {steps}: N−1 "
                "reduce-scatter steps, then N−1 all-gather steps. The sum is right, but it "
                "went round more than once.")  # fmt: skip
    if numel % world == 0 and len(sent) != steps:
        return f"sent {len(sent)} messages. {ring}."
    if numel % world == 0 and (odd := [n for _, n in sent if n != chunk]):
        return f"sent a message of {odd[0]} bytes, where every chunk has {chunk}. {ring}."
    return None


def _root_problem(rank: int, world: int, numel: int, sent, received) -> str | None:
    size = numel * 4
    root = (
        "In the master-worker AllReduce every other rank sends its whole tensor to rank 0 once "
        "and receives the sum from it once; rank 0 receives one tensor from each and sends the "
        "sum to each: the sum is right, but it did not go through rank 0"
    )
    if rank == 0:
        want = sorted((p, size) for p in range(1, world))
        if sorted(received) != want:
            got = _messages(received)
            return f"(the root) received {got}, not one tensor from each other rank. {root}."
        if sorted(sent) != want:
            return f"(the root) sent {_messages(sent)}, not the sum to each other rank. {root}."
        return None
    if sorted(sent) != [(0, size)]:
        return f"sent {_messages(sent)}, not its tensor ({size} bytes) to rank 0. {root}."
    if sorted(received) != [(0, size)]:
        return f"received {_messages(received)}, not the sum ({size} bytes) from rank 0. {root}."
    return None


def _messages(pairs) -> str:
    if not pairs:
        return "nothing"
    shown = ", ".join(f"{n} B with rank {p}" for p, n in pairs[:4])
    return f"{len(pairs)} message(s): {shown}{', …' if len(pairs) > 4 else ''}"
