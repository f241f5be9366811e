"""ZeRO-1: shard the optimizer state across data-parallel ranks.

Every rank keeps the whole model, but optimizer state (Adam's two moments are
twice the model) only for its *shard*: one N-th of the flattened parameters.
A step::

    grads (full, per rank)  ──ReduceScatter(avg)──►  my shard of the averaged grad
    my shard of the params  ──inner optimizer──────►  my updated shard
    updated shards          ──AllGather───────────►  full updated params, every rank

The bytes moved equal one AllReduce (ReduceScatter + AllGather = AllReduce),
yet optimizer memory per rank falls from K·P to K·P/N. Results equal the
unsharded optimizer's for elementwise optimizers (SGD, Adam, AdamW, ...);
ones that use whole-tensor norms (LAMB, LARS) would see shard norms instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import ring_all_gather, ring_reduce_scatter


def flatten_padded(params, padded: int, values=None) -> torch.Tensor:
    """``values`` (default: the params themselves) end to end in one flat vector of ``padded``.

    The params give the layout: value i fills param i's slot. A ``None`` value
    (a parameter without a gradient this step) leaves its slot zero, as does
    the padding after the last one.
    """
    first = params[0]
    flat = torch.zeros(padded, dtype=first.dtype, device=first.device)
    offset = 0
    for p, v in zip(params, params if values is None else values, strict=True):
        if v is not None:
            flat[offset : offset + p.numel()].copy_(v.detach().reshape(-1))
        offset += p.numel()
    return flat


def unflatten_into(tensors, flat: torch.Tensor) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` (the inverse of the above)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


class ShardedOptimizer:
    """Wrap ``optimizer_cls`` so that each rank holds state for its shard of ``params`` only.

    ``step()`` averages the gradients across ranks (ReduceScatter with "avg"),
    updates this rank's shard, and all-gathers the parameters. All parameters
    must share one dtype and device. ``param_groups`` is the inner optimizer's
    (one group over the shard), so learning-rate changes work as usual.
    """

    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("ShardedOptimizer got no parameters that require grad")
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) > 1:
            raise TypeError(
                f"all parameters must share one dtype and device, got {sorted(map(str, kinds))}"
            )
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.numel = sum(p.numel() for p in self.params)
        # pad so that every rank's shard has the same size (ReduceScatter's contract)
        self.shard_numel = -(-self.numel // self.world)
        self.padded = self.shard_numel * self.world
        lo = self.rank * self.shard_numel
        flat = flatten_padded(self.params, self.padded)
        self.shard = torch.nn.Parameter(flat[lo : lo + self.shard_numel].clone())
        self.inner = optimizer_cls([self.shard], **kwargs)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @torch.no_grad()
    def step(self) -> None:
        grad_shard = torch.empty_like(self.shard)
        grads = flatten_padded(self.params, self.padded, [p.grad for p in self.params])
        ring_reduce_scatter(grad_shard, grads, op="avg")
        self.shard.grad = grad_shard
        self.inner.step()
        full = torch.empty(self.padded, dtype=self.shard.dtype, device=self.shard.device)
        ring_all_gather(full, self.shard.detach())
        unflatten_into(self.params, full)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank (for this rank's shard only)."""
        return sum(
            t.numel() * t.element_size()
            for s in self.inner.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )

    def memory_report(self) -> dict:
        """Bytes per rank: parameters and gradients (whole), optimizer state (shard only)."""
        p_bytes = self.numel * self.params[0].element_size()
        state = self.state_bytes()
        return {
            "rank": self.rank,
            "world_size": self.world,
            "param_bytes": p_bytes,
            "grad_bytes": p_bytes,
            "optimizer_state_bytes": state,
            # what every rank would hold without sharding
            "unsharded_optimizer_state_bytes": state * self.world,
        }
