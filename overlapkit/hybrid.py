"""Hybrid parallelism: pipeline stages × data-parallel replicas on a 2-D device mesh.

A mesh of ``dp × pp`` ranks (PyTorch's ``init_device_mesh``, dimensions ``("dp", "pp")``)::

                 pp →                    rank = d·pp + s
           dp  [ 0  1 ]   pipelines (pp groups): {0, 1} {2, 3}  — activations, their gradients
            ↓  [ 2  3 ]   replicas  (dp groups): {0, 2} {1, 3}  — one stage's gradients

Each rank runs stage ``s`` of pipeline replica ``d``: its activations travel along its pp
group (``ok.PipelineStage``), its gradients are averaged over its dp group in buckets (the
kit's ring), each group on its own communication worker, so both kinds of traffic can be in
flight at once. The question this module measures is *when* a stage starts its
data-parallel AllReduce::

    flush      s0 |F0|F1|  |B0|F2|B1|  |B2|[AR s0 ......]
               s1    |F0|B0|F1|B1|F2|B2|   ·  ·  ·   [AR s1 ......]   after the whole pipeline
    overlap    s0 |F0|F1|  |B0|F2|B1|  |B2|[AR]        buckets as B2's gradients fill them
               s1    |F0|B0|F1|B1|F2|B2|[AR s1 ......]   during s0's cool-down

A stage's gradients are complete after its *last* micro-batch's backward: every backward
accumulates into ``.grad``, and a bucket reduced any earlier misses what follows. A step is a
*plan*: the stage's pipeline actions with the data-parallel events between them
(:meth:`HybridStage.run_plan`; :func:`plan_for` writes the kit's three). With
``dp_start="overlap"`` the first stage launches each bucket as that backward fills it (as
DDP does); a later stage launches its buckets right after that backward's input gradient is
on its way to the previous stage, which waits for it (on a link shared by both groups, an
AllReduce sent first would delay the pipeline). With ``"flush"`` every stage waits until the
whole pipeline has drained (a barrier of its pp group), then reduces; with ``"after"``
every stage launches its buckets once its own last backward (and its send) is done, none
during it. ``costmodel.hybrid_step`` predicts them.

The kit's buckets carry their stage and index (``ordering.labelled``): two replicas that
issue them in different orders get an error naming both ranks and both buckets, never each
other's bytes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from . import runtime
from .collectives import buckets_by_size, ring_all_reduce
from .ordering import labelled
from .pipeline import PipelineStage, StepResult, make_schedule
from .plans import HYBRID, Finish, Flush, PlanSyntaxError, Reduce
from .timeline import COMM, COMPUTE, Timeline, intersect, is_comm, length, union

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
    # each rank connects to its groups' members while making them: one that went on and
    # ended meanwhile would close a connection another rank is still making (gloo:
    # "connectFullMesh failed … Connection closed by peer"), so every rank waits here
    dist.barrier()
    dp_group, pp_group = mesh.get_group("dp"), mesh.get_group("pp")
    replica, stage = mesh.get_coordinate()
    return Mesh(dp, pp, replica, stage, dp_group, pp_group,
                dist.get_process_group_ranks(dp_group), dist.get_process_group_ranks(pp_group),
                mesh)  # fmt: skip


@dataclass
class HybridResult:
    """One step on this rank: the pipeline's result, the plan it ran, when its first
    data-parallel AllReduce was launched and when the last was over (``Timeline.now()``
    seconds; None with dp = 1)."""

    pipeline: StepResult
    plan: list[str]
    reduce_launched: float | None
    reduce_done: float | None


class PlanError(ValueError):
    """A hybrid plan that cannot run: the message names the action and the rule; ``at``:
    that action's index in the plan (``len(plan)``: after its end; None: no one action)."""

    def __init__(self, message: str, at: int | None = None):
        super().__init__(message)
        self.at = at


def plan_for(dp_start: str, actions: list[str], stage: int, buckets: int) -> list[str]:
    """The plan of one of the kit's AllReduce starts for a stage whose pipeline actions are
    ``actions`` ("F k" / "B k", in its schedule's order) and which has ``buckets`` buckets::

        flush     F 0 … B m−1  flush  reduce 0 … reduce n−1  finish
        after     F 0 … B m−1         reduce 0 … reduce n−1  finish

    and ``"overlap"``: each stage's buckets as early as its place in the pipeline lets them
    hide (lab 14 has you write that one; this is the kit's, for the benchmark)."""
    if dp_start not in DP_STARTS:
        raise ValueError(f"dp_start must be one of {DP_STARTS}, got {dp_start!r}")
    plan = list(actions)
    if not buckets:
        return plan + ["finish"]
    if dp_start == "overlap" and stage == 0:
        return plan[:-1] + [plan[-1] + " ready", "finish"]
    reduces = [f"reduce {b}" for b in range(buckets)]
    return plan + (["flush"] if dp_start == "flush" else []) + reduces + ["finish"]


class HybridStage:
    """Stage ``mesh.stage`` of pipeline replica ``mesh.replica``: ``module`` is this stage's
    piece of the model (replica 0's weights are broadcast over the dp group, as DDP does).
    Its gradients are averaged over the replicas in buckets of ``bucket_mb`` MiB (in the
    order backward produces them), each with the kit's ring (``all_reduce="ring"``, over
    the link; its messages say which stage and bucket, so replicas issuing them in
    different orders are told) or the built-in (``"builtin"``). ``step()`` runs one
    training step by one of the kit's plans, ``run_plan()`` by yours; call the optimizer on
    ``parameters()`` after."""

    def __init__(self, module: torch.nn.Module, mesh: Mesh, bucket_mb: float | None = 25,
                 all_reduce: str = "ring"):  # fmt: skip
        if all_reduce not in ("ring", "builtin"):
            raise ValueError(f"all_reduce must be 'ring' or 'builtin', got {all_reduce!r}")
        self.module, self.mesh, self.all_reduce = module, mesh, all_reduce
        self._order = [p for p in reversed(list(module.parameters())) if p.requires_grad]
        self.buckets: list[list[torch.nn.Parameter]] = []
        if mesh.dp > 1 and self._order:
            with torch.no_grad():  # every replica starts from replica 0's weights
                for p in module.parameters():
                    dist.broadcast(p, src=mesh.dp_ranks[0], group=mesh.dp_group)
            groups = buckets_by_size(self._order, 1e9 if bucket_mb is None else bucket_mb)
            self.buckets = [[self._order[i] for i in idx] for idx in groups]
        self.pipe = PipelineStage(module, stage=mesh.stage, stages=mesh.pp, ranks=mesh.pp_ranks)

    def parameters(self):
        return self.module.parameters()

    def actions(self, micro_batches: int, schedule: str = "1f1b") -> list[str]:
        """This stage's pipeline actions for one step, in order: "F k" and "B k"."""
        return HYBRID.texts(make_schedule(schedule, self.mesh.pp, micro_batches)[self.mesh.stage])

    def step(self, inputs=None, targets=None, loss_fn=None, micro_batches: int = 1,
             schedule: str = "1f1b", dp_start: str = "overlap",
             timeline: Timeline | None = None) -> HybridResult:  # fmt: skip
        """One step by the plan ``plan_for(dp_start, ...)``: see :meth:`run_plan`."""
        actions = self.actions(micro_batches, schedule)  # ("sequential": one micro-batch)
        plan = plan_for(dp_start, actions, self.mesh.stage, len(self.buckets))
        return self.run_plan(plan, inputs, targets, loss_fn, micro_batches, schedule, timeline)

    def run_plan(self, plan, inputs=None, targets=None, loss_fn=None, micro_batches: int = 1,
                 schedule: str = "1f1b", timeline=None) -> HybridResult:  # fmt: skip
        """Run one step's pipeline actions ("F k", "B k", in the schedule's order) with the
        data-parallel events ``plan`` puts between them:

        * ``"B k ready"``: that backward launches each bucket's AllReduce as soon as its
          gradients are complete (DDP's hooks);
        * ``"reduce b"``: launch bucket b's AllReduce now (after the action before it,
          whose sends are issued), from the gradients accumulated so far;
        * ``"flush"``: wait until the whole pipeline has drained (a barrier of the pp group):
          only after the stage's last pipeline action, and every stage's plan says it as
          often (the stages compare their counts before the step: a plan that flushes on
          some stages only is a :class:`PlanError` on every stage at once, not a wait);
        * ``"finish"``: wait for every AllReduce; the averages land in ``.grad``.

        Every backward accumulates into ``.grad``; a bucket reduced before a later backward
        misses that backward's gradient (and :func:`parse_plan` says so). ``timeline``: compute
        spans, the pipeline's transfers on lane ``"comm pp"`` and the AllReduces on
        ``"comm dp"``."""
        steps, after = parse_plan(plan, self.actions(micro_batches, schedule), len(self.buckets))
        _same_flushes(self.mesh, sum(1 for events in after for e in events if e[0] == "flush"))
        pp_tl = None if timeline is None else Timeline(runtime.rank())
        run = _Reductions(self, timeline)

        @contextlib.contextmanager
        def around(i, action, schedule_plan):
            hooks = run.watch() if steps[i][1] else []
            try:
                yield
            finally:
                for h in hooks:
                    h.remove()
            if steps[i][1]:
                run.launch_rest()  # a bucket of parameters this backward did not reach
            for event in after[i]:
                run.do(event)

        result = self.pipe.step(inputs, targets, loss_fn, micro_batches, schedule,
                                timeline=pp_tl, around=around)  # fmt: skip
        run.finish()
        if timeline is not None:  # the pipeline's transfers on a lane of their group
            for s in pp_tl.spans:
                lane = PP_LANE if s.lane == COMM else s.lane
                timeline.add(s.name, s.start, s.end, lane, rank=s.rank)
        return HybridResult(result, list(plan), run.first, run.done)


class _Reductions:
    """The AllReduces of one step's buckets on one rank."""

    def __init__(self, stage: HybridStage, timeline):
        self.st, self.timeline = stage, timeline
        self.inflight: dict[int, tuple] = {}  # bucket -> (flat, handle)
        self.first = self.done = None

    def watch(self) -> list:
        """Hooks that launch a bucket once this backward has given all its gradients."""
        left = {b: len(ps) for b, ps in enumerate(self.st.buckets)}
        where = {id(p): b for b, ps in enumerate(self.st.buckets) for p in ps}

        def arrived(p):
            b = where[id(p)]
            left[b] -= 1
            if not left[b]:
                self.launch(b)

        return [p.register_post_accumulate_grad_hook(arrived) for p in self.st._order]

    def launch_rest(self) -> None:
        for b in range(len(self.st.buckets)):
            if b not in self.inflight:
                self.launch(b)

    @torch.no_grad()
    def launch(self, b: int) -> None:
        st = self.st
        params = st.buckets[b]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params])  # fmt: skip
        if self.first is None:
            self.first = Timeline.now()
        with labelled(f"stage {st.mesh.stage} bucket {b}"):
            if st.all_reduce == "ring":
                handle = ring_all_reduce(flat, op="avg", group=st.mesh.dp_group, async_op=True)
            else:
                handle = dist.all_reduce(flat, group=st.mesh.dp_group, async_op=True)
        if self.timeline is not None:
            handle = self.timeline.track(f"bucket {b}", handle, DP_LANE, device=flat.device)
        self.inflight[b] = (flat, handle)

    def do(self, event: tuple) -> None:
        if event[0] == "reduce":
            self.launch(event[1])
        elif event[0] == "flush":
            _flush(self.st.mesh)

    @torch.no_grad()
    def finish(self) -> None:
        st = self.st
        for b, (flat, handle) in self.inflight.items():
            handle.wait()
            if st.all_reduce == "builtin":
                flat.div_(st.mesh.dp)
            offset = 0
            for p in st.buckets[b]:
                part = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    p.grad = part.clone()
                else:
                    p.grad.copy_(part)
        if self.inflight:
            self.done = Timeline.now()


def flush_mismatch(counts: dict[int, int]) -> str | None:
    """What is wrong with the stages' plans of one pipeline step, given how often each
    stage's plan says 'flush' (``counts``: stage -> times), or None: 'flush' is a barrier
    of the whole pipeline, so every stage says it as often, or the ones that say it wait
    for ever for the ones that do not."""
    if len(set(counts.values())) <= 1:
        return None
    most = max(counts.values())
    short = [s for s, n in sorted(counts.items()) if n < most]
    said = [s for s, n in sorted(counts.items()) if n == most]
    if all(counts[s] == 0 for s in short):
        how = f"never say 'flush', but stage(s) {said} do"
    else:
        how = f"say 'flush' fewer times than stage(s) {said} ({most})"
    return (f"stage(s) {short} {how}: 'flush' waits for every stage of the pipeline, so a "
            "plan that uses it must be every stage's, as often (or the stages that say it "
            "wait for ever)")  # fmt: skip


def _same_flushes(mesh: Mesh, flushes: int) -> None:
    """Before a step: every stage of this rank's pipeline says 'flush' as often, or every
    one of them raises :class:`PlanError` at once, naming the stages that do not (a
    stage's flush would otherwise wait for a stage that never comes). Every step, not once
    per plan: a stage that skipped it for a plan it had already agreed on, while another
    stage's plan changed, would leave that stage waiting in the all-gather (a caller that
    alternates two plans which agree on some stages only does exactly that)."""
    if mesh.pp == 1:
        return
    mine = torch.tensor([flushes], dtype=torch.int64, device=runtime.device())
    every = [torch.empty_like(mine) for _ in range(mesh.pp)]
    dist.all_gather(every, mine, group=mesh.pp_group)
    problem = flush_mismatch({s: int(t.item()) for s, t in enumerate(every)})
    if problem is not None:
        raise PlanError(f"the plans of the pipeline of ranks {mesh.pp_ranks}: {problem}")


def _flush(mesh: Mesh, timeout_s: float = 60.0) -> None:
    """Wait until every stage of this rank's pipeline has got here. On gloo a monitored
    barrier: a stage whose plan never flushes is named after ``timeout_s``, not waited for
    forever."""
    if dist.get_backend(mesh.pp_group) == "gloo":
        from datetime import timedelta

        try:
            dist.monitored_barrier(group=mesh.pp_group, timeout=timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise PlanError(
                f"stage {mesh.stage} (rank {runtime.rank()}) waited {timeout_s:g} s at 'flush' "
                f"for the rest of its pipeline ({mesh.pp_ranks}): every stage's plan must say "
                f"'flush' as often, or the others never come ({exc})"
            ) from None
    else:
        dist.barrier(group=mesh.pp_group)


def parse_plan(plan, actions: list[str], buckets: int):
    """A step's plan read against the pipeline's ``actions`` (in schedule order) and the
    number of gradient ``buckets``: (per pipeline action: (its text, launches AllReduces
    as ready?), per pipeline action: the events after it), or PlanError naming the first
    action that cannot run (its ``at``: that action's index in the plan). The words are
    :data:`overlapkit.plans.HYBRID`'s; this says whether they run."""
    if isinstance(plan, str) or not hasattr(plan, "__iter__"):
        raise PlanError(f"a plan is a list of actions (strings), not {type(plan).__name__}")
    want = HYBRID.parse(actions)
    steps, after, reduced, finished = [], [], set(), False
    for i, raw in enumerate(plan):
        where = f"plan[{i}] {raw!r}"
        if not isinstance(raw, str):
            raise PlanError(f"{where}: each action is a string such as 'B 1' or 'reduce 0'", i)
        if finished:
            raise PlanError(f"{where} comes after 'finish', which ends the step", i)
        if raw.split()[:1] in (["F"], ["B"]):  # a pipeline action, right or wrong
            steps.append(_pipeline_action(where, i, raw, want, actions, len(steps)))
            after.append([])
            continue
        if not steps:
            raise PlanError(f"{where}: nothing to reduce before the first pipeline action", i)
        event = _event(where, i, raw, buckets, reduced)
        if event == ("flush",) and len(steps) < len(actions):
            raise PlanError(f"{where}: 'flush' waits until every stage has run all its actions, "
                            f"this one too: it goes after this stage's last, {actions[-1]!r} "
                            f"(here {actions[len(steps)]!r} is still to run, and the stages "
                            "that need it would wait for it for ever)", i)  # fmt: skip
        if isinstance(event, Finish):
            finished = True
        else:
            after[-1].append(event)
    if len(steps) < len(actions):
        raise PlanError(f"the plan stops before the schedule's {actions[len(steps)]!r}",
                        len(plan))  # fmt: skip
    readies = [i for i, (_, r) in enumerate(steps) if r]
    if len(readies) > 1 or (readies and reduced):
        last = next(text for text, _ in reversed(steps) if text.startswith("B"))
        raise PlanError(f"each bucket is reduced once: one 'B k ready' launches them all "
                        f"(on the last backward, {last + ' ready'!r}), with no 'reduce b' "
                        "besides")  # fmt: skip
    if not finished:
        raise PlanError("the plan never says 'finish': the AllReduces are never waited for",
                        len(plan))  # fmt: skip
    if buckets and not readies and len(reduced) < buckets:
        missing = sorted(set(range(buckets)) - reduced)
        raise PlanError(f"bucket(s) {missing} never reduced")
    return steps, after


def _pipeline_action(where: str, i: int, raw: str, want: list, actions: list[str], k: int):
    """``raw``, the plan's k-th pipeline action, as (the schedule's text, ready?), if it is
    the one the schedule runs k-th."""
    try:
        step = HYBRID.parse_step(raw)
    except PlanSyntaxError:
        step = None
    # as the schedule writes it: the same step written otherwise ("F 01") is not taken
    if (step is None or k >= len(want) or replace(step, ready=False) != want[k]
            or HYBRID.show_step(step) != " ".join(raw.split())):  # fmt: skip
        due = actions[k] if k < len(actions) else "nothing more: every action ran"
        order = " ".join(a.replace(" ", "") for a in actions)
        raise PlanError(f"{where}: the schedule runs {due!r} here (its actions, in "
                        f"order: {order})", i)  # fmt: skip
    if step.ready and step.op != "B":
        raise PlanError(f"{where}: only a backward launches AllReduces as it goes", i)
    return actions[k], step.ready


def _event(where: str, i: int, raw: str, buckets: int, reduced: set):
    """``raw``, a data-parallel event: ("reduce", b), ("flush",) or Finish() (bucket b
    noted in ``reduced``)."""
    try:
        step = HYBRID.parse_step(raw)
    except PlanSyntaxError:
        step = None
    if isinstance(step, Reduce) and step.bucket >= 0:
        b = step.bucket
        if b >= buckets:
            raise PlanError(f"{where}: there is no bucket {b} (buckets 0 … {buckets - 1})", i)
        if b in reduced:
            raise PlanError(f"{where}: bucket {b} is reduced twice", i)
        reduced.add(b)
        return ("reduce", b)
    if isinstance(step, Flush):
        return ("flush",)
    if isinstance(step, Finish):
        return step
    raise PlanError(f"{where}: not an action ({HYBRID.expected(',')})", i)


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
        for lane in (lane for lane in timeline.lanes if is_comm(lane)):
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
