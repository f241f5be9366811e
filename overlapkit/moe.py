"""Expert parallelism: a top-1 mixture-of-experts layer, one expert per rank.

Every rank routes its own tokens; each token goes to the rank that holds its expert and
comes back with the expert's output. Two all-to-alls per layer, both on the critical path::

    rank r:  tokens ─► router ─► sort by expert ─► dispatch ─► expert r ─► combine ─► unsort · gate
                                                  (all-to-all)            (all-to-all)

The pipelined layer (``chunks=k``, as Tutel) cuts the tokens into k chunks: while chunk
c's tokens are in the expert, chunk c+1's travel there and chunk c−1's travel back::

    comm:     D0 D1 ·· C0 D2 ·· C1 D3 ·· C2 …
    compute:     E0 ──── E1 ──── E2 ──── E3 …

Both all-to-alls run on the kit's communication worker, in issue order (the CPU's
communication stream), so only the expert compute and the token movement overlap. The
token counts of every chunk are exchanged once, up front, so the chunks' all-to-alls need
no count messages of their own. Same outputs and gradients as the unpipelined layer
(tests); backward sends the gradients back the way the tokens came, chunk by chunk,
without overlap. No capacity limit: an expert takes every token routed to it.
"""

from __future__ import annotations

import copy
import time

import torch

from .collectives import _ring, all_to_all, chunk_bounds
from .p2p import CollectiveMismatchError

__all__ = ["MoELayer", "make_moe", "reference_moe", "route", "exchange_counts", "AllToAll"]


def make_moe(d_model: int, d_hidden: int, n_experts: int, seed: int = 0):
    """A router (``Linear(d_model, n_experts)``) and ``n_experts`` MLP experts, the same
    on every rank that passes the same seed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        router = torch.nn.Linear(d_model, n_experts)
        experts = [
            torch.nn.Sequential(
                torch.nn.Linear(d_model, d_hidden),
                torch.nn.GELU(),
                torch.nn.Linear(d_hidden, d_model),
            )
            for _ in range(n_experts)
        ]
    return router, experts


def route(x: torch.Tensor, router: torch.nn.Module):
    """Top-1 routing: each token's expert and gate (its softmax probability)."""
    probs = torch.softmax(router(x), dim=-1)
    gate, expert = probs.max(dim=-1)
    return expert, gate


def reference_moe(x: torch.Tensor, router, experts) -> torch.Tensor:
    """The layer on one device: every token through its expert, scaled by its gate."""
    expert, gate = route(x, router)
    out = torch.zeros_like(x)
    for e, module in enumerate(experts):
        mine = (expert == e).nonzero().flatten()
        if len(mine):
            out = out.index_copy(0, mine, module(x[mine]))
    return out * gate[:, None]


class AllToAll(torch.autograd.Function):
    """``ok.all_to_all`` with a backward (the gradients go back the way the rows came).

    ``apply(x, out_splits, in_splits, group, pending)``: with a list as ``pending`` the
    exchange is asynchronous, its handle appended there, and the returned tensor may be
    read only after that handle's ``wait()``; with ``None`` it is done on return."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, pending):
        ctx.splits, ctx.group = (list(out_splits), list(in_splits)), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        # the worker writes through an alias without autograd history, so that filling
        # the result later (from the communication thread) is not an in-place op on it
        handle = all_to_all(out.detach(), x.detach().contiguous(), out_splits, in_splits,
                            group=group, async_op=pending is not None, check=False)  # fmt: skip
        if pending is not None:
            pending.append(handle)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        all_to_all(back, grad.contiguous(), in_splits, out_splits, group=ctx.group, check=False)
        return back, None, None, None, None


def exchange_counts(send: torch.Tensor, group=None) -> torch.Tensor:
    """``send[c, j]``: rows of chunk c this rank sends to rank j. Returns ``recv[c, i]``:
    rows of chunk c rank i sends here. One checked all-to-all for every chunk, so that a
    rank with a different chunk count is refused here, naming the ranks."""
    world = _ring(group)[1]
    if send.dim() != 2 or send.shape[1] != world:
        raise ValueError(f"exchange_counts: send must be [chunks, {world}], got {list(send.shape)}")
    recv = torch.empty_like(send.t().contiguous())
    all_to_all(recv, send.t().contiguous(), group=group)  # row j: my counts for rank j
    return recv.t()


class MoELayer(torch.nn.Module):
    """Top-1 MoE with one expert per rank: ``router`` (same on every rank) and
    ``experts`` (a list with one module per rank: this rank keeps ``experts[rank]``; or
    this rank's expert alone). ``chunks``: pipeline the all-to-alls with the expert
    compute in that many token chunks (1: dispatch, compute, combine one after another).
    ``timeline`` records ``route``, ``expert c`` (compute) and ``dispatch c`` /
    ``combine c`` (comm, from issue to completion) spans."""

    def __init__(self, router: torch.nn.Module, experts, group=None, chunks: int = 1,
                 timeline=None):  # fmt: skip
        super().__init__()
        me, world = _ring(group)[:2]
        if isinstance(experts, (list, tuple, torch.nn.ModuleList)):
            if len(experts) != world:
                raise ValueError(
                    f"rank {me}: MoELayer has one expert per rank: got {len(experts)} "
                    f"experts for {world} ranks"
                )
            experts = experts[me]
        if getattr(router, "out_features", world) != world:
            raise ValueError(
                f"rank {me}: the router scores {router.out_features} experts, but there "
                f"are {world} ranks (one expert each)"
            )
        self.router, self.expert = copy.deepcopy(router), copy.deepcopy(experts)
        self.group, self.chunks, self.timeline = group, chunks, timeline

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        me, world = _ring(self.group)[:2]
        k = self.chunks
        if not isinstance(k, int) or k < 1 or k > len(x):
            raise ValueError(
                f"rank {me}: chunks={k!r} must be an integer from 1 to the {len(x)} tokens "
                f"this rank holds (each chunk needs at least one token)"
            )
        t0 = time.perf_counter()
        expert, gate = route(x, self.router)
        bounds = chunk_bounds(len(x), k)
        orders, send = [], torch.zeros(k, world, dtype=torch.int64)
        for c, (lo, hi) in enumerate(bounds):
            orders.append(torch.argsort(expert[lo:hi], stable=True) + lo)
            send[c] = torch.bincount(expert[lo:hi], minlength=world)
        try:
            recv = exchange_counts(send, self.group)
        except CollectiveMismatchError as e:
            raise ValueError(
                f"rank {me}: MoELayer runs with chunks={k} here, but the ranks disagree on "
                f"the chunk count (every rank must cut its tokens into as many chunks): {e}"
            ) from None
        self._span("route", t0, "compute")
        send_at, recv_at = send.tolist(), recv.tolist()
        self.tokens_sent = int(send.sum() - send[:, me].sum())  # left this rank

        def dispatch(c, pending):
            return AllToAll.apply(x[orders[c]], recv_at[c], send_at[c], self.group, pending)

        outs, dispatched, combined = [None] * k, {}, []
        pending = []
        dispatched[0] = (dispatch(0, pending), self._track("dispatch 0", pending))
        for c in range(k):
            if c + 1 < k:  # the next chunk travels while this one computes
                dispatched[c + 1] = (
                    dispatch(c + 1, pending),
                    self._track(f"dispatch {c + 1}", pending),
                )
            tokens, handle = dispatched.pop(c)
            handle.wait()
            t0 = time.perf_counter()
            y = self.expert(tokens)
            self._span(f"expert {c}", t0, "compute")
            outs[c] = AllToAll.apply(y, send_at[c], recv_at[c], self.group, pending)
            combined.append(self._track(f"combine {c}", pending))
        for handle in combined:
            handle.wait()
        order = torch.cat(orders)
        out = torch.empty_like(x).index_copy(0, order, torch.cat(outs))
        return out * gate[:, None]

    def _track(self, name: str, pending: list):
        handle = pending.pop()
        return self.timeline.track(name, handle, "comm") if self.timeline is not None else handle

    def _span(self, name: str, start: float, lane: str) -> None:
        if self.timeline is not None:
            self.timeline.add(name, start, time.perf_counter(), lane)
