"""A fully sharded step simulated: each unit's parameters gathered before its forward and
backward, its gradients reduce-scattered after, and what prefetching hides."""

from __future__ import annotations

from .collectives import ring_all_gather, ring_reduce_scatter


def fsdp_step(units, N: int, alpha: float, beta: float, prefetch: str = "none",
              backward_prefetch: bool = True, reshard_after_forward: bool = True,
              prefetch_depth: int = 1, shared_link: bool = True,
              per_op: float = 0.0, per_op_rs: float | None = None) -> dict:  # fmt: skip
    """Simulate one fully sharded step (``ok.FullyShardedDP``) from each unit's compute.

    ``units``: (forward seconds, backward seconds, bytes of the unit's whole parameters)
    per unit, in forward order. Each AllGather takes ``ring_all_gather(bytes)``, each
    ReduceScatter ``ring_reduce_scatter(bytes)`` (+ ``per_op``, or ``per_op_rs`` where given:
    what a collective costs a computing host beyond α-β, measured); with ``shared_link`` both
    queue on one link in the order issued, else each on its own::

        forward   unit k waits for AG_k, computes F_k, frees the unit (reshard)
        backward  unit k (last first) waits for AG_k again (when resharded), computes
                  B_k, then issues RS_k
        explicit  AG_{k+1..k+depth} are issued when unit k starts, before F_k
        backward_prefetch   AG of the next unit(s) in backward order issued before B_k
                            (``prefetch_depth`` of them with explicit prefetch, else one)

    ``"implicit"`` is ``"none"`` here: on a CPU the host that would run ahead is busy
    computing. Returns step, compute, comm (all transfers), exposed (step − compute),
    hidden_fraction, forward_wait (time forward spent waiting for AllGathers), the
    peak bytes of whole units held at once (from an AllGather's issue until its unit is
    freed) and every span (lane, name, start, end) for drawing.
    """
    if prefetch not in ("none", "implicit", "explicit"):
        raise ValueError(f"prefetch must be 'none', 'implicit' or 'explicit'; got {prefetch!r}")
    n = len(units)
    ag = [per_op + ring_all_gather(b, N, alpha, beta) for _, _, b in units]
    per_op_rs = per_op if per_op_rs is None else per_op_rs
    rs = [per_op_rs + ring_reduce_scatter(b, N, alpha, beta) for _, _, b in units]
    link = _Links(units, ag, shared_link)
    clock, forward_wait = 0.0, 0.0
    for k in range(n):
        link.issue(k, clock, "")
        if prefetch == "explicit":
            for j in range(k + 1, min(n, k + 1 + prefetch_depth)):
                link.issue(j, clock, "")
        forward_wait += max(0.0, link.gathered[k] - clock)
        clock = max(clock, link.gathered[k])
        link.spans.append(("compute", f"F {k}", clock, clock + units[k][0]))
        clock += units[k][0]
        if reshard_after_forward:
            link.release(k, clock)
    last_rs = 0.0
    for k in reversed(range(n)):
        link.issue(k, clock, " (again)")
        if backward_prefetch and reshard_after_forward:
            depth = prefetch_depth if prefetch == "explicit" else 1
            for j in range(k - 1, max(-1, k - 1 - depth), -1):
                link.issue(j, clock, " (again)")
        clock = max(clock, link.gathered[k])
        link.spans.append(("compute", f"B {k}", clock, clock + units[k][1]))
        clock += units[k][1]
        link.release(k, clock)
        last_rs = link.reduce_scatter(k, clock, rs[k])
    step = max(clock, last_rs)
    comm = sum(ag) * (2 if reshard_after_forward else 1) + sum(rs)
    return _summary(step, sum(f + b for f, b, _ in units), comm, forward_wait, link)


class _Links:
    """The AllGathers and ReduceScatters of a simulated step: each queues on its link (one
    for both with ``shared``) in the order issued, and each unit is held whole from its
    AllGather's issue until it is freed."""

    def __init__(self, units, ag: list[float], shared: bool):
        self.units, self.ag, self.shared = units, ag, shared
        self.free = {"ag": 0.0, "rs": 0.0}
        self.spans, self.held = [], []  # held: (from, to, bytes) of whole units
        self.gathered: dict[int, float] = {}  # unit -> when its AllGather ends
        self.issued_at: dict[int, float] = {}

    def _start(self, lane: str, at: float, seconds: float) -> float:
        lane = lane if not self.shared else "link"
        start = max(at, self.free.get(lane, 0.0))
        self.free[lane] = start + seconds
        return start

    def issue(self, k: int, at: float, phase: str) -> None:
        if k in self.gathered:
            return
        start = self._start("ag", at, self.ag[k])
        self.gathered[k], self.issued_at[k] = start + self.ag[k], at
        self.spans.append(("comm", f"AG {k}{phase}", start, start + self.ag[k]))

    def release(self, k: int, at: float) -> None:
        self.held.append((self.issued_at.pop(k), at, self.units[k][2]))
        del self.gathered[k]

    def reduce_scatter(self, k: int, at: float, seconds: float) -> float:
        """Unit k's ReduceScatter issued at ``at``: when it ends."""
        start = self._start("rs", at, seconds)
        self.spans.append(("comm", f"RS {k}", start, start + seconds))
        return start + seconds


def _summary(step: float, compute: float, comm: float, forward_wait: float,
             link: _Links) -> dict:  # fmt: skip
    exposed = step - compute
    held = link.held
    moments = sorted({t for a, b, _ in held for t in (a, b)})
    peak = max((sum(nb for a, b, nb in held if a <= t < b) for t in moments), default=0)
    return {
        "step": step,
        "compute": compute,
        "comm": comm,
        "exposed": exposed,
        "hidden_fraction": 1 - exposed / comm if comm else 1.0,
        "forward_wait": forward_wait,
        "peak_gathered": peak,
        "spans": link.spans,
    }
