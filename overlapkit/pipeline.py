"""Pipeline (model) parallelism: a model split into stages on consecutive ranks.

Stage s holds one piece of the model. A forward pass of a micro-batch runs
stage 0, sends its activation to stage 1, and so on; the backward pass sends
the gradient of each stage's input back the other way. With one batch and no
micro-batches only one stage works at a time; micro-batches keep several busy::

    sequential   s0 |F    |                  |B    |
                 s1       |F    |B    |                     idle: (p−1)/p of the time

    GPipe (m=4)  s0 |F0|F1|F2|F3|        |B0|B1|B2|B3|
                 s1    |F0|F1|F2|F3|B0|B1|B2|B3|          bubble (p−1)/(m+p−1)

    1F1B (m=4)   s0 |F0|F1|  |B0|F2|B1|F3|B2|  |B3|
                 s1    |F0|B0|F1|B1|F2|B2|F3|B3|          same bubble, but a stage holds
                                                           at most p micro-batches' activations

A schedule is data — :func:`make_schedule` returns each stage's list of
actions (:class:`~overlapkit.plans.Action`, written and read by :mod:`overlapkit.plans`)
— and :class:`PipelineStage` executes it. With ``overlap=True`` a stage
posts its receives early and does not wait for its sends, so activations and
gradients travel (over ``ok.Link`` when one is set) while the next micro-batch
computes; with ``overlap=False`` every send blocks until delivered and every
receive starts when the data is needed.

Gradients equal single-device training on the whole batch: each micro-batch's
loss is weighted by its share of the batch (micro-batches may differ in size
by one sample when the batch does not divide evenly).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from . import p2p, runtime
from .plans import PIPELINE, Action, format_schedule  # noqa: F401 - ok.pipeline's too

SCHEDULES = ("sequential", "gpipe", "1f1b")

#: header sent with the first activation of a step: status, batch, micro-batches, dtype,
#: ndim, then the per-sample shape (padded)
_HEADER = 16
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def make_schedule(name: str, stages: int, micro_batches: int,
                  extra_warmup: int = 0) -> list[list[Action]]:  # fmt: skip
    """Each stage's actions, in the order it runs them.

    * ``"sequential"``: the whole batch as one micro-batch: F0, B0;
    * ``"gpipe"``: all forwards, then all backwards (F0 … F(m−1), B0 … B(m−1));
    * ``"1f1b"``: stage s runs min(p−s−1, m) warm-up forwards, then alternates one
      forward and one backward, then drains the remaining backwards.

    ``extra_warmup`` (1F1B only) adds warm-up forwards on every stage but the last. Each
    1F1B micro-batch waits for a round trip — its activation out, its gradient back —
    so when transfers are slow, one more micro-batch in flight keeps the stages busy
    (at the price of holding its activations too)::

        1f1b       stage 0 |F0|F1|  |B0|F2|  |B1|…     waits for the round trip
        1f1b, +1   stage 0 |F0|F1|F2|B0|F3|B1|F4|…     the next forward fills it
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    if extra_warmup < 0:
        raise ValueError(f"extra_warmup must be ≥ 0, got {extra_warmup}")
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"stages and micro_batches must be ≥ 1, got {stages} and {micro_batches}")
    m = 1 if name == "sequential" else micro_batches
    out = []
    for s in range(stages):
        if name in ("sequential", "gpipe"):
            out.append([Action("F", k) for k in range(m)] + [Action("B", k) for k in range(m)])
            continue
        warmup = min(stages - s - 1 + (extra_warmup if s < stages - 1 else 0), m)
        acts = [Action("F", k) for k in range(warmup)]
        for k in range(m - warmup):
            acts += [Action("F", warmup + k), Action("B", k)]
        acts += [Action("B", k) for k in range(m - warmup, m)]
        out.append(acts)
    return out


# --------------------------------------------------------------------------- execution


@dataclass
class StepResult:
    """What one pipeline step did on this stage."""

    stage: int
    loss: float | None  # the whole batch's loss (last stage only)
    actions: list[str]  # the compute actions, in the order run
    peak_activations: int  # most micro-batches whose activations were held at once
    micro_sizes: list[int] = field(default_factory=list)


class PipelineError(RuntimeError):
    """A stage refused or failed the step; the message names the stage and shapes."""


class PipelineStage:
    """One stage of a pipeline: ``module`` on this rank, stage ``stage`` of ``stages``
    (default: this rank of all ranks). Neighbours are the ranks ``ranks[stage ± 1]``
    (default: consecutive ranks). Where it differs from PyTorch's pipelining: a stage's
    output is one tensor (not a tuple or dict), of the same dtype and per-sample shape
    for every micro-batch, and a stage after the first must use its input (refused with
    the stage and micro-batch named, not sent). And a batch that does not divide evenly
    is split into micro-batches one sample apart, each loss weighted by its share, where
    torch's schedules take equal micro-batches only (tests/test_parity.py compares the two
    on equal ones)."""

    def __init__(self, module: torch.nn.Module, stage: int | None = None,
                 stages: int | None = None, ranks: list[int] | None = None):  # fmt: skip
        self.module = module
        self.stages = runtime.world_size() if stages is None else stages
        self.stage = runtime.rank() if stage is None else stage
        self.ranks = list(range(self.stages)) if ranks is None else list(ranks)
        if not 0 <= self.stage < self.stages or len(self.ranks) != self.stages:
            raise ValueError(
                f"stage {self.stage} of {self.stages} stages on ranks {self.ranks}: the stage "
                "must be one of the stages, and each stage needs a rank"
            )

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    # ------------------------------------------------------------ the step
    def step(self, inputs=None, targets=None, loss_fn=None, micro_batches: int = 1,
             schedule: str = "1f1b", overlap: bool = True, timeline=None,
             extra_warmup: int = 0, around=None) -> StepResult:  # fmt: skip
        """Run one training step's forwards and backwards (gradients accumulate into the
        stage module's ``.grad``; call the optimizer after). Stage 0 gives ``inputs``; the
        last stage gives ``targets`` and ``loss_fn(output, target)`` (a mean over samples).
        ``extra_warmup``: see :func:`make_schedule`. ``around(i, action, plan)``, if
        given, returns a context manager each action ``plan[i]`` runs in, its sends issued
        (how ``ok.hybrid`` times the data-parallel AllReduce of a stage)."""
        run = _Run(self, schedule, micro_batches, overlap, timeline, extra_warmup)
        try:
            run.start(inputs, targets, loss_fn)
            for i, action in enumerate(run.plan):
                with around(i, action, run.plan) if around else contextlib.nullcontext():
                    (run.forward if action.op == "F" else run.backward)(action.micro)
            run.finish()
        except BaseException:
            run.abandon()
            raise
        loss = None if run.loss is None else float(run.loss)  # the one read of the device
        return StepResult(self.stage, loss, [str(a) for a in run.plan], run.peak, run.sizes)


class _Run:
    """The state of one step on one stage."""

    def __init__(self, stage: PipelineStage, schedule: str, m: int, overlap: bool, timeline,
                 extra_warmup: int = 0):  # fmt: skip
        self.st = stage
        if not isinstance(m, int) or m < 1:
            raise ValueError(f"micro_batches must be a positive int, got {m!r}")
        self.m = 1 if schedule == "sequential" else m
        # an unknown schedule name is refused here, the same on every stage
        self.plan = make_schedule(schedule, stage.stages, self.m, extra_warmup)[stage.stage]
        self.overlap = overlap
        self.timeline = timeline
        self.prev = None if stage.first else stage.ranks[stage.stage - 1]
        self.next = None if stage.last else stage.ranks[stage.stage + 1]
        self.stash: dict[int, tuple] = {}  # micro → (input, output or loss)
        self.peak = 0
        self.loss = None
        self.sends: list = []  # (tensor, handle, start, name) of sends not waited yet
        self.act_recv: dict[int, tuple] = {}  # micro → (buffer, handle)
        self.grad_recv: dict[int, tuple] = {}
        first = next(stage.module.parameters(), None)
        self.device = first.device if first is not None else runtime.device()

    # ------------------------------------------------------------ set-up
    def start(self, inputs, targets, loss_fn) -> None:
        st = self.st
        if st.first:
            if inputs is None:
                raise ValueError("stage 0 needs the batch's inputs: step(inputs=...)")
            self._check_batch(inputs.shape[0])
            self.batch = inputs.shape[0]
            self.inputs = list(torch.tensor_split(inputs, self.m))
        else:
            self._receive_header()
            if st.last and targets is not None and targets.shape[0] != self.batch:
                raise PipelineError(
                    f"stage {st.stage} (last) got targets for {targets.shape[0]} samples, but "
                    f"stage 0 sent a batch of {self.batch}"
                )
        self.sizes = [len(r) for r in torch.tensor_split(torch.arange(self.batch), self.m)]
        if st.last:
            if targets is None or loss_fn is None:
                raise ValueError(f"the last stage ({st.stage}) needs targets= and loss_fn=")
            self._check_batch(targets.shape[0])
            self.targets = list(torch.tensor_split(targets, self.m))
            self.loss_fn = loss_fn
            self.loss = 0.0
        if self.overlap and not st.first:
            self._post_act_recv(0)

    def _check_batch(self, batch: int) -> None:
        if self.m > batch:
            self._refuse(
                f"micro_batches={self.m} is larger than the batch ({batch} samples): each "
                "micro-batch needs at least one sample"
            )

    def _refuse(self, why: str) -> None:
        """Stage 0 tells the next stage that it refused the step, so nobody waits for it."""
        if self.st.first and self.next is not None:
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            header[0] = -1
            p2p.send(header, self.next)
        raise PipelineError(f"stage {self.st.stage}: {why}")

    def _receive_header(self) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        p2p.recv(header, self.prev)
        status, batch, m, dtype, ndim = header[:5].tolist()
        if status < 0:
            if self.next is not None:  # pass the refusal on down the pipeline
                p2p.send(header, self.next)
            raise PipelineError(
                f"stage {self.st.stage}: stage {self.st.stage - 1} refused the step (see its error)"
            )
        if m != self.m:
            raise PipelineError(
                f"stage {self.st.stage} runs {self.m} micro-batches, but stage "
                f"{self.st.stage - 1} sends {m}: every stage must be given the same micro_batches"
            )
        self.batch = batch
        self.act_dtype = _DTYPES[dtype]
        self.act_shape = tuple(header[5 : 5 + ndim].tolist())  # per sample

    def _send_header(self, out: torch.Tensor) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[1], header[2] = self.batch, self.m
        header[3] = _DTYPES.index(out.dtype)
        header[4] = out.dim() - 1
        header[5 : 5 + out.dim() - 1] = torch.tensor(out.shape[1:], device=self.device)
        p2p.send(header, self.next)

    # ------------------------------------------------------------ transfers
    def _post_act_recv(self, k: int) -> None:
        if k >= self.m or k in self.act_recv:
            return
        buf = torch.empty((self.sizes[k], *self.act_shape), dtype=self.act_dtype,
                          device=self.device)  # fmt: skip
        self.act_recv[k] = (buf, p2p.irecv(buf, self.prev))

    def _post_grad_recv(self, k: int, like: torch.Tensor) -> None:
        buf = torch.empty_like(like)
        self.grad_recv[k] = (buf, p2p.irecv(buf, self.next))

    def _send(self, tensor: torch.Tensor, dst: int, name: str) -> None:
        # the tensor must live until sent
        self.sends.append((tensor, p2p.isend(tensor, dst), time.perf_counter(), name))

    def _waited(self, handle, start: float, name: str) -> None:
        """Wait for a send; its span ends when its last byte left the (emulated) link,
        which may be well before this wait, or else when the wait returned."""
        handle.wait()
        if self.timeline is not None:
            now, left = time.perf_counter(), p2p.completed_at(handle)
            self.timeline.add(name, start, min(now, left) if left and left > start else now, "comm")

    def _serialise(self) -> None:
        """Without overlap, a stage computes only once its sends have arrived. (It waits
        for them *after* posting the receive its next action needs, as Megatron pairs a
        send with the next receive: where a send completes only when the peer receives,
        1F1B's crossing sends would otherwise wait for each other forever.)"""
        if not self.overlap:
            for _, handle, start, name in self.sends:
                self._waited(handle, start, name)
            self.sends.clear()

    def _stamp(self):
        """Now, for a compute span: the GPU's moment where the stage is on one."""
        return time.perf_counter() if self.timeline is None else self.timeline.stamp(self.device)

    def _span(self, name: str, start) -> None:
        if self.timeline is not None:
            self.timeline.add(name, start, self._stamp(), "compute")

    # ------------------------------------------------------------ actions
    def forward(self, k: int) -> None:
        st = self.st
        if st.first:
            x = self.inputs[k]
            self._serialise()
        else:
            if k not in self.act_recv:
                self._post_act_recv(k)
            x, handle = self.act_recv.pop(k)
            self._serialise()
            handle.wait()
            x.requires_grad_(True)
            if self.overlap:
                self._post_act_recv(k + 1)  # the next one travels while this computes
        start = self._stamp()
        try:
            out = st.module(x)
        except Exception as exc:
            raise PipelineError(
                f"stage {st.stage}: its module failed on micro-batch {k} of shape "
                f"{list(x.shape)}"
                + ("" if st.first else f" (the activation stage {st.stage - 1} sent)")
                + f": {type(exc).__name__}: {exc}"
            ) from exc
        if st.last:
            target = self.targets[k]
            loss = self.loss_fn(out, target) * (self.sizes[k] / self.batch)
            # summed on the device, read once at the end: a .item() per micro-batch would
            # make the host wait for the GPU each time (no kernel queued ahead: no overlap)
            self.loss = self.loss + loss.detach()
            self.stash[k] = (x, loss)
        else:
            if not isinstance(out, torch.Tensor):
                raise PipelineError(
                    f"stage {st.stage}: its module returned a {type(out).__name__} on "
                    f"micro-batch {k}; the kit's pipeline sends one tensor from stage to stage "
                    "(PyTorch's pipelining also takes tuples): return one tensor, e.g. "
                    "torch.cat of the parts, and split it in the next stage"
                )
            if k == 0:
                self._send_header(out)
                self.act_shape, self.out_dtype = tuple(out.shape[1:]), out.dtype
            elif tuple(out.shape[1:]) != self.act_shape or out.dtype != self.out_dtype:
                raise PipelineError(
                    f"stage {st.stage}: micro-batch {k}'s output is {list(out.shape)} "
                    f"{out.dtype}, but micro-batch 0's was {list(self.act_shape)} per sample, "
                    f"{self.out_dtype}: the next stage's receive buffers are made from "
                    "micro-batch 0's"
                )
            self.stash[k] = (x, out)
        self._span(f"F{k}", start)
        self.peak = max(self.peak, len(self.stash))
        if not st.last:
            self._send(out.detach(), self.next, f"act {k}")
            if self.overlap:
                self._post_grad_recv(k, out)

    def backward(self, k: int) -> None:
        st = self.st
        x, y = self.stash.pop(k)
        if st.last:
            self._serialise()
            start = self._stamp()
            y.backward()
        else:
            if k not in self.grad_recv:
                self._post_grad_recv(k, y)
            grad, handle = self.grad_recv.pop(k)
            self._serialise()
            handle.wait()
            start = self._stamp()
            y.backward(grad)
        self._span(f"B{k}", start)
        if not st.first:
            if x.grad is None:
                raise PipelineError(
                    f"stage {st.stage}: micro-batch {k}'s input got no gradient: its module's "
                    f"output does not depend on the activation stage {st.stage - 1} sent, so "
                    "nothing reaches the stages before it. Use the input."
                )
            self._send(x.grad, self.prev, f"grad {k}")

    # ------------------------------------------------------------ end
    def finish(self) -> None:
        for _, handle, start, name in self.sends:
            self._waited(handle, start, name)
        self.sends.clear()
        if self.act_recv or self.grad_recv:
            left = sorted(self.act_recv) + sorted(self.grad_recv)
            raise PipelineError(f"stage {self.st.stage}: receives posted but never used: {left}")

    def abandon(self) -> None:
        """After a failure: forget what was in flight (the launch ends the ranks)."""
        self.sends.clear()
        self.act_recv.clear()
        self.grad_recv.clear()


# --------------------------------------------------------------------------- one device


def run_on_one_device(stages: list[torch.nn.Module], inputs, targets, loss_fn,
                      micro_batches: int = 1, schedule: str = "1f1b", timeline=None,
                      extra_warmup: int = 0) -> StepResult:  # fmt: skip
    """Every stage in this process, on one device: on a GPU each stage runs on a CUDA
    stream of its own, ordered by events (F of micro-batch k on stage s waits for F on
    s−1; B waits for B on s+1), so two stages' kernels run at the same time, as two GPUs
    would; on a CPU the actions run one after another in the schedule's order (the
    gradients are the same, nothing overlaps). Returns the last stage's loss and the order
    the actions were issued in; ``timeline`` gets one lane per stage (CUDA events on a GPU).
    """
    p = len(stages)
    m = 1 if schedule == "sequential" else micro_batches
    plan = make_schedule(schedule, p, m, extra_warmup)
    if m > inputs.shape[0]:
        raise PipelineError(
            f"micro_batches={m} is larger than the batch ({inputs.shape[0]} samples): each "
            "micro-batch needs at least one sample"
        )
    # issue the actions in the order a pipeline of unit-cost actions would run them
    from .costmodel import pipeline_step  # noqa: PLC0415 - the simulation gives the order

    order = sorted(pipeline_step(plan, 1.0, 2.0)["spans"], key=lambda a: (a[2], a[0]))
    run = _OneDevice(stages, inputs, targets, loss_fn, m, timeline)
    for s, name, _, _ in order:
        run.do(s, PIPELINE.parse_step(name))
    return run.result()


class _OneDevice:
    """The state of one step of every stage in this process: what each stage holds, and
    what one stage has made for the next (an activation, a gradient) with the event that
    says it is done on that stage's stream."""

    def __init__(self, stages, inputs, targets, loss_fn, m: int, timeline):
        self.stages, self.loss_fn, self.timeline = stages, loss_fn, timeline
        self.p = len(stages)
        self.device = inputs.device
        self.cuda = self.device.type == "cuda"
        self.streams = (
            [torch.cuda.Stream(self.device) for _ in stages] if self.cuda else [None] * self.p
        )
        for stream in self.streams if self.cuda else ():
            stream.wait_stream(torch.cuda.current_stream(self.device))  # after the inputs are made
        self.xs, self.ys = torch.tensor_split(inputs, m), torch.tensor_split(targets, m)
        self.batch = inputs.shape[0]
        self.stash: dict = {}  # (stage, k) -> (input, output or loss)
        self.ready: dict = {}  # ("act"|"grad", stage, k) -> (tensor, event)
        self.losses, self.issued = [], []
        self.held = [0] * self.p
        self.peak = 0

    def do(self, s: int, action: Action) -> None:
        name, stream = str(action), self.streams[s]
        span = (self.timeline.cuda_span(name, f"stage {s}", stream) if self.cuda and self.timeline
                else _host_span(self.timeline, name, f"stage {s}"))  # fmt: skip
        with torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext():
            (self._forward if action.op == "F" else self._backward)(s, action.micro, span)
        self.issued.append(f"{s}:{name}")

    def _arrived(self, key: tuple, stream):
        tensor, event = self.ready.pop(key)
        if self.cuda:
            stream.wait_event(event)
            tensor.record_stream(stream)
        return tensor

    def _forward(self, s: int, k: int, span) -> None:
        stream = self.streams[s]
        x = self.xs[k] if s == 0 else self._arrived(("act", s, k), stream)
        if s > 0:
            x = x.detach().requires_grad_(True)
        with span:
            out = self.stages[s](x)
            if s == self.p - 1:
                out = self.loss_fn(out, self.ys[k]) * (len(self.ys[k]) / self.batch)
                self.losses.append(out)
        self.stash[(s, k)] = (x, out)
        self.held[s] += 1
        self.peak = max(self.peak, self.held[s])
        if s < self.p - 1:
            self.ready[("act", s + 1, k)] = (out, _mark(stream))

    def _backward(self, s: int, k: int, span) -> None:
        x, out = self.stash.pop((s, k))
        self.held[s] -= 1
        if s == self.p - 1:
            with span:
                out.backward()
        else:
            grad = self._arrived(("grad", s, k), self.streams[s])
            with span:
                out.backward(grad)
        if s > 0:
            self.ready[("grad", s - 1, k)] = (x.grad, _mark(self.streams[s]))

    def result(self) -> StepResult:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        total = sum(loss.item() for loss in self.losses)
        return StepResult(self.p - 1, total, self.issued, peak_activations=self.peak,
                          micro_sizes=[len(x) for x in self.xs])  # fmt: skip


def _mark(stream):
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


@contextlib.contextmanager
def _host_span(timeline, name: str, lane: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        if timeline is not None:
            timeline.add(name, start, time.perf_counter(), lane)
