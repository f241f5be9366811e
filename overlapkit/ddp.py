"""Data parallelism that hides the gradient AllReduce under backward.

Every rank holds the whole model, trains on its own slice of the batch, and
averages the gradients with an AllReduce before the optimizer step. Three ways
to schedule that AllReduce, from slowest to fastest::

    NaiveDDP       backward |████████████████|
                   comm                      |▒▒▒▒▒▒▒▒▒▒▒▒▒▒▒▒|        all of it exposed

    OverlapDDP     backward |████████████████|
                   comm       |▒|  |▒|  |▒|  |▒|▒|                    one AllReduce per
                                                                      parameter, each paying α

    BucketedDDP    backward |████████████████|
                   comm          |▒▒▒▒▒|  |▒▒▒▒▒|▒▒|                  a few big messages;
                                                  ^^ the last bucket  only the tail is exposed
                                                     cannot hide

Gradients become ready in about *reverse* parameter order (backward runs from the
loss towards the input), so buckets are filled in that order at first; after the first
step, in the order the gradients did arrive on rank 0 (as PyTorch's reducer rebuilds its
buckets), which differs where a layer is used before one registered ahead of it. A parameter's
``post_accumulate_grad`` hook fires once its gradient is complete for this
backward; the wrapper launches a bucket the moment all its gradients are in —
and only after every earlier bucket was launched, so that every rank issues
the same AllReduces in the same order (matching is by issue order, as in NCCL).

Contract (shared with PyTorch's ``DistributedDataParallel``, side by side with it in
``tests/test_parity.py``): rank 0's parameters and buffers are broadcast at construction,
and its buffers again before each forward that follows a training forward outside
``no_sync()``, as PyTorch's DDP decides it (``broadcast_buffers=False`` keeps each rank's
own; the broadcast is the built-in one, outside an emulated link); ``.module`` is the wrapped
model; ``parameters()`` are the model's; gradients are **averaged**; frozen parameters
are left alone; a tied parameter is reduced once; a parameter that got no gradient on a
rank this step contributes zeros there (as ``find_unused_parameters``), and keeps
``grad=None`` if no rank used it (the last bucket carries one element per parameter
saying which ranks did). Call ``finish_gradient_synchronization()`` after ``backward()``
and before ``optimizer.step()``; inside ``no_sync()`` gradients only accumulate.

The wrappers live here; which collective averages a bucket (and the comm hook for PyTorch's
DDP) in :mod:`overlapkit.ddp_reduce`, the measurements the cost model is fed in
:mod:`overlapkit.ddp_measure`. Both are re-exported from here.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import weakref

import torch
import torch.distributed as dist

# what is only re-exported here (noqa: F401) is what kit code, labs and tests reach through
# ``ok.ddp``: ``ok.ddp.ring_all_reduce`` too, the kit's ring under another module's name
from . import runtime
from .collectives import buckets_by_size, ring_all_reduce  # noqa: F401
from .compression import Compressor, Half
from .ddp_measure import (  # noqa: F401
    BackwardProfile,
    measure_host_cost,
    profile_backward,
)
from .ddp_reduce import _own_group, _resolve_all_reduce, ddp_comm_hook  # noqa: F401
from .handles import Done

__all__ = [
    "NaiveDDP",
    "OverlapDDP",
    "BucketedDDP",
    "ddp_comm_hook",
    "profile_backward",
    "BackwardProfile",
    "measure_host_cost",
]


# --------------------------------------------------------------------------- the wrappers


class _DataParallel(torch.nn.Module):
    """Buckets of gradients, launched in order as they fill (``overlap``) or after backward."""

    overlap = True

    def __init__(self, module: torch.nn.Module, bucket_mb, all_reduce=None, group=None,
                 timeline=None, broadcast_buffers=True):  # fmt: skip
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} needs torch.distributed initialised: build it "
                "inside a function run by ok.launch (or under torchrun)"
            )
        if bucket_mb is not None and not bucket_mb > 0:
            raise ValueError(
                f"bucket_mb must be positive (or None for one bucket), got {bucket_mb!r}"
            )
        self.module = module
        self.timeline = timeline
        self.group = group
        self.broadcast_buffers = broadcast_buffers
        self.world = dist.get_world_size(group)
        # the global rank of the group's rank 0: whose weights, buffers and bucket order count
        self._rank0 = 0 if group is None else dist.get_global_rank(group, 0)
        # parameters() yields a tied parameter once: it is reduced once
        self._params = [p for p in module.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError(
                f"{type(module).__name__} has no trainable parameters (all frozen, or none): "
                "there is no gradient to synchronise"
            )
        names = {id(p): n for n, p in module.named_parameters()}
        self._names = [names[id(p)] for p in reversed(self._params)]
        # gradients become ready from the last layer to the first
        self._order = list(reversed(self._params))
        self._index = {id(p): i for i, p in enumerate(self._order)}
        self._reduce, self._comm_group, self._averages = _resolve_all_reduce(all_reduce, group)
        self._check_same_model()
        self._broadcast_from_rank0()
        self._bucket_mb, self._rebuilt = bucket_mb, False
        self.buckets = self._make_buckets(bucket_mb)
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._flats: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]
        previous = getattr(module, "_overlapkit_ddp", None)
        if previous is not None and previous() is not None:
            previous()._detach()  # the newest wrapper of a module owns its gradients
        object.__setattr__(module, "_overlapkit_ddp", weakref.ref(self))
        self._no_sync = 0
        self._sync_buffers_next = True
        self._reset("idle")

    # ------------------------------------------------------------ construction
    def _make_buckets(self, bucket_mb) -> list[list[int]]:
        """Indices into the ready order (reverse parameter order), grouped by size."""
        if bucket_mb is None:
            bucket_mb = float("inf")
        return buckets_by_size(self._order, bucket_mb)

    def _check_same_model(self) -> None:
        """Every rank must wrap the same architecture: compare names, shapes and dtypes
        before anything is exchanged (a mismatch would be a hang or garbage later)."""
        mine = [
            (n, tuple(p.shape), str(p.dtype))
            for n, p in self.module.named_parameters()
            if p.requires_grad
        ]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self._comm_group)
        reference = everyone[0]
        for r, theirs in enumerate(everyone[1:], start=1):
            if theirs == reference:
                continue
            for k in range(max(len(theirs), len(reference))):
                a = reference[k] if k < len(reference) else None
                b = theirs[k] if k < len(theirs) else None
                if a != b:
                    raise ValueError(
                        f"{type(self).__name__}: rank {r}'s model differs from rank 0's at "
                        f"trainable parameter #{k}: rank 0 has {_describe(a)}, rank {r} has "
                        f"{_describe(b)}. Every rank must build the same model."
                    )

    @torch.no_grad()
    def _broadcast_from_rank0(self, buffers_only: bool = False) -> None:
        """Rank 0's (of the group) parameters and buffers, or buffers alone, on every rank:
        one broadcast per dtype and device (BatchNorm alone has three buffers a layer)."""
        tensors = [*([] if buffers_only else self.module.parameters()), *self.module.buffers()]
        kinds: dict = {}
        for t in tensors:
            kinds.setdefault((t.dtype, t.device), []).append(t)
        for same in kinds.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            dist.broadcast(flat, src=self._rank0, group=self._comm_group)
            offset = 0
            for t in same:
                t.data.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def _detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------ per step
    def _reset(self, state: str) -> None:
        self._state = state
        self._pending = [len(idx) for idx in self.buckets]
        self._got: set[int] = set()
        self._arrived: list[int] = []  # this step's gradients, in the order they came
        self._unused_here: list = []  # (parameter, its reduced gradient) without .grad here
        self._next = 0
        self._inflight: list = []
        self._backward_start = self._backward_end = None

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            if self._state == "backward" and not self._no_sync:
                raise RuntimeError(
                    f"{type(self).__name__}: a new forward started while the previous "
                    "backward's gradients were never synchronised: call "
                    "finish_gradient_synchronization() before optimizer.step(), every step "
                    "(or accumulate inside no_sync())"
                )
            if self._state != "backward":
                self._state = "forward"
        if self.broadcast_buffers and self._sync_buffers_next:
            # as PyTorch's DDP (broadcast_buffers=True): rank 0's buffers (BatchNorm's
            # running statistics) before a forward that follows a synchronised training
            # forward (the first one too), so that the replicas agree
            if next(self.module.buffers(), None) is not None:
                self._broadcast_from_rank0(buffers_only=True)
        self._sync_buffers_next = torch.is_grad_enabled() and not self._no_sync
        start = self._stamp()
        out = self.module(*args, **kwargs)
        if self.timeline is not None:
            self.timeline.add("forward", start, self._stamp(), "compute")
        if torch.is_grad_enabled() and not self._no_sync:
            self._hook_outputs(out)
        return out

    def _stamp(self):
        """Now, for a span of the timeline: the GPU's moment where the model is on one."""
        if self.timeline is None:
            return time.perf_counter()
        return self.timeline.stamp(next(self.module.parameters()).device)

    def _hook_outputs(self, out) -> None:
        """The first gradient reaching an output marks the start of this module's backward."""
        for t in _tensors(out):
            if t.requires_grad:
                t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad):
        if self._backward_start is None:
            self._backward_start = self._stamp()
        if self._state != "synced":
            self._state = "backward"

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._no_sync:
            return  # accumulate only; the next synchronised backward reduces the sum
        now = self._stamp()
        if self._backward_start is None:
            self._backward_start = now
        self._backward_end = now
        self._state = "backward"
        i = self._index[id(p)]
        if i in self._got:
            raise RuntimeError(
                f"{type(self).__name__}: the gradient of {self._names[i]!r} became ready twice "
                "in one step: call finish_gradient_synchronization() after each backward, or "
                "accumulate gradients inside no_sync()"
            )
        self._got.add(i)
        self._arrived.append(i)
        self._pending[self._bucket_of[i]] -= 1
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch full buckets, in bucket order: a full bucket waits for earlier ones."""
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    @torch.no_grad()
    def _launch(self, b: int):
        """All-reduce bucket ``b``'s flat buffer. Each gradient becomes a view into that
        buffer (as PyTorch's ``gradient_as_bucket_view``): the next backward, after an
        in-place ``zero_grad(set_to_none=False)``, accumulates right into it — no copy
        in — and the average lands in ``.grad`` itself — no copy out."""
        idx = self.buckets[b]
        flat = self._flats[b]
        # the last bucket also carries which parameters this rank used, one element each
        # (PyTorch's used-parameter bitmap, without a message of its own): by its launch
        # every other bucket is launched, so every parameter's use is known
        last = b == len(self.buckets) - 1
        if flat is None:
            first = self._order[idx[0]]
            numel = sum(self._order[i].numel() for i in idx) + (len(self._order) if last else 0)
            flat = self._flats[b] = torch.empty(numel, dtype=first.dtype, device=first.device)
        if last:
            used = [p.grad is not None for p in self._order]
            flat[flat.numel() - len(used) :].copy_(torch.tensor(used, dtype=flat.dtype))
        offset = 0
        for i in idx:
            p = self._order[i]
            part = flat[offset : offset + p.numel()]
            offset += p.numel()
            if p.grad is None:
                part.zero_()  # unused on this rank: zeros (other ranks may have a gradient)
            elif p.grad.data_ptr() != part.data_ptr() or not p.grad.is_contiguous():
                part.copy_(p.grad.reshape(-1))
                p.grad = part.view_as(p)
        if isinstance(self._reduce, Compressor):
            handle = self._reduce(
                flat,
                group=self._comm_group,
                key=b,
                exact_tail=(len(self._order) if last else 0),
                shapes=[self._order[i].shape for i in idx],
            )
        else:
            handle = self._reduce(flat) or Done()
        if self.timeline is not None:
            # a bucket of one gradient is named after its parameter
            name = self._names[idx[0]] if len(idx) == 1 else f"bucket {b}"
            handle = self.timeline.track(name, handle, "comm", device=flat.device)
        self._inflight.append((b, flat, handle))
        return handle

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's AllReduce and write the averaged gradients back.

        Launches the buckets not launched yet (in order; their unused parameters as
        zeros). Idempotent: a second call after the same backward does nothing."""
        if self._no_sync:
            raise RuntimeError(
                "finish_gradient_synchronization() inside no_sync(): gradients are only "
                "accumulated there; call it after the backward outside no_sync()"
            )
        if self._state == "synced":
            return
        if self._state in ("idle", "forward"):
            raise RuntimeError(
                f"{type(self).__name__}.finish_gradient_synchronization() before any backward "
                "this step: call loss.backward() first (no gradient has reached the model "
                "since the last synchronisation)"
            )
        backward_end = self._backward_end or self._stamp()
        if not self.overlap:
            for b in range(len(self.buckets)):  # naive: one after the other, after backward
                self._launch(b)
                self._finish(*self._inflight.pop())
        else:
            for b in range(self._next, len(self.buckets)):
                self._launch(b)
            for b, flat, handle in self._inflight:
                self._finish(b, flat, handle)
        self._settle_unused()
        if not self._rebuilt:
            self._rebuild_buckets()
        if self.timeline is not None and self._backward_start is not None:
            self.timeline.add("backward", self._backward_start, backward_end, "compute")
        self._reset("synced")

    def _rebuild_buckets(self) -> None:
        """Once, after the first synchronised step, as PyTorch's reducer does: the buckets
        follow the order the gradients arrived in on rank 0 (of the group), no longer the
        reverse registration order, so that a bucket whose gradients come early is not
        held up behind one whose gradients come late (a layer registered after another
        but used before it). Every rank takes rank 0's order: the order can differ from
        rank to rank (a branch some ranks take), and the buckets must not."""
        self._rebuilt = True
        came = list(dict.fromkeys(self._arrived))
        order = [came + [i for i in range(len(self._order)) if i not in set(came)]]
        dist.broadcast_object_list(order, src=self._rank0, group=self._comm_group)
        new = order[0]
        if new == list(range(len(self._order))):
            return
        self._order = [self._order[i] for i in new]
        self._names = [self._names[i] for i in new]
        self._index = {id(p): i for i, p in enumerate(self._order)}
        self.buckets = self._make_buckets(self._bucket_mb)
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._flats = [None] * len(self.buckets)  # .grad views of the old ones are copied

    def _settle_unused(self) -> None:
        """A parameter without a gradient here gets the reduced one if any rank used it
        (zeros included: a gradient of zeros is a gradient, weight decay acts on it), and
        keeps ``grad=None`` if no rank did, as in one process. Its use, not its values:
        deciding by ``.any()`` left replicas apart (zeros on one rank, None on another)."""
        flat = self._flats[-1]
        used_anywhere = flat[flat.numel() - len(self._order) :] > 0
        for p, part in self._unused_here:
            if used_anywhere[self._index[id(p)]]:
                p.grad = part

    @torch.no_grad()
    def _finish(self, b: int, flat: torch.Tensor, handle) -> None:
        handle.wait()
        if not self._averages:
            flat.div_(self.world)
        offset = 0
        for i in self.buckets[b]:
            p = self._order[i]
            part = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is None:  # unused here: decided once every rank's use is known
                self._unused_here.append((p, part))
            elif p.grad.data_ptr() != part.data_ptr():
                p.grad.copy_(part)  # someone replaced .grad after the launch

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients locally; the first backward
        after the block synchronises the accumulated sum (gradient accumulation).
        Not between a synchronised backward and its ``finish_gradient_synchronization()``:
        that backward's AllReduces work on the very buffers ``.grad`` views, and a backward
        in the block would add into them while they are reduced (PyTorch's reducer has the
        same buffers; it leaves the order to you, the kit refuses it)."""
        if self._state == "backward" and not self._no_sync:
            flying = sum(1 for _, _, h in self._inflight if not _ended(h))
            raise RuntimeError(
                f"{type(self).__name__}.no_sync() after a backward whose gradients were not "
                f"synchronised yet ({flying} AllReduce(s) still in flight on the buffers .grad "
                "views): call finish_gradient_synchronization() first, then accumulate"
            )
        self._no_sync += 1
        try:
            yield
        finally:
            self._no_sync -= 1

    # ------------------------------------------------------------ reporting
    def bucket_table(self) -> list[dict]:
        """One row per bucket, in launch order: its parameters and bytes."""
        rows = []
        for b, idx in enumerate(self.buckets):
            nbytes = sum(self._order[i].numel() * self._order[i].element_size() for i in idx)
            rows.append({"bucket": b, "params": [self._names[i] for i in idx], "bytes": nbytes})
        return rows

    def extra_repr(self) -> str:
        sizes = ", ".join(f"{r['bytes'] / 2**20:.3g}" for r in self.bucket_table()[:8])
        more = " ..." if len(self.buckets) > 8 else ""
        return f"buckets (MiB, launch order): [{sizes}{more}]"


def _ended(handle) -> bool:
    done = getattr(handle, "is_completed", None)
    return bool(done()) if callable(done) else False


def _describe(entry) -> str:
    if entry is None:
        return "no such parameter"
    name, shape, dtype = entry
    return f"{name!r} of shape {list(shape)} ({dtype.replace('torch.', '')})"


def _tensors(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)


class NaiveDDP(_DataParallel):
    """All gradients all-reduced after backward, one parameter after the other: nothing
    overlaps. ``finish_gradient_synchronization()`` does all the communication.

    ::

        backward |████████████|
        comm                  |▒▒|▒▒▒▒|▒|▒▒▒|      step = backward + Σ AllReduce(g_i)
    """

    overlap = False

    def __init__(self, module, all_reduce=None, group=None, timeline=None,
                 broadcast_buffers=True):  # fmt: skip
        super().__init__(module, bucket_mb=1e-9, all_reduce=all_reduce, group=group,
                         timeline=timeline, broadcast_buffers=broadcast_buffers)  # fmt: skip


class OverlapDDP(_DataParallel):
    """One async AllReduce per parameter, launched by its post-accumulate-grad hook the
    moment its gradient is complete; ``finish_gradient_synchronization()`` waits.

    ::

        backward |██████████████|
        comm       |▒| |▒▒| |▒| |▒▒|▒|     hidden, but every message pays the latency α
    """

    def __init__(self, module, all_reduce=None, group=None, timeline=None,
                 broadcast_buffers=True):  # fmt: skip
        super().__init__(module, bucket_mb=1e-9, all_reduce=all_reduce, group=group,
                         timeline=timeline, broadcast_buffers=broadcast_buffers)  # fmt: skip


class BucketedDDP(_DataParallel):
    """Gradients fused into buckets of about ``bucket_mb`` MiB, filled in reverse
    parameter order; each bucket's async AllReduce starts the moment it is full.
    ``bucket_mb=None``: one bucket; a parameter bigger than a bucket gets its own.

    ::

        grads ready  g5 g4 g3 g2 g1 g0         (reverse parameter order)
        buckets      [g5 g4][g3 g2][g1 g0]     bucket 0 launches as soon as g4 is in
    """

    def __init__(self, module, bucket_mb: float | None = 25, all_reduce=None, group=None,
                 timeline=None, broadcast_buffers=True):  # fmt: skip
        super().__init__(module, bucket_mb=bucket_mb, all_reduce=all_reduce, group=group,
                         timeline=timeline, broadcast_buffers=broadcast_buffers)  # fmt: skip


# by the name a configuration gives (ok.ddp.measure_step, lab 10)
WRAPPERS = {"naive": NaiveDDP, "overlap": OverlapDDP, "bucketed": BucketedDDP}


#: 16-bit gradients by the name a configuration gives (``compress=``): what PyTorch's
#: ``fp16_compress_hook`` and ``bf16_compress_hook`` send
COMPRESS = {"fp16": torch.float16, "bf16": torch.bfloat16}


def measure_step(wrapper: str = "bucketed", bucket_mb: float | None = 25, all_reduce="ring",
                 layers: int = 8, width: int = 512, batch: int = 64, steps: int = 5,
                 warmup: int = 2, per_step: bool = False,
                 compress: str | None = None) -> dict:  # fmt: skip
    """Time data-parallel SGD steps of a stack of ``layers`` Linear(width, width) layers
    with one of the kit's wrappers (``"naive"``, ``"overlap"``, ``"bucketed"`` with
    ``bucket_mb``); run on every rank. ``compress`` (``"fp16"`` or ``"bf16"``) sends the
    gradients in 16 bits over the kit's ring (``ok.compression.Half``) instead of
    ``all_reduce``. Returns the medians of ``step_ms`` (forward,
    backward, finishing the synchronisation, the optimizer step; the slowest rank's),
    ``comm_ms`` (time some AllReduce was in flight) and ``hidden`` (share of that under
    backward), from the wrapper's timeline; with ``per_step``, also every step's three
    values (``"per_step"``: a dict of lists), for a caller that needs their spread."""
    from .bench.progress import slowest  # noqa: PLC0415
    from .timeline import COMM, Timeline  # noqa: PLC0415

    if wrapper not in WRAPPERS:
        raise ValueError(f"wrapper must be one of {', '.join(WRAPPERS)}; got {wrapper!r}")
    if compress is not None:
        if compress not in COMPRESS:
            raise ValueError(f"compress must be None or one of {', '.join(COMPRESS)}; "
                             f"got {compress!r}")  # fmt: skip
        all_reduce = Half(COMPRESS[compress])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)])  # fmt: skip
    kwargs = {"bucket_mb": bucket_mb} if wrapper == "bucketed" else {}
    gen = torch.Generator().manual_seed(runtime.rank())
    x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)
    tl = Timeline()
    ddp = WRAPPERS[wrapper](model, all_reduce=all_reduce, timeline=tl, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times, comm, hidden = [], [], []
    for i in range(warmup + steps):
        tl.spans.clear()  # this step's spans only
        dist.barrier()
        start = time.perf_counter()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        ddp.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step = slowest(start, time.perf_counter())
        if i >= warmup:
            times.append(step)
            comm.append(tl.busy(COMM))
            hidden.append(tl.hidden_fraction() or 0.0)
    out = {"step_ms": statistics.median(times) * 1e3, "comm_ms": statistics.median(comm) * 1e3,
           "hidden": statistics.median(hidden)}  # fmt: skip
    if per_step:
        out["per_step"] = {"step_ms": [t * 1e3 for t in times], "comm_ms": [c * 1e3 for c in comm],
                           "hidden": hidden}  # fmt: skip
    return out
