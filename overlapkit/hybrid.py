"""Hybrid parallelism: pipeline stages × data-parallel replicas on a 2-D device mesh.

A mesh of ``dp × pp`` ranks (PyTorch's ``init_device_mesh``, dimensions ``("dp", "pp")``)::

                 pp →                    rank = d·pp + s
           dp  [ 0  1 ]   pipelines (pp groups): {0, 1} {2, 3}  — activations, their gradients
            ↓  [ 2  3 ]   replicas  (dp groups): {0, 2} {1, 3}  — one stage's gradients

Each rank runs stage ``s`` of pipeline replica ``d``: its activations travel along its pp
group (``ok.PipelineStage``), its gradients are averaged over its dp group
(``ok.BucketedDDP``), each group on its own communication worker, so both kinds of traffic
can be in flight at once. The question this module measures is *when* a stage starts its
data-parallel AllReduce::

    flush      s0 |F0|F1|  |B0|F2|B1|  |B2|[AR s0 ......]
               s1    |F0|B0|F1|B1|F2|B2|   ·  ·  ·   [AR s1 ......]   after the whole pipeline
    overlap    s0 |F0|F1|  |B0|F2|B1|  |B2|[AR]        buckets as B2's gradients fill them
               s1    |F0|B0|F1|B1|F2|B2|[AR s1 ......]   during s0's cool-down

A stage's gradients are complete after its *last* micro-batch's backward: every earlier
backward only accumulates (``no_sync``). With ``dp_start="overlap"`` the first stage launches
each bucket as that backward fills it (as DDP does); a later stage launches its buckets right
after that backward's input gradient is on its way to the previous stage, which waits for it
(on a link shared by both groups, an AllReduce sent first would delay the pipeline). With
``"flush"`` every stage waits until the whole pipeline has drained (a barrier of its pp
group), then reduces; with ``"after"`` every stage launches its buckets once its own last
backward (and its send) is done, none during it. ``costmodel.hybrid_step`` predicts them.

The kit's buckets carry their stage and index (``collectives.labelled``): two replicas that
issue them in different orders get an error naming both ranks and both buckets, never each
other's bytes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import runtime
from .ddp import BucketedDDP
from .pipeline import PipelineStage, StepResult
from .timeline import COMM, COMPUTE, Timeline, intersect, length, union

DP_STARTS = ("flush", "after", "overlap")
PP_LANE, DP_LANE = COMM + " pp", COMM + " dp"


@dataclass
class Mesh:
    """This rank's place in a ``dp × pp`` mesh: its stage, its replica, its two groups and
    their members' global ranks (in group order)."""

    dp: int
    pp: int
    replica: int  # which pipeline (the dp coordinate)
    stage: int  # which stage of it (the pp coordinate)
    dp_group: object
    pp_group: object
    dp_ranks: list[int]
    pp_ranks: list[int]
    device_mesh: object = field(repr=False, default=None)


def make_mesh(dp: int, pp: int) -> Mesh:
    """The ``("dp", "pp")`` mesh over every rank, from PyTorch's ``init_device_mesh``
    (a collective: every rank calls it, with the same shape)."""
    world = runtime.world_size()
    if not (isinstance(dp, int) and isinstance(pp, int) and dp >= 1 and pp >= 1):
        raise ValueError(f"dp and pp must be positive ints, got dp={dp!r}, pp={pp!r}")
    if dp * pp != world:
        raise ValueError(
            f"a {dp} × {pp} mesh has {dp * pp} ranks, but {world} are running: "
            f"dp · pp must equal the world size"
        )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(runtime.device().type, (dp, pp), mesh_dim_names=("dp", "pp"))
    dp_group, pp_group = mesh.get_group("dp"), mesh.get_group("pp")
    replica, stage = mesh.get_coordinate()
    return Mesh(dp, pp, replica, stage, dp_group, pp_group,
                dist.get_process_group_ranks(dp_group), dist.get_process_group_ranks(pp_group),
                mesh)  # fmt: skip


@dataclass
class HybridResult:
    """One step on this rank: the pipeline's result, when the data-parallel AllReduce was
    launched and when it was over (``time.perf_counter`` seconds; None with dp = 1)."""

    pipeline: StepResult
    dp_start: str
    reduce_launched: float | None
    reduce_done: float | None


class HybridStage:
    """Stage ``mesh.stage`` of pipeline replica ``mesh.replica``: ``module`` is this stage's
    piece of the model (the same piece, with the same initial weights, on every replica:
    replica 0's are broadcast, as DDP does). ``bucket_mb``, ``all_reduce``: as
    ``ok.BucketedDDP``'s (the kit's ring by default, so that issue order is checked).
    ``step()`` runs one training step; call the optimizer on ``parameters()`` after."""

    def __init__(self, module: torch.nn.Module, mesh: Mesh, bucket_mb: float | None = 25,
                 all_reduce="ring"):  # fmt: skip
        self.module, self.mesh = module, mesh
        self.ddp = None
        if mesh.dp > 1:
            self.ddp = BucketedDDP(module, bucket_mb, all_reduce=all_reduce, group=mesh.dp_group)
            self.ddp.label = f"stage {mesh.stage}"
        inner = self.ddp if self.ddp is not None else module
        self.pipe = PipelineStage(inner, stage=mesh.stage, stages=mesh.pp, ranks=mesh.pp_ranks)

    def parameters(self):
        return self.module.parameters()

    def step(self, inputs=None, targets=None, loss_fn=None, micro_batches: int = 1,
             schedule: str = "1f1b", dp_start: str = "overlap", bucket_order=None,
             timeline: Timeline | None = None) -> HybridResult:  # fmt: skip
        """Forwards and backwards of every micro-batch along the pipeline, then this stage's
        gradients averaged over its replicas, the AllReduce started as ``dp_start`` says.
        ``bucket_order``: the order this stage launches its buckets in where they wait
        for a moment (``"flush"``, ``"after"``, and the later stages in ``"overlap"``;
        default: bucket order); every replica of the stage must give the same one.
        ``timeline`` gets compute spans, the pipeline's transfers on lane ``"comm pp"`` and
        the buckets' AllReduces on ``"comm dp"``."""
        if dp_start not in DP_STARTS:
            raise ValueError(f"dp_start must be one of {DP_STARTS}, got {dp_start!r}")
        ddp = self.ddp
        order = self._check_order(bucket_order, dp_start)
        pp_tl = None if timeline is None else Timeline(runtime.rank())
        dp_tl = None if timeline is None else Timeline(runtime.rank())
        launched: list[float] = []
        if ddp is not None:
            ddp.timeline = dp_tl
            # the first stage's buckets go as its last backward fills them; the others wait
            # for that backward's send, and "flush" for the whole pipeline
            ddp.defer_launch = dp_start != "overlap" or self.mesh.stage > 0

        def around(i, action, plan):
            if ddp is None:
                return contextlib.nullcontext()
            last = max(j for j, a in enumerate(plan) if a.op == "B")
            if i != last:
                return ddp.no_sync()  # only accumulate: micro-batches still to come
            return self._last_backward(ddp, dp_start, order, launched)

        try:
            result = self.pipe.step(inputs, targets, loss_fn, micro_batches, schedule,
                                    timeline=pp_tl, around=around)  # fmt: skip
            done = None
            if ddp is not None:
                if dp_start == "flush":
                    dist.barrier(group=self.mesh.pp_group)  # the pipeline has drained
                    launched.append(Timeline.now())
                    for b in order:
                        ddp.launch_bucket(b)
                ddp.finish_gradient_synchronization()
                done = Timeline.now()
        finally:
            if ddp is not None:
                ddp.timeline, ddp.defer_launch = None, False
        if timeline is not None:
            _relane(timeline, pp_tl, {COMM: PP_LANE})
            _relane(timeline, dp_tl, {COMM: DP_LANE}, keep={COMM})  # its compute: ours already
        return HybridResult(result, dp_start, launched[0] if launched else None, done)

    def _check_order(self, bucket_order, dp_start: str) -> list[int]:
        ddp = self.ddp
        if ddp is None:
            return []
        n = len(ddp.buckets)
        if bucket_order is None:
            return list(range(n))
        if dp_start == "overlap" and self.mesh.stage == 0:
            raise ValueError(
                "stage 0 launches its buckets as its last backward fills them with "
                "dp_start='overlap': bucket_order applies where buckets wait ('after', 'flush')"
            )
        order = list(bucket_order)
        if sorted(order) != list(range(n)) or not all(isinstance(b, int) for b in order):
            raise ValueError(
                f"stage {self.mesh.stage} (rank {runtime.rank()}): bucket_order must list each "
                f"of its {n} buckets once (0 … {n - 1}), got {order}"
            )
        return order

    @contextlib.contextmanager
    def _last_backward(self, ddp, dp_start: str, order: list[int], launched: list):
        """Around the last backward: its gradients complete the stage's; after it (its input
        gradient's send issued), a deferred stage launches its buckets, unless flushing."""
        start = Timeline.now()
        yield
        if dp_start == "flush":
            return
        if ddp.defer_launch:
            launched.append(Timeline.now())
            for b in order:
                ddp.launch_bucket(b)
        else:
            launched.append(start)
            ddp.launch_ready()


def _relane(into: Timeline, source: Timeline, lanes: dict, keep: set | None = None) -> None:
    for s in source.spans:
        if keep is None or s.lane in keep:
            into.add(s.name, s.start, s.end, lanes.get(s.lane, s.lane), rank=s.rank)


def _under_work(timeline: Timeline, r: int, lane: str, pipelines) -> tuple[float, float]:
    """(seconds rank ``r`` had a transfer on ``lane``, of which some rank of its pipeline
    computed: ``pipelines[r]``, global ranks; the rank alone without it)."""
    mine = union((s.start, s.end) for s in timeline.select(r, lane))
    who = pipelines[r] if pipelines is not None else [r]
    work = union((s.start, s.end) for q in who for s in timeline.select(q, COMPUTE))
    return length(mine), length(intersect(mine, work))


def dp_hidden(timeline: Timeline, pipelines: dict[int, list[int]]) -> float | None:
    """Share of the data-parallel AllReduce time (lane ``"comm dp"``, every rank) during
    which some rank of the same pipeline was still computing: what the reduction hid under
    the pipeline's own work (``pipelines``: each rank's pp group, global ranks; a last
    stage's AllReduce hides under the first stage's cool-down, not its own compute). None
    without data-parallel traffic."""
    busy = [_under_work(timeline, r, DP_LANE, pipelines) for r in timeline.ranks]
    total = sum(b for b, _ in busy)
    return sum(h for _, h in busy) / total if total else None


def hot_spots(timeline: Timeline, pipelines: dict[int, list[int]] | None = None) -> list[dict]:
    """One row per (rank, group whose transfers it made): how long they took, how much of
    that some rank of its pipeline computed under (``pipelines`` as for :func:`dp_hidden`;
    without it, the rank itself), and the rest: exposed, time the step may wait on that
    group. The rows with the most exposed time are where to reorder first."""
    rows = []
    for r in timeline.ranks:
        for lane in (lane for lane in timeline.lanes if lane.startswith(COMM)):
            spans = timeline.select(r, lane)
            if not spans:
                continue
            busy, hidden = _under_work(timeline, r, lane, pipelines)
            rows.append({
                "rank": r,
                "group": lane.removeprefix(COMM).strip() or "comm",
                "transfers": len(spans),
                "busy_ms": busy * 1e3,
                "hidden_ms": hidden * 1e3,
                "exposed_ms": (busy - hidden) * 1e3,
            })  # fmt: skip
    return rows
