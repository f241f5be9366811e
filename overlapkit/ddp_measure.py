"""Measuring data-parallel training: what the cost model and lab 10 are fed.

When each gradient becomes ready during one backward (:func:`profile_backward`), what an
AllReduce costs this host beyond the link's α-β model (:func:`measure_host_cost`); how long
a step of one of the kit's wrappers takes is measured beside the wrappers
(:func:`overlapkit.ddp.measure_step`).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from . import costmodel, p2p, runtime
from .collectives import ring_all_reduce
from .ddp_reduce import _resolve_all_reduce

# --------------------------------------------------------------------------- measuring backward


class BackwardProfile:
    """When each gradient became ready during one backward, measured in one process.

    ``ready`` holds (seconds after backward started, bytes) per trainable parameter in
    *reverse parameter order* — the order the wrappers fill buckets in — and ``names``
    their names; ``forward`` and ``backward`` are the two passes' times.
    What ``ok.costmodel.ddp_step`` needs to predict a data-parallel step.
    """

    def __init__(self, forward: float, backward: float, ready: list[tuple[float, int]],
                 names: list[str]):  # fmt: skip
        self.forward, self.backward, self.ready, self.names = forward, backward, ready, names

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b in self.ready)

    def __repr__(self) -> str:
        return (
            f"BackwardProfile(forward={self.forward * 1e3:.2f} ms, backward="
            f"{self.backward * 1e3:.2f} ms, {len(self.ready)} gradients, "
            f"{self.total_bytes / 2**20:.2f} MiB)"
        )


def profile_backward(module: torch.nn.Module, step, repeats: int = 5) -> BackwardProfile:
    """Time ``step(module) -> loss`` (forward) and its backward, and when each gradient
    became ready; median of ``repeats`` runs after one warm-up. Gradients are cleared."""
    params = [p for p in module.parameters() if p.requires_grad]
    names = {id(p): n for n, p in module.named_parameters()}
    runs = []
    for _ in range(repeats + 1):
        stamps: list[tuple[float, torch.Tensor]] = []
        hooks = [
            p.register_post_accumulate_grad_hook(
                lambda q, into=stamps: into.append((time.perf_counter(), q))
            )
            for p in params
        ]
        try:
            runtime.synchronize(params[0].device)
            t0 = time.perf_counter()
            loss = step(module)
            runtime.synchronize(params[0].device)
            t1 = time.perf_counter()
            loss.backward()
            # on CUDA, the ready times are when the host saw each hook
            runtime.synchronize(params[0].device)
            t2 = time.perf_counter()
        finally:
            for h in hooks:
                h.remove()
        for p in params:
            p.grad = None
        runs.append((t1 - t0, t2 - t1, [(t - t1, q) for t, q in stamps]))
    runs = sorted(runs[1:], key=lambda r: r[1])
    forward, backward, stamps = runs[len(runs) // 2]
    when = {id(q): t for t, q in stamps}
    order = list(reversed(params))
    # a parameter without a gradient (unused) is ready when backward ends
    ready = [(when.get(id(p), backward), p.numel() * p.element_size()) for p in order]
    return BackwardProfile(forward, backward, ready, [names[id(p)] for p in order])


# --------------------------------------------------------------------------- measuring the host


def _time_all_reduce(reduce, nbytes: int, reps: int) -> tuple[float, float]:
    """Median wall time of one synchronous AllReduce of ``nbytes``, and the CPU time (all
    of this rank's threads) it took."""
    buf = torch.zeros(max(1, nbytes // 4), device=runtime.device())
    samples, cpu = [], []
    for i in range(reps + 1):
        runtime.synchronize(buf.device)
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        reduce(buf).wait()
        runtime.synchronize(buf.device)
        if i:  # the first one warms up
            samples.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return statistics.median(samples), statistics.median(cpu)


def _time_busy(reduce, ops: int, reps: int = 3) -> float:
    """Seconds per AllReduce for ``ops`` small async AllReduces issued at once while this
    rank's own thread keeps multiplying matrices, as during backward."""
    bufs = [torch.zeros(1024, device=runtime.device()) for _ in range(ops)]
    a, b = torch.randn(128, 512), torch.randn(512, 512)
    samples = []
    for i in range(reps + 1):
        dist.barrier()
        start = time.perf_counter()
        handles = [reduce(t) for t in bufs]
        ends: list[float] = []
        for h in handles:
            h.get_future().then(lambda _, into=ends: into.append(time.perf_counter()))
        while len(ends) < len(handles):
            a @ b  # noqa: B018 - the rank is busy computing
        for h in handles:
            h.wait()
        if i:
            samples.append((max(ends) - start) / ops)
    return statistics.median(samples)


def measure_host_cost(nbytes: int, all_reduce="ring", group=None):
    """What an AllReduce costs this host beyond the link's α-β model, measured on the
    ranks (call it on every rank): returns (``ok.costmodel.HostCost``, seconds of one
    AllReduce of ``nbytes``). ``all_reduce`` as for the wrappers ("ring": the kit's ring
    over the current link; None: the built-in, with α = β = 0 as its model)."""
    reduce = _resolve_all_reduce(all_reduce, group)[0]
    world = dist.get_world_size(group)
    link = p2p.current_link() if all_reduce == "ring" or all_reduce is ring_all_reduce else None
    alpha, beta = (link.alpha, link.beta) if link is not None else (0.0, 0.0)
    full, full_cpu = _time_all_reduce(reduce, nbytes, reps=5)
    small, small_cpu = _time_all_reduce(reduce, 4096, reps=15)
    busy = _time_busy(reduce, ops=16)
    model_small = costmodel.ring_all_reduce(4096, world, alpha, beta)
    host = costmodel.HostCost(
        per_op=max(0.0, small - model_small),
        per_op_busy=max(0.0, busy - model_small),
        cpu_per_op=small_cpu,
        cpu_per_byte=max(0.0, full_cpu - small_cpu) / max(1, nbytes - 4096),
    )
    return host, full
