"""Training loops that trade synchrony for speed: synchronous SGD, stale-gradient SGD,
local SGD and gradient accumulation, with a straggler knob.

Run :func:`train` on every rank (inside ``ok.launch``). Each step a rank computes the
gradient of its own batch; what happens next is the mode::

    sync         grad ─► AllReduce ─► update                         every step waits for all
    stale (d)    grad ─► AllReduce started … applied d steps later   d steps of compute hide it;
                                                                     the update uses a gradient
                                                                     d steps old
    local (k)    k updates on the rank's own gradients, then the parameters are averaged
    accumulate   k gradients summed locally (no communication), one AllReduce, one update
    (k)

Stale gradients can be *compensated* (DC-ASGD, Zheng et al. 2017): a gradient computed at
the parameters w_then and applied at w_now is first moved towards the one at w_now by a
first-order step whose Hessian is approximated by λ·g⊙g (``compensate=λ``)::

    g_now ≈ g + λ · g ⊙ g ⊙ (w_now − w_then)

and ``clip=c`` scales any applied gradient whose norm exceeds c down to c (in every mode).

``slow={rank: factor}`` makes that rank a straggler: its forward and backward are
stretched (by sleeping) to ``factor`` times the usual compute of a step — the slowest
rank's median, timed on every rank before training — so "15% slower" means 15% slower
than the others, whatever the machine does to them. In ``sync`` every
step then waits for it; the other modes wait for it less often.

``compute=seconds`` emulates a heavier model: every rank's forward and backward are
stretched (by sleeping) to that many seconds per step, as a GPU's kernels take while the
CPU that launched them waits. A sleeping rank does not compete for the cores, so on a
small, busy machine step times are set by the run and its link, not by whatever else the
machine runs; a straggler's ``factor`` then multiplies these seconds.

Every rank starts from the same parameters (rank 0's, broadcast) and reads its own
batches from one seeded stream, so a run is reproducible. The returned history holds,
per step, the wall time since the start and the loss of the *averaged* model on a fixed
evaluation set (what a checkpoint of the run would score), measured outside the timed
step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from . import runtime
from .builtin import builtin_all_reduce
from .collectives import ring_all_reduce
from .compression import Compressor
from .handles import Done

__all__ = ["Task", "train", "History", "MODES", "builtin_all_reduce"]

MODES = ("sync", "stale", "local", "accumulate")
POOL = 64  # batches of data per rank, made up front and cycled


@dataclass
class Task:
    """A regression task that trains in seconds: a student MLP learns a fixed random
    teacher MLP from noisy samples. ``outputs`` and ``teacher_hidden`` make it harder: a
    teacher of many outputs gives gradients of high rank, which a compressor that drops
    what it does not send (lab 13) learns visibly worse."""

    inputs: int = 32
    hidden: int = 64
    batch: int = 64
    noise: float = 0.05
    seed: int = 0
    outputs: int = 1
    teacher_hidden: int = 16
    teacher: torch.nn.Module = field(init=False, repr=False)

    def __post_init__(self):
        gen = torch.Generator().manual_seed(self.seed)
        with torch.random.fork_rng():
            torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
            self.teacher = torch.nn.Sequential(
                torch.nn.Linear(self.inputs, self.teacher_hidden), torch.nn.Tanh(),
                torch.nn.Linear(self.teacher_hidden, self.outputs),
            )  # fmt: skip
        self.eval_x, self.eval_y = self.batch_of(4096, torch.Generator().manual_seed(10**6))

    def batch_of(self, n: int, gen: torch.Generator):
        x = torch.randn(n, self.inputs, generator=gen)
        with torch.no_grad():
            y = self.teacher(x) + self.noise * torch.randn(n, self.outputs, generator=gen)
        return x, y

    def model(self) -> torch.nn.Module:
        """The student MLP, with the same initial weights on every rank and every call,
        drawn without touching the caller's random numbers (its dropout, its sampling)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + 1)
            return self._student()

    def _student(self) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(self.inputs, self.hidden), torch.nn.Tanh(),
            torch.nn.Linear(self.hidden, self.hidden), torch.nn.Tanh(),
            torch.nn.Linear(self.hidden, self.outputs),
        )  # fmt: skip


@dataclass
class History:
    """What :func:`train` returns on each rank."""

    mode: str
    step: list[int] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)  # seconds since the start
    loss: list[float] = field(default_factory=list)  # the averaged model's eval loss
    step_time: list[float] = field(default_factory=list)  # seconds per step, this rank
    compute_time: list[float] = field(default_factory=list)  # forward+backward (+ slowdown)


def _alone(tensor, op="sum", async_op=False):
    """The AllReduce of one rank: the tensor as it is (a done handle when async)."""
    return Done() if async_op else None


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _apply(model, flat: torch.Tensor, lr: float) -> None:
    at = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p -= lr * flat[at : at + n].view_as(p)
            at += n


def _parameters(model) -> torch.Tensor:
    return parameters_to_vector(model.parameters()).detach().clone()


def _compensated(grad: torch.Tensor, lam: float, moved: torch.Tensor) -> torch.Tensor:
    """DC-ASGD: a gradient taken before the parameters ``moved``, carried to where they are
    now by a Taylor step whose Hessian is approximated by λ·g⊙g (every rank has the same
    averaged g and the same parameters, so every rank compensates alike)::

        g_now ≈ g + λ · g ⊙ g ⊙ (w_now − w_then)
    """
    return grad + lam * grad * grad * moved


def _clipped(grad: torch.Tensor, clip: float | None) -> torch.Tensor:
    """``grad`` scaled down to norm ``clip`` if it is longer (as clip_grad_norm_ does)."""
    if clip is None:
        return grad
    norm = torch.linalg.vector_norm(grad)
    return grad * (clip / norm) if norm > clip else grad


def _averaged(model, all_reduce) -> torch.Tensor:
    """Every parameter of ``model``, flat, averaged over the ranks (one AllReduce)."""
    flat = parameters_to_vector(model.parameters()).detach()
    all_reduce(flat, op="avg")
    return flat


def _average_parameters(model, all_reduce) -> None:
    vector_to_parameters(_averaged(model, all_reduce), model.parameters())


def emulate_compute(seconds: float) -> None:
    """Be busy for ``seconds``, as a GPU kernel keeps its stream: asleep, so the rank's
    communication worker has the cores, but for the last millisecond, which is spent
    yielding in a loop — a plain sleep on a busy VM wakes up to a millisecond late,
    which would make a "15% slower" rank 25% slower."""
    deadline = time.perf_counter() + seconds
    if seconds > 2e-3:
        time.sleep(seconds - 1e-3)
    while time.perf_counter() < deadline:
        time.sleep(0)


def _nominal_compute(model, pool, micro: int, reps: int = 11, warmup: int = 3) -> float:
    """The usual forward+backward time of a step, the slowest rank's median (every rank
    takes part): what a straggler's ``factor`` multiplies. Gradients are cleared after."""
    times = []
    for i in range(warmup + reps):  # the first passes also allocate: not counted
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)  # as a step does
        for j in range(micro):
            x, y = pool[(i * micro + j) % len(pool)]
            torch.nn.functional.mse_loss(model(x), y).backward()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    t = torch.tensor([sorted(times)[reps // 2]], dtype=torch.float64)
    if runtime.world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _eval_loss(task: Task, model, all_reduce) -> float:
    """The evaluation loss of the average of every rank's parameters."""
    probe = task.model()
    vector_to_parameters(_averaged(model, all_reduce), probe.parameters())
    with torch.no_grad():
        return torch.nn.functional.mse_loss(probe(task.eval_x), task.eval_y).item()


def _check_arguments(mode, steps, staleness, local_steps, accumulate, compensate, clip,
                     slow: dict, compute) -> None:  # fmt: skip
    """:func:`train`'s arguments, checked before anything runs."""
    if compute is not None and not (isinstance(compute, int | float) and compute > 0):
        raise ValueError(f"compute is the seconds of emulated compute per step, > 0 (or None); "
                         f"got {compute!r}")  # fmt: skip
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    for name, value in (("staleness", staleness), ("local_steps", local_steps),
                        ("accumulate", accumulate), ("steps", steps)):  # fmt: skip
        if not isinstance(value, int) or value < (0 if name == "staleness" else 1):
            raise ValueError(f"{name} must be an integer ≥ {0 if name == 'staleness' else 1}, "
                             f"got {value!r}")  # fmt: skip
    if isinstance(compensate, bool) or not isinstance(compensate, int | float) or compensate < 0:
        raise ValueError(f"compensate is DC-ASGD's λ ≥ 0; got {compensate!r}")
    if compensate and mode != "stale":
        raise ValueError(f"compensate= corrects stale gradients: it needs mode='stale', "
                         f"not {mode!r}")  # fmt: skip
    if clip is not None and not (isinstance(clip, int | float) and clip > 0):
        raise ValueError(f"clip is the largest gradient norm applied, > 0 (or None); got {clip!r}")
    world = runtime.world_size()
    for rank, factor in slow.items():
        if not 0 <= rank < world or not factor >= 1:
            raise ValueError(f"slow={slow}: give {{rank: factor ≥ 1}} for ranks 0…{world - 1}")


def _collective(all_reduce, world: int) -> tuple:
    """:func:`train`'s ``all_reduce`` argument as (the collective, the compressor or None)."""
    compressor = all_reduce if isinstance(all_reduce, Compressor) else None
    if compressor is not None:
        all_reduce = ring_all_reduce
    if all_reduce is None or (isinstance(all_reduce, str) and all_reduce == "ring"):
        all_reduce = ring_all_reduce
    elif isinstance(all_reduce, str) and all_reduce == "builtin":
        all_reduce = builtin_all_reduce
    elif not callable(all_reduce):
        raise ValueError(f"all_reduce must be 'ring' (the default), 'builtin', a compressor of "
                         f"ok.compression or a function; got {all_reduce!r}")  # fmt: skip
    if world == 1:  # nothing to exchange; the modes still delay and batch as they do
        all_reduce, compressor = _alone, None
    return all_reduce, compressor


def _compute(model, pool, step: int, micro: int, stretched: tuple, span, t0: float) -> float:
    """Step ``step``'s gradient: ``micro`` batches of the ``pool`` (their mean), forward and
    backward, begun at ``t0``; ``stretched = (emulated, total)``: stretched to ``emulated``
    seconds of emulated compute, then to ``total`` seconds by straggling (either 0: not
    stretched). Returns the seconds since ``t0``."""
    emulated, total = stretched
    model.zero_grad(set_to_none=True)
    for i in range(micro):
        x, y = pool[((step - 1) * micro + i) % len(pool)]
        (torch.nn.functional.mse_loss(model(x), y) / micro).backward()
    span("forward+backward", t0)
    for seconds, name in ((emulated, "emulated compute"), (total, "straggling")):
        if seconds > time.perf_counter() - t0:
            t1 = time.perf_counter()
            emulate_compute(seconds - (t1 - t0))
            span(name, t1)
    return time.perf_counter() - t0


def _stretched(factor: float, slow: dict, compute: float | None, model, pool, micro: int):
    """``(emulated, total)`` seconds of this rank's compute per step (see :func:`_compute`):
    emulated ``compute`` seconds, times this rank's straggler ``factor`` in all; without
    ``compute``, ``factor`` times the slowest rank's usual compute where any rank is ``slow``
    (every rank takes part in timing it)."""
    if compute:
        return compute, factor * compute
    if not slow:
        return 0.0, 0.0
    nominal = _nominal_compute(model, pool, micro)  # on every rank: it is collective
    return 0.0, factor * nominal if factor > 1 else 0.0


def _start(task: Task, model, world: int, me: int, batches: int) -> list:
    """Every rank on rank 0's parameters, and the rank's data: made before the clock starts
    (as a loader that keeps up would), a pool of batches cycled through (``batches`` of
    them, at most :data:`POOL`), so a step times the model, not the data."""
    if world > 1:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    gen = torch.Generator().manual_seed(task.seed * 1000 + me + 7)
    return [task.batch_of(task.batch, gen) for _ in range(min(batches, POOL))]


def _spans(timeline):
    """``span(name, start, lane="compute")``: from ``start`` to now on ``timeline`` (if any)."""

    def span(name, start, lane="compute"):
        if timeline is not None:
            timeline.add(name, start, time.perf_counter(), lane)

    return span


def train(task: Task, steps: int = 200, lr: float = 0.05, mode: str = "sync",
          staleness: int = 1, local_steps: int = 4, accumulate: int = 4,
          slow: dict | None = None, eval_every: int = 10, all_reduce=None, timeline=None,
          compensate: float = 0.0, clip: float | None = None,
          compute: float | None = None) -> History:  # fmt: skip
    """Train ``task``'s model for ``steps`` steps on every rank; see the module's text.

    ``all_reduce(tensor, op=..., async_op=...)``: the collective (default the kit's ring,
    over the link when one is set; ``"builtin"``: :func:`builtin_all_reduce`); or a
    compressor of ``ok.compression``, which then averages the gradients (the whole model's,
    one bucket) while the parameters and evaluations are averaged exactly by the ring.
    ``timeline`` gets compute, straggler and comm spans. ``compensate``: DC-ASGD's λ for
    stale gradients; ``clip``: the largest gradient norm applied; ``compute``: the seconds
    of emulated compute per step (all three in the module's text).
    """
    slow = slow or {}
    _check_arguments(mode, steps, staleness, local_steps, accumulate, compensate, clip, slow,
                     compute)  # fmt: skip
    world, me = runtime.world_size(), runtime.rank()
    all_reduce, compressor = _collective(all_reduce, world)
    model = task.model()
    shapes = [p.shape for p in model.parameters()]

    def average_gradient(grad, async_op=False):
        if compressor is None:
            return all_reduce(grad, op="avg", async_op=async_op)
        return compressor(grad, shapes=shapes, async_op=async_op)

    micro = accumulate if mode == "accumulate" else 1
    pool = _start(task, model, world, me, steps * micro)
    history = History(mode)
    in_flight: deque = deque()  # stale mode: (handle, gradient, start, w_then) oldest first
    clock = 0.0  # training time only: evaluation is not counted
    span = _spans(timeline)

    def record(step):
        history.step.append(step)
        history.wall.append(clock)
        history.loss.append(_eval_loss(task, model, all_reduce))

    stretched = _stretched(float(slow.get(me, 1.0)), slow, compute, model, pool, micro)
    # no barrier between steps: a rank waits only where its mode communicates (and at the
    # evaluations, whose time is not counted): a fast rank runs ahead as far as it lets it
    record(0)
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        # ---- compute: one gradient (or `accumulate` of them), slowed on a straggler
        history.compute_time.append(_compute(model, pool, step, micro, stretched, span, t0))
        grad = _flat_grads(model)
        # ---- communicate and update, by mode
        t2 = time.perf_counter()
        if mode in ("sync", "accumulate"):
            average_gradient(grad)
            span("all_reduce", t2, "comm")
            _apply(model, _clipped(grad, clip), lr)
        elif mode == "stale":
            if staleness == 0:
                average_gradient(grad)
                _apply(model, _clipped(grad, clip), lr)
            else:
                w_then = _parameters(model) if compensate else None
                in_flight.append((average_gradient(grad, async_op=True), grad, t2, w_then))
                if len(in_flight) > staleness:  # the gradient of `staleness` steps ago
                    handle, old, started, w_then = in_flight.popleft()
                    handle.wait()
                    span("all_reduce (stale)", started, "comm")
                    if compensate:
                        old = _compensated(old, compensate, _parameters(model) - w_then)
                    _apply(model, _clipped(old, clip), lr)
        else:  # local SGD
            _apply(model, _clipped(grad, clip), lr)
            if step % local_steps == 0:
                _average_parameters(model, all_reduce)
                span("average parameters", t2, "comm")
        elapsed = time.perf_counter() - t0
        history.step_time.append(elapsed)
        clock += elapsed
        if step % eval_every == 0 or step == steps:
            record(step)
    for handle, *_ in in_flight:  # nothing left running
        handle.wait()
    return history
