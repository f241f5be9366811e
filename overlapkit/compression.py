"""Communicating less: a gradient bucket averaged from fewer bytes, with error feedback.

Overlap hides communication; compression shrinks it. Each compressor here averages a flat
gradient bucket over the ranks, in place, like the wrappers' AllReduce, but sends less::

    compressor         what travels (a bucket of S bytes of float32)   bytes a rank sends
    (none)             ring AllReduce of the bucket                    2(N−1)/N · S
    Half(fp16|bf16)    ring AllReduce of it in 16 bits, pre-divided    2(N−1)/N · S/2
    TopK(f)            AllGather of its k = f·numel largest entries    (N−1) · k · (4 + 8)
                       (values and int64 indices), summed by index
    PowerSGD(r)        per n×m gradient: AllReduce of P = M·Q (n×r),   2(N−1)/N · 4·(n+m)·r
                       then of Q = Mᵀ·P (m×r); M ≈ P·Qᵀ                 (+ 1-D ones whole)

The lossy ones drop part of each gradient every step. *Error feedback* keeps what a rank
dropped (its residual, one per bucket) and adds it to the next step's gradient, so nothing
is lost for good, only late::

    corrected = gradient + residual          (what this rank wants to send)
    message   = compress(corrected)
    residual  = corrected − what the message stands for

Usable as the kit wrappers' ``all_reduce=`` (``ok.BucketedDDP(model,
all_reduce=PowerSGD(rank=4))``) and as a hook of PyTorch's DDP
(``ok.ddp_comm_hook(compress=PowerSGD(rank=4))``). A compressor object holds the state of
one model's buckets (residuals, PowerSGD's Q): one per wrapper. It counts what it sent
(:attr:`Compressor.stats`) and the seconds it spent compressing and decompressing; that
work runs on the rank's communication worker, beside backward, and competes with it for
the cores (the lecture notes' "overlap occupies memory bandwidth and SMs").
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from . import costmodel, ordering
from .collectives import ring_all_gather, ring_all_reduce

__all__ = ["Compressor", "Half", "TopK", "PowerSGD", "FromFunction", "orthogonalize"]


class Compressor:
    """A compressed, averaging AllReduce of flat gradient buckets (see the module docstring).

    Call it as ``compressor(flat, group=None, async_op=True, key=0, shapes=None,
    exact_tail=0)``: ``key`` names the bucket (its residual and memory are kept under it),
    ``shapes`` the gradients the bucket holds, in order (PowerSGD needs them; default:
    one 1-D tensor), ``exact_tail`` a number of trailing elements averaged exactly (the
    wrappers' flags of which parameters each rank used). Returns a handle: ``wait()``,
    then ``flat`` holds the average."""

    averages = True  # the wrappers must not divide by the world size again
    #: whether ``_compressed_average`` returns what this rank dropped itself (else the
    #: residual is worked out from a copy of the corrected gradient, taken only then)
    returns_dropped = False

    def __init__(self, error_feedback: bool):
        self.error_feedback = bool(error_feedback)
        self.residuals: dict = {}
        self.stats = {"steps": 0, "elements_in": 0, "elements_sent": 0, "bytes_sent": 0,
                      "compute_s": 0.0}  # fmt: skip
        self.last = {"bytes_sent": 0, "compute_s": 0.0}  # the latest bucket's

    # ------------------------------------------------------------ the call
    def __call__(self, flat: torch.Tensor, group=None, async_op: bool = True, key=0,
                 shapes=None, exact_tail: int = 0):  # fmt: skip
        if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_floating_point():
            raise TypeError(
                f"{type(self).__name__}: expected a flat (1-D) floating-point gradient "
                f"bucket; got {_what(flat)}"
            )
        body = flat.numel() - exact_tail
        shapes = [torch.Size([body])] if shapes is None else [torch.Size(s) for s in shapes]
        if sum(s.numel() for s in shapes) != body:
            raise ValueError(
                f"{type(self).__name__}: bucket {key!r} holds {body} elements (besides "
                f"{exact_tail} exact ones) but its shapes {[tuple(s) for s in shapes]} add "
                f"up to {sum(s.numel() for s in shapes)}"
            )

        def work():
            self._reduce_bucket(flat, group, key, shapes, exact_tail)

        handle = ordering.run_async(work, group, device=flat.device, outputs=[flat])
        if not async_op:
            handle.wait()
            return None
        return handle

    def _reduce_bucket(self, flat, group, key, shapes, exact_tail) -> None:
        before = {k: self.stats[k] for k in self.last}
        self._average_bucket(flat, group, key, shapes, exact_tail)
        self.last = {k: self.stats[k] - before[k] for k in self.last}

    def _average_bucket(self, flat, group, key, shapes, exact_tail) -> None:
        world = dist.get_world_size(group)
        body, tail = flat[: flat.numel() - exact_tail], flat[flat.numel() - exact_tail :]
        if tail.numel():  # exact: a sum of flags must stay a sum
            self._all_reduce(tail, group, world)
            tail.div_(world)
        signature = tuple(tuple(s) for s in shapes)
        state = self.residuals.get(key)
        if state is None or state[0] != signature:  # new, or the wrapper rebuilt its buckets
            state = self.residuals[key] = [signature, None]
        start = time.perf_counter()
        if self.error_feedback and state[1] is not None:
            body.add_(state[1])
        corrected = body.clone() if self.error_feedback and not self.returns_dropped else None
        self._spend(start)
        dropped = self._compressed_average(body, group, world, key, shapes)
        start = time.perf_counter()
        if self.error_feedback:
            # what this rank's message did not carry: ``dropped`` where the compressor
            # knows it locally, else what the average stands for (PowerSGD, as torch's)
            state[1] = dropped if dropped is not None else corrected - body
        self._spend(start)
        self.stats["steps"] += 1
        self.stats["elements_in"] += body.numel()

    def _compressed_average(self, body, group, world, key, shapes):
        """Average ``body`` over the ranks in place; return what this rank dropped, or None."""
        raise NotImplementedError

    # ------------------------------------------------------------ helpers
    def _spend(self, start: float) -> None:
        self.stats["compute_s"] += time.perf_counter() - start

    def _all_reduce(self, t: torch.Tensor, group, world: int) -> None:
        """A ring AllReduce (sum) of ``t``, counted."""
        ring_all_reduce(t, group=group)
        self._count(t.numel(), t.element_size(), 2 * (world - 1) / world)

    def _all_gather(self, out: torch.Tensor, mine: torch.Tensor, group, world: int) -> None:
        ring_all_gather(out, mine, group=group)
        self._count(mine.numel(), mine.element_size(), world - 1)

    def _count(self, numel: int, element_size: int, factor: float) -> None:
        self.stats["elements_sent"] += numel
        self.stats["bytes_sent"] += round(numel * element_size * factor)

    def reset_stats(self) -> None:
        for k in self.stats:
            self.stats[k] = 0.0 if k == "compute_s" else 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._args()}, error_feedback={self.error_feedback})"


class Half(Compressor):
    """The bucket in 16 bits: cast, divided by N first (so the sum cannot overflow where
    one rank's values would not), ring-AllReduced, cast back. Half the bytes; the rounding
    is the loss (its error feedback is the rounding error, off by default as in PyTorch's
    ``fp16_compress_hook``/``bf16_compress_hook``)."""

    returns_dropped = True

    def __init__(self, dtype: torch.dtype = torch.float16, error_feedback: bool = False):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"Half: dtype must be torch.float16 or torch.bfloat16; got {dtype}")
        super().__init__(error_feedback)
        self.dtype = dtype

    def _args(self) -> str:
        return f"dtype={self.dtype}"

    def _compressed_average(self, body, group, world, key, shapes):
        start = time.perf_counter()
        small = body.to(self.dtype)
        dropped = body - small.to(body.dtype) if self.error_feedback else None
        small.div_(world)  # as torch's hooks: cast, then divide
        self._spend(start)
        self._all_reduce(small, group, world)
        start = time.perf_counter()
        body.copy_(small)
        self._spend(start)
        return dropped


class TopK(Compressor):
    """Each rank sends only its ``fraction`` of largest-magnitude entries (at least one),
    as values and their int64 indices; every rank all-gathers everyone's and adds them up
    by index, then divides by N. Indices differ from rank to rank: each rank's travel with
    its values. With error feedback (on by default) the entries not sent wait in the
    residual until they are large enough to be."""

    returns_dropped = True

    def __init__(self, fraction: float, error_feedback: bool = True):
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, float | int)
            or not (0 < fraction <= 1)
        ):
            raise ValueError(
                f"TopK: fraction is the share of entries sent, 0 < fraction ≤ 1 (0.01 for "
                f"1%); got {fraction!r}"
            )
        super().__init__(error_feedback)
        self.fraction = float(fraction)

    def _args(self) -> str:
        return f"fraction={self.fraction:g}"

    def k_of(self, numel: int) -> int:
        return costmodel.top_k_count(numel, self.fraction)

    def _compressed_average(self, body, group, world, key, shapes):
        if body.numel() == 0:
            return None
        start = time.perf_counter()
        k = self.k_of(body.numel())
        index = body.abs().topk(k, sorted=False).indices
        values = body[index]
        self._spend(start)
        all_values = torch.empty(world * k, dtype=body.dtype, device=body.device)
        all_index = torch.empty(world * k, dtype=torch.int64, device=body.device)
        self._all_gather(all_values, values, group, world)
        self._all_gather(all_index, index, group, world)
        start = time.perf_counter()
        dropped = None
        if self.error_feedback:
            dropped = body.clone()
            dropped[index] = 0
        body.zero_().index_add_(0, all_index, all_values).div_(world)
        self._spend(start)
        return dropped


def orthogonalize(m: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Gram–Schmidt on the columns of ``m`` (n×r), in place: each column normalised, then
    taken out of the columns after it. ``epsilon`` keeps a zero column from dividing by 0.

    ::

        q0 = c0/|c0|;  c1 −= (q0·c1) q0;  q1 = c1/|c1|;  c2 −= (q0·c2) q0 + (q1·c2) q1 …
    """
    for i in range(m.shape[1]):
        col = m[:, i : i + 1]
        col /= torch.linalg.vector_norm(col) + epsilon
        if i + 1 < m.shape[1]:
            rest = m[:, i + 1 :]
            rest -= col * (col * rest).sum(dim=0, keepdim=True)
    return m


class PowerSGD(Compressor):
    """Low-rank gradients (Vogels et al., 2019), as PyTorch's ``powerSGD_hook``: each
    gradient of 2+ dimensions, viewed as an n×m matrix M, is sent as two thin ones::

        P = M·Q      (n×r)   AllReduce(sum), then orthogonalised   → the same P everywhere
        Q = Mᵀ·P     (m×r)   AllReduce, ÷ N                        → the average's Q
        M ≈ P·Qᵀ             the average, at rank r

    Q is reused from the last step (``warm_start``: one power iteration a step refines it;
    the first Q is random, the same on every rank), 1-D gradients (biases) and matrices
    too small to gain ``min_compression_rate`` travel whole in one AllReduce, and the
    first ``start_iter`` steps of a bucket are plain AllReduces. Error feedback (on by
    default) keeps what the low-rank average left out of this rank's gradient."""

    def __init__(self, rank: int = 1, error_feedback: bool = True, warm_start: bool = True,
                 start_iter: int = 2, min_compression_rate: float = 2.0, seed: int = 0,
                 epsilon: float = 0.0):  # fmt: skip
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD: rank must be a whole number ≥ 1; got {rank!r}")
        if (error_feedback or warm_start) and start_iter < 2:
            raise ValueError(  # as PyTorch: a DDP's first step rebuilds its buckets
                "PowerSGD: start_iter must be ≥ 2 with error feedback or warm start (the "
                f"wrappers rebuild their buckets after the first step); got {start_iter}"
            )
        super().__init__(error_feedback)
        self.rank, self.warm_start, self.start_iter = rank, warm_start, start_iter
        self.min_compression_rate, self.seed, self.epsilon = min_compression_rate, seed, epsilon
        self._calls: dict = {}
        self._q: dict = {}  # key -> (signature, list of Q matrices)
        self._rng = np.random.RandomState(seed)

    def _args(self) -> str:
        return f"rank={self.rank}, warm_start={self.warm_start}, start_iter={self.start_iter}"

    def splits(self, shapes) -> tuple[list[int], list[int]]:
        """Which of a bucket's gradients go low-rank (their positions) and which whole
        (``ok.costmodel.powersgd_split``: PyTorch's rule)."""
        return costmodel.powersgd_split(shapes, self.rank, self.min_compression_rate)

    def _orthogonalize(self, m: torch.Tensor) -> torch.Tensor:
        """Gram–Schmidt (:func:`orthogonalize`) up to 2 columns or in 16 bits, else a QR
        factorisation, as PyTorch's hook chooses (QR is faster beyond rank 2; its columns
        may differ from Gram–Schmidt's in sign, the same space)."""
        if m.shape[1] <= 2 or m.dtype in (torch.float16, torch.bfloat16):
            return orthogonalize(m, self.epsilon)
        m.copy_(torch.linalg.qr(m).Q)
        return m

    def _random_qs(self, mats, dtype) -> list[torch.Tensor]:
        """A first Q per matrix, the same on every rank, drawn as PyTorch's hook draws them
        (a seed from a NumPy generator seeded with ``seed``, one per new bucket, then the
        matrices grouped by shape, in their first appearance's order), so that the kit's
        hook and PyTorch's compute the same averages from the same gradients."""
        seed = int(self._rng.randint(1_000_000_000))
        by_shape: dict = {}
        for j, m in enumerate(mats):
            by_shape.setdefault(tuple(m.shape), []).append(j)
        qs: list = [None] * len(mats)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for same in by_shape.values():
                for j in same:
                    m = mats[j]
                    # drawn on the CPU, as torch's hook draws them: the same on every device
                    q = torch.randn(m.shape[1], min(*m.shape, self.rank), dtype=dtype)
                    qs[j] = q.to(m.device)
        return qs

    def _compressed_average(self, body, group, world, key, shapes):
        calls = self._calls[key] = self._calls.get(key, 0) + 1
        if calls <= self.start_iter:  # plain AllReduce first; nothing is dropped
            self._all_reduce(body, group, world)
            body.div_(world)
            return torch.zeros_like(body) if self.error_feedback else None
        start = time.perf_counter()
        views, offset = [], 0
        for s in shapes:
            views.append(body[offset : offset + s.numel()])
            offset += s.numel()
        low, whole = self.splits(shapes)
        mats = [views[i].view(shapes[i][0], -1) for i in low]
        signature = tuple(tuple(s) for s in shapes)
        kept = self._q.get(key)
        if kept is None or kept[0] != signature or not self.warm_start:
            self._q[key] = kept = (signature, self._random_qs(mats, body.dtype))
        qs = kept[1]
        for q in qs:
            self._orthogonalize(q)
        p_flat = torch.cat([(m @ q).reshape(-1) for m, q in zip(mats, qs, strict=True)]
                           or [body.new_zeros(0)])  # fmt: skip
        whole_flat = torch.cat([views[i] for i in whole] or [body.new_zeros(0)])
        self._spend(start)
        if whole_flat.numel():
            self._all_reduce(whole_flat, group, world)
        if p_flat.numel():
            self._all_reduce(p_flat, group, world)
        start = time.perf_counter()
        ps, at = [], 0
        for m, q in zip(mats, qs, strict=True):
            n, r = m.shape[0], q.shape[1]
            ps.append(self._orthogonalize(p_flat[at : at + n * r].view(n, r)))
            at += n * r
        q_flat = torch.cat([(m.T @ p).reshape(-1) for m, p in zip(mats, ps, strict=True)]
                           or [body.new_zeros(0)])  # fmt: skip
        self._spend(start)
        if q_flat.numel():
            self._all_reduce(q_flat, group, world)
        start = time.perf_counter()
        q_flat.div_(world)
        at = 0
        for j, (m, p) in enumerate(zip(mats, ps, strict=True)):
            q = q_flat[at : at + m.shape[1] * p.shape[1]].view(m.shape[1], p.shape[1])
            at += q.numel()
            qs[j].copy_(q)  # warm start: next step's Q
            torch.mm(p, q.T, out=m)  # the average, at rank r, into the bucket
        at = 0
        whole_flat.div_(world)
        for i in whole:
            views[i].copy_(whole_flat[at : at + views[i].numel()])
            at += views[i].numel()
        self._spend(start)
        return None


class FromFunction(Compressor):
    """A compressor made of a function ``fn(flat, residual, fraction) -> new residual``
    that averages ``flat`` over the ranks in place (lab 13's ``topk_with_feedback``), so
    that a learner's top-k trains through the wrappers and ``ok.training.train`` like the
    kit's. It keeps each bucket's residual (zeros at first) and passes it in; what the
    function sends is its own business, so :attr:`stats` counts no bytes (the kit's
    :class:`TopK` with the same fraction sends the same)."""

    def __init__(self, fn, fraction: float):
        if not callable(fn):
            raise TypeError(f"FromFunction: fn must be a function; got {_what(fn)}")
        super().__init__(error_feedback=True)
        self.fn, self.fraction = fn, fraction

    def _args(self) -> str:
        return f"fn={getattr(self.fn, '__name__', self.fn)!r}, fraction={self.fraction:g}"

    def _average_bucket(self, flat, group, key, shapes, exact_tail) -> None:
        world = dist.get_world_size(group)
        body, tail = flat[: flat.numel() - exact_tail], flat[flat.numel() - exact_tail :]
        if tail.numel():
            self._all_reduce(tail, group, world)
            tail.div_(world)
        signature = tuple(tuple(s) for s in shapes)
        state = self.residuals.get(key)
        if state is None or state[0] != signature:  # new, or the wrapper rebuilt its buckets
            state = self.residuals[key] = [signature, torch.zeros_like(body)]
        start = time.perf_counter()
        returned = self.fn(body, state[1], self.fraction)
        self._spend(start)  # the whole function: its compute and its waits alike
        if not isinstance(returned, torch.Tensor) or returned.shape != body.shape:
            raise TypeError(
                f"FromFunction: {self._args()} returned {_what(returned)}; it must return "
                f"the new residual, a tensor of the bucket's shape {tuple(body.shape)}"
            )
        state[1] = returned.detach()
        self.stats["steps"] += 1
        self.stats["elements_in"] += body.numel()


def _what(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dim()}-D {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"
