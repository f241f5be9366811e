"""Expert parallelism: a top-1 mixture-of-experts layer, one expert per rank.

Every rank routes its own tokens; each token goes to the rank that holds its expert and
comes back with the expert's output. Two all-to-alls per layer, both on the critical path::

    rank r:  tokens ─► router ─► sort by expert ─► dispatch ─► expert r ─► combine ─► unsort · gate
                                                  (all-to-all)            (all-to-all)

The pipelined layer (``chunks=k``, as Tutel) cuts the tokens into k chunks: while chunk
c's tokens are in the expert, chunk c+1's travel there and chunk c−1's travel back::

    comm:     D0 D1 ·· C0 D2 ·· C1 D3 ·· C2 …
    compute:     E0 ──── E1 ──── E2 ──── E3 …

The first dispatch and the last combine stay exposed. ``local_first=True`` recovers the
first (as FasterMoE schedules it): the tokens a rank routes to its *own* expert never
cross the link, so every chunk's dispatch carries only the others' tokens, all are issued
at once, and the own tokens (L) are computed while they travel::

    comm:     D0 D1 D2 D3 ·· C0 ·· C1 ·· C2 ·· C3
    compute:  L ─────────── E0 ── E1 ── E2 ── E3

Both all-to-alls run on the kit's communication worker, in issue order (the CPU's
communication stream), so only the expert compute and the token movement overlap. The
token counts of every chunk are exchanged once, up front, so the chunks' all-to-alls need
no count messages of their own, and the tokens are sorted once (by chunk, then expert), so
each chunk is one contiguous block. Same outputs and gradients as the unpipelined layer
(tests); backward sends the gradients back the way the tokens came, chunk by chunk,
without overlap. No capacity limit: an expert takes every token routed to it.
"""

from __future__ import annotations

import copy
import time

import torch

from .collectives import all_to_all, chunk_bounds
from .ordering import _ring
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
    ``local_first``: compute the tokens routed to this rank's own expert first, while
    every chunk's dispatch (of the other tokens) travels. ``timeline`` records ``route``,
    ``expert local`` and ``expert c`` (compute) and ``dispatch c`` / ``combine c`` (comm,
    from issue to completion) spans."""

    def __init__(self, router: torch.nn.Module, experts, group=None, chunks: int = 1,
                 timeline=None, local_first: bool = False):  # fmt: skip
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
        self.local_first = local_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        me, world = _ring(self.group)[:2]
        k = self.chunks
        if not isinstance(k, int) or k < 1 or k > len(x):
            raise ValueError(
                f"rank {me}: chunks={k!r} must be an integer from 1 to the {len(x)} tokens "
                f"this rank holds (each chunk needs at least one token)"
            )
        self._device = x.device  # where the layer runs: its spans are timed there
        t0 = self._stamp()
        expert, gate = route(x, self.router)
        # one sort for every chunk, by chunk and then by expert (stable): chunk c's tokens
        # for rank j are one contiguous block; with local_first this rank's own go first
        # (made on the tokens' device: the router's choices live there, on a GPU too)
        sizes = torch.tensor([hi - lo for lo, hi in chunk_bounds(len(x), k)], device=x.device)
        key = torch.repeat_interleave(torch.arange(k, device=x.device), sizes) * world + expert
        send = torch.bincount(key, minlength=k * world).view(k, world)
        self.tokens_sent = int(send.sum() - send[:, me].sum())  # left this rank
        local = 0
        if self.local_first:
            key = torch.where(expert == me, -1, key)
            local = int(send[:, me].sum())
            send[:, me] = 0  # the chunks' all-to-alls carry the others' tokens only
        order = torch.argsort(key, stable=True)
        # the schedule travels with the counts (one more row): ranks that disagree on it
        # would pair one rank's dispatch with another's combine
        mine = int(self.local_first)
        try:
            schedule = torch.full((1, world), mine, device=send.device)
            recv = exchange_counts(torch.cat([send, schedule]), self.group)
        except CollectiveMismatchError as e:
            raise ValueError(
                f"rank {me}: MoELayer runs with chunks={k} here, but the ranks disagree on "
                f"the chunk count (every rank must cut its tokens into as many chunks): {e}"
            ) from None
        recv, theirs = recv[:-1], recv[-1].tolist()
        if any(flag != mine for flag in theirs):
            other = next(r for r, flag in enumerate(theirs) if flag != mine)
            raise ValueError(
                f"rank {me}: MoELayer runs with local_first={self.local_first} here, but rank "
                f"{other} runs local_first={not self.local_first}: every rank must use the "
                "same schedule"
            )
        sorted_x = x[order]
        self._span("route", t0, "compute")
        send_at, recv_at = send.tolist(), recv.tolist()
        starts = [local]  # where each chunk's block begins in sorted_x
        for row in send_at:
            starts.append(starts[-1] + sum(row))

        def dispatch(c, pending):
            block = sorted_x[starts[c] : starts[c + 1]]
            return AllToAll.apply(block, recv_at[c], send_at[c], self.group, pending)

        # local_first: every dispatch at once (the own tokens' compute covers them); else
        # one ahead, so that chunk c's combine is not queued behind later dispatches
        ahead = k if self.local_first else 1
        outs, dispatched, combined, pending = [], {}, [], []
        for c in range(ahead):
            dispatched[c] = (dispatch(c, pending), self._track(f"dispatch {c}", pending))
        if self.local_first:
            t0 = self._stamp()
            outs.append(self.expert(sorted_x[:local]))
            self._span("expert local", t0, "compute")
        for c in range(k):
            if c + ahead < k:  # the next chunk travels while this one computes
                n = c + ahead
                dispatched[n] = (dispatch(n, pending), self._track(f"dispatch {n}", pending))
            tokens, handle = dispatched.pop(c)
            handle.wait()
            t0 = self._stamp()
            y = self.expert(tokens)
            self._span(f"expert {c}", t0, "compute")
            outs.append(AllToAll.apply(y, send_at[c], recv_at[c], self.group, pending))
            combined.append(self._track(f"combine {c}", pending))
        for handle in combined:
            handle.wait()
        out = torch.empty_like(x).index_copy(0, order, torch.cat(outs))
        return out * gate[:, None]

    def _track(self, name: str, pending: list):
        handle = pending.pop()
        if self.timeline is None:
            return handle
        return self.timeline.track(name, handle, "comm", device=self._device)

    def _stamp(self):
        """Now, for a span: the host clock, or the GPU's moment on a CUDA device."""
        return time.perf_counter() if self.timeline is None else self.timeline.stamp(self._device)

    def _span(self, name: str, start, lane: str) -> None:
        if self.timeline is not None:
            self.timeline.add(name, start, self._stamp(), lane)
