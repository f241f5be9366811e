"""Fully sharded data parallelism (ZeRO-3): parameters gathered just in time, and ahead of time.

ZeRO-1 (``ok.ShardedOptimizer``) shards the optimizer state and keeps the whole model on
every rank. Fully sharded training keeps only 1/N of every *parameter* too. The model is cut
into *units* (say, one per block); a unit's parameters live as one flat shard per rank, and
exist whole only while the unit computes::

    rank r holds              [u0/r] [u1/r] [u2/r]            1/N of each unit, always
    forward of unit k         AllGather(u_k) → whole u_k → compute → free u_k (reshard)
    backward of unit k        AllGather(u_k) again → compute → ReduceScatter(avg) of its
                              gradient → rank r keeps its shard of the average, u_k freed
    optimizer                 steps the shards (any torch.optim optimizer)

Each AllGather sits in front of compute that needs it, so it is exposed unless it started
earlier. *Prefetch* starts it earlier::

    prefetch="none"       comm |AG0|   |AG1|   |AG2|
                          comp     |F0 |   |F1 |   |F2 |      every AllGather exposed

    prefetch="explicit"   comm |AG0|AG1|AG2|
                          comp     |F0 |F1 |F2 |              AG k+1 travels under F k

``prefetch="implicit"`` is what PyTorch's FSDP2 does when not told: each unit's AllGather
is issued by its own pre-forward hook. On a GPU that hides it anyway, because the host runs
ahead of the kernels it queued; on a CPU the host *is* the compute, so implicit hides
nothing (measure it: ``python -m overlapkit bench fsdp``). ``backward_prefetch`` issues the
next unit's AllGather (in backward order; ``prefetch_depth`` of them with explicit
prefetch) before this unit's backward computes.
Each unit's gradient is reduce-scattered as soon as it is complete, on a group (and so a
communication thread) of its own, so it overlaps the AllGathers and the rest of backward.

Memory is the price of prefetching: ``prefetch_depth`` units ahead are whole at once beside
the one computing. :meth:`FullyShardedDP.memory` counts the bytes as they were held.

Contract (tests/test_fsdp.py): rank 0's parameters are broadcast at construction; after
``finish_gradient_synchronization()`` each shard's ``.grad`` is its share of the **average**
gradient; the parameters equal one process's training on the whole batch. Every rank must
run the same units in the same order (as in FSDP: the collectives match by order). A unit
holds one dtype, trainable or frozen throughout; a parameter belongs to one unit (one
shared by two is refused); parameters outside every unit form the root unit, whole from the
wrapper's forward to the end of backward, as ``fully_shard`` on the root does.

The wrapper and its schedule of gathers and ReduceScatters live here; what a unit is (its
parameters as one flat buffer, a shard per rank) in :mod:`overlapkit.fsdp_units`, a step
run as a plan of actions (lab 12) in :mod:`overlapkit.fsdp_plan`, whose ``PlanError`` is
re-exported from here.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

from . import handles
from .builtin import _Averaged, all_gather_tensor, reduce_scatter_tensor
from .collectives import ring_all_gather, ring_reduce_scatter
from .ddp import _tensors
from .ddp_reduce import _own_group
from .fsdp_plan import PlanError, _run_plan, _state
from .fsdp_units import _make_units, _resolve_units, _Unit

PREFETCH = ("none", "implicit", "explicit")


class FullyShardedDP(torch.nn.Module):
    """Fully sharded data parallelism with prefetch (see the module docstring).

    ``units``: submodules (or their names) whose parameters are gathered together; default,
    each direct child that has parameters. ``prefetch``: ``"none"``, ``"implicit"`` or
    ``"explicit"`` (``prefetch_depth`` units ahead, in the order the units ran last step).
    ``all_gather``/``reduce_scatter``: ``None`` (the built-in), ``"ring"`` (the kit's, over an
    emulated link when one is set), or ``fn(output, input, async_op=True)`` that gathers /
    sums into ``output``. ``timeline``: an ``ok.Timeline`` that gets each unit's forward,
    backward, AllGather and ReduceScatter. ``group``: the ranks that shard (default all);
    the AllGathers and ReduceScatters share it (without one, each gets a group of its own).
    """

    def __init__(self, module: torch.nn.Module, units=None, prefetch: str = "none",
                 backward_prefetch: bool = True, reshard_after_forward: bool = True,
                 all_gather=None, reduce_scatter=None, timeline=None, group=None,
                 prefetch_depth: int = 1):  # fmt: skip
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "FullyShardedDP needs torch.distributed initialised: build it inside a "
                "function run by ok.launch (or under torchrun)"
            )
        if prefetch not in PREFETCH:
            raise ValueError(f"prefetch must be one of {', '.join(PREFETCH)}; got {prefetch!r}")
        if not isinstance(prefetch_depth, int) or prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be a whole number ≥ 1; got {prefetch_depth!r}")
        self.module = module
        self.prefetch, self.prefetch_depth = prefetch, prefetch_depth
        self.backward_prefetch = backward_prefetch
        self.reshard_after_forward = reshard_after_forward
        self.timeline = timeline
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        ag_group = group if group is not None else _own_group(0)
        rs_group = group if group is not None else _own_group(1)
        self._all_gather = _gatherer(all_gather, ag_group)
        self._reduce_scatter = _scatterer(reduce_scatter, rs_group, self.world)
        self._root0 = dist.get_global_rank(ag_group, 0) if group is not None else 0
        self._ag_group = ag_group

        unit_modules = _resolve_units(module, units)
        self.units = _make_units(module, unit_modules, self.world, self.rank)
        self._broadcast_and_shard()
        self.shards = torch.nn.ParameterList([u.shard for u in self.units])
        self._hooks = []
        for u in self.units:
            if u.module is not None:
                self._hooks.append(u.module.register_forward_pre_hook(
                    functools.partial(self._pre_forward, u)))  # fmt: skip
                self._hooks.append(u.module.register_forward_hook(
                    functools.partial(self._post_forward, u)))  # fmt: skip
            if u.trainable:
                for leaf in u.leaves:
                    self._hooks.append(leaf.register_post_accumulate_grad_hook(
                        functools.partial(self._on_grad, u)))  # fmt: skip
        self._order = [u.index for u in self.units if u.module is not None]  # forward order
        self._state = "idle"
        self._in_forward = False
        self._manual = False  # run_plan runs the step
        self._reducing: list = []
        self._held = {"gathered": 0, "gradients": 0}
        self._peak = {"gathered": 0, "gradients": 0, "together": 0}

    # ------------------------------------------------------------ construction
    @torch.no_grad()
    def _broadcast_and_shard(self) -> None:
        for u in self.units:
            dist.broadcast(u.full, src=self._root0, group=self._ag_group)
            u.make_shard()
            self._free(u)

    # ------------------------------------------------------------ gathering
    def _count(self, what: str, nbytes: int) -> None:
        self._held[what] += nbytes
        self._peak[what] = max(self._peak[what], self._held[what])
        together = self._held["gathered"] + self._held["gradients"]
        self._peak["together"] = max(self._peak["together"], together)

    def _issue(self, u: _Unit) -> None:
        """Start gathering unit ``u`` (nothing if whole or on its way)."""
        if u.gathered or u.pending is not None:
            return
        u.full.untyped_storage().resize_(u.bytes)
        self._count("gathered", u.bytes)
        u.counted = True
        handle = self._all_gather(u.full, u.shard.detach()) or handles.Done()
        if self.timeline is not None:
            handle = self.timeline.track(f"AG {u.name}", handle, "comm", device=u.full.device)
        u.pending = handle

    def _wait(self, u: _Unit) -> None:
        self._issue(u)
        if u.pending is not None:
            handle, u.pending = u.pending, None
            handle.wait()
        u.gathered = True

    def _free(self, u: _Unit) -> None:
        """Reshard: drop the whole parameters (a gather still in flight is waited first:
        its bytes are being written into them)."""
        if u.pending is not None:
            self._wait(u)
        if u.full.untyped_storage().nbytes() == 0:
            return
        u.full.untyped_storage().resize_(0)
        if u.counted:
            self._count("gathered", -u.bytes)
            u.counted = False
        u.gathered = False

    def _ahead(self, order: list[int], u: _Unit, depth: int) -> list[_Unit]:
        if u.index not in order:
            return []
        at = order.index(u.index)
        return [self.units[i] for i in order[at + 1 : at + 1 + depth]]

    # ------------------------------------------------------------ hooks
    def _pre_forward(self, u: _Unit, module, args):
        if not self._in_forward:
            raise RuntimeError(
                f"FullyShardedDP: unit {u.name!r} was called outside the wrapper's forward; "
                "its parameters are shards, gathered only when the wrapper runs: call the "
                "FullyShardedDP object (fsdp(x)), not fsdp.module or one of its units"
            )
        if u.index in self._ran:
            raise RuntimeError(
                f"FullyShardedDP: unit {u.name!r} ran twice in one forward; a unit is "
                "gathered and reduced once per step: make each use its own unit"
            )
        self._ran.append(u.index)
        if self._manual:  # run_plan: the plan gathers; the unit must be whole by now
            if not u.gathered or u.pending is not None:
                raise PlanError(f"unit {u.index} is not whole ({_state(u)})")
            u.forward_start = self._stamp(u)
            return
        self._issue(u)
        if self.prefetch == "explicit":
            for nxt in self._ahead(self._order, u, self.prefetch_depth):
                self._issue(nxt)
        self._wait(u)
        u.forward_start = self._stamp(u)

    def _stamp(self, u: _Unit):
        """Now, for a span of the timeline: the GPU's moment where the unit is on one."""
        return time.perf_counter() if self.timeline is None else self.timeline.stamp(u.full.device)

    def _post_forward(self, u: _Unit, module, args, output):
        if self.timeline is not None:
            self.timeline.add(f"F {u.name}", u.forward_start, self._stamp(u), "compute")
        if self._manual:
            return
        if torch.is_grad_enabled() and _needs_grad(output):  # frozen units too: input grads
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, u))
        if self.reshard_after_forward:
            self._free(u)

    def _pre_backward(self, u: _Unit, grad):
        if u.backward_started:
            return None
        u.backward_started = True
        self._backward_begins()
        self._issue(u)
        if self.backward_prefetch:
            depth = self.prefetch_depth if self.prefetch == "explicit" else 1
            for nxt in self._ahead(self._backward_order(), u, depth):
                self._issue(nxt)
        self._wait(u)
        u.backward_start = self._stamp(u)
        return None

    def _backward_order(self) -> list[int]:
        return [i for i in reversed(self._ran)]

    def _on_grad(self, u: _Unit, leaf) -> None:
        self._backward_begins()
        self._count("gradients", leaf.grad.numel() * leaf.grad.element_size())
        u.ready += 1
        if u.ready == len(u.leaves):
            u.complete = True
            if not self._manual:
                self._launch_ready()

    def _backward_begins(self) -> None:
        if self._state == "forward":
            self._state = "backward"
            # runs when the autograd engine has finished this backward: units whose
            # gradient never became complete (skipped, or used by no loss) are reduced then
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _reduce_order(self) -> list[_Unit]:
        """The order every rank launches the ReduceScatters in: backward order (units
        last run first), then the root. A unit that did not run this step is not reduced
        and its shard keeps ``grad=None`` (as a parameter no rank used under PyTorch's
        DDP): every rank ran the same units, so every rank skips it."""
        ran = [self.units[i] for i in self._backward_order()]
        root = [u for u in self.units if u.module is None]
        return [u for u in ran + root if u.trainable]

    def _launch_ready(self) -> None:
        for u in self._reduce_order():
            if u.launched:
                continue
            if not u.complete:
                return  # a later unit waits for this one: every rank launches in one order
            self._launch(u)

    @torch.no_grad()
    def _launch(self, u: _Unit) -> None:
        u.launched = True
        if self.timeline is not None and getattr(u, "backward_start", None) is not None:
            self.timeline.add(f"B {u.name}", u.backward_start, self._stamp(u), "compute")
        flat = torch.zeros(u.padded, dtype=u.full.dtype, device=u.full.device)
        self._count("gradients", u.bytes)
        for leaf, o, n in zip(u.leaves, u.offsets, u.numels, strict=True):
            if leaf.grad is not None:
                flat[o : o + n].copy_(leaf.grad.reshape(-1))
                self._count("gradients", -leaf.grad.numel() * leaf.grad.element_size())
                leaf.grad = None
        if not self._manual:  # (a plan frees where it says)
            self._free(u)  # its backward is over: the whole parameters go
        out = torch.empty(u.shard_numel, dtype=flat.dtype, device=flat.device)
        handle = self._reduce_scatter(out, flat) or handles.Done()
        if self.timeline is not None:
            handle = self.timeline.track(f"RS {u.name}", handle, "comm", device=out.device)
        self._reducing.append((u, out, flat, handle))

    def _end_of_backward(self) -> None:
        for u in self.units:
            u.complete = True
        self._launch_ready()
        for u in self.units:
            self._free(u)
        self._state = "reducing"

    # ------------------------------------------------------------ the step
    def forward(self, *args, **kwargs):
        if self._state in ("backward", "reducing"):
            raise RuntimeError(
                "FullyShardedDP: a new forward started before the last backward's gradients "
                "were reduce-scattered: call finish_gradient_synchronization() after "
                "backward() and before optimizer.step(), every step"
            )
        self._ran = []
        for u in self.units:
            u.ready, u.complete, u.launched, u.backward_started = 0, False, False, False
        root = [u for u in self.units if u.module is None]
        for u in root:
            self._wait(u)
        self._state = "forward" if torch.is_grad_enabled() else "idle"
        self._in_forward = True
        try:
            out = self.module(*args, **kwargs)
        except RuntimeError as exc:
            if "storage of size 0" not in str(exc):
                raise
            whole = [u.name for u in self.units if u.gathered]
            raise RuntimeError(
                f"FullyShardedDP: a parameter was used while its unit was resharded (only "
                f"{', '.join(whole) or 'no unit'} whole at that moment): a unit's parameters "
                "exist whole only inside the unit's own forward. Was one used by another "
                "module, or before or after its unit ran?"
            ) from exc
        finally:
            self._in_forward = False
        # prefetched units that did not run this time: their gathers are waited and freed,
        # never left in flight
        for u in self.units:
            if u.module is not None and u.index not in self._ran:
                self._free(u)
        if self._ran:
            self._order = list(self._ran)
        if self._state == "forward" and _needs_grad(out):
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda grad: self._backward_begins())
        else:
            for u in self.units:
                self._free(u)
            self._state = "idle"
        return out

    def finish_gradient_synchronization(self) -> None:
        """Wait for every unit's ReduceScatter and give each shard its averaged gradient
        (added to what ``.grad`` holds, as backward accumulates). Call it after backward
        and before ``optimizer.step()``."""
        if self._state == "backward":
            raise RuntimeError(
                "FullyShardedDP: finish_gradient_synchronization() was called while backward "
                "was still running (from a hook?): call it after loss.backward() returns"
            )
        for u, out, flat, handle in self._reducing:
            handle.wait()
            u.shard.grad = out if u.shard.grad is None else u.shard.grad + out
            self._count("gradients", -flat.numel() * flat.element_size())
        self._reducing = []
        self._state = "idle"

    def run_plan(self, plan, x, target, loss_fn) -> float:
        """Run one training step as ``plan`` says, action by action (lab 12), for a model
        whose units run one after another (``torch.nn.Sequential`` of the units)::

            "gather K"   start unit K's AllGather       "wait K"    wait for it
            "forward K"  unit K's forward (whole)       "backward K" its backward (whole)
            "free K"     drop unit K's whole parameters "reduce K"  start its ReduceScatter
            "finish"     wait for every ReduceScatter: each shard has its averaged gradient

        Nothing is gathered, freed or reduced but where the plan says. A plan that uses a
        unit that is not whole raises :class:`PlanError` naming the action. Returns the
        loss of this rank's batch."""
        return _run_plan(self, plan, x, target, loss_fn)

    # ------------------------------------------------------------ reading
    def memory(self, optimizer=None) -> dict:
        """Bytes per rank: the shards (parameters and their gradients, held all along), the
        most whole unit parameters and the most gradient buffers held at once (since
        construction or :meth:`reset_peak`), and the optimizer's state when given; on a
        GPU also the CUDA allocator's peak (``torch.cuda.max_memory_allocated``)."""
        shards = sum(u.shard.numel() * u.shard.element_size() for u in self.units)
        out = {
            "shards": shards,
            "shard_grads": sum(
                u.shard.numel() * u.shard.element_size() for u in self.units if u.trainable
            ),  # fmt: skip
            "peak_gathered": self._peak["gathered"],
            "peak_gradients": self._peak["gradients"],
            "peak_transient": self._peak["together"],
            "largest_unit": max(u.bytes for u in self.units),
        }
        if self.units[0].full.is_cuda:  # the allocator's own count beside the wrapper's
            out["allocator_peak"] = torch.cuda.max_memory_allocated(self.units[0].full.device)
        if optimizer is not None:
            out["optimizer"] = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                                   for t in s.values() if torch.is_tensor(t))  # fmt: skip
        return out

    def reset_peak(self) -> None:
        self._peak = dict.fromkeys(self._peak, 0)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by its name in the model (a collective: every rank calls
        it), with the model's buffers."""
        state = {}
        for u in self.units:
            whole = torch.empty(u.padded, dtype=u.full.dtype, device=u.full.device)
            all_gather_tensor(whole, u.shard.detach(), group=self._ag_group)
            for names, o, n, s in zip(u.names, u.offsets, u.numels, u.shapes, strict=True):
                for name in names:
                    state[name] = whole[o : o + n].view(s).clone()
        for name, b in self.module.named_buffers():
            state[name] = b.detach().clone()
        return state

    def describe(self) -> str:
        rows = [f"{u.name}: {sum(u.numels)} elements, shard {u.shard_numel}"
                f"{'' if u.trainable else ' (frozen)'}" for u in self.units]  # fmt: skip
        return f"FullyShardedDP over {self.world} ranks, prefetch={self.prefetch}: " + "; ".join(
            rows
        )


def _needs_grad(out) -> bool:
    return any(t.requires_grad for t in _tensors(out))


def _gatherer(all_gather, group):
    """``fn(output, input)`` that starts an AllGather and returns its handle."""
    if all_gather is None or all_gather == "builtin":
        return lambda out, inp: all_gather_tensor(out, inp, group=group, async_op=True)
    if all_gather == "ring" or all_gather is ring_all_gather:
        return lambda out, inp: ring_all_gather(out, inp, group=group, async_op=True)
    if callable(all_gather):
        return lambda out, inp: all_gather(out, inp, async_op=True)
    raise ValueError(
        "all_gather must be None (the built-in), 'ring', or a function "
        f"fn(output, input, async_op=True); got {all_gather!r}"
    )


def _scatterer(reduce_scatter, group, world: int):
    """``fn(output, input)`` that starts a ReduceScatter whose handle's wait() leaves the
    *average* in ``output``."""
    if reduce_scatter is None or reduce_scatter == "builtin":
        return lambda out, inp: _Averaged(
            reduce_scatter_tensor(out, inp, group=group, async_op=True), out, world
        )
    if reduce_scatter == "ring" or reduce_scatter is ring_reduce_scatter:
        return lambda out, inp: ring_reduce_scatter(out, inp, op="avg", group=group,
                                                    async_op=True)  # fmt: skip
    if callable(reduce_scatter):
        return lambda out, inp: _Averaged(
            reduce_scatter(out, inp, async_op=True) or handles.Done(), out, world
        )
    raise ValueError(
        "reduce_scatter must be None (the built-in), 'ring', or a function "
        f"fn(output, input, async_op=True) that sums; got {reduce_scatter!r}"
    )
