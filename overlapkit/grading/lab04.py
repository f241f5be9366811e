"""Checks for lab 04: one ZeRO-1 optimizer step built from ReduceScatter and AllGather."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..sharded import flatten_padded, unflatten_into
from .common import run_or_report, worst_element
from .report import Report

STEPS = 10


def _model():
    torch.manual_seed(0)  # the same model on every rank
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _run(zero1_step):
    import overlapkit as ok

    me, world = ok.rank(), ok.world_size()
    model, reference = _model(), _model()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    shard_numel = -(-numel // world)
    padded = shard_numel * world
    flat_params = flatten_padded(params, padded)
    shard = torch.nn.Parameter(flat_params[me * shard_numel : (me + 1) * shard_numel].clone())
    # SGD with momentum, not Adam: Adam ignores the scale of the gradient, so it
    # could not tell a summed gradient from an averaged one
    optimizer = torch.optim.SGD([shard], lr=0.05, momentum=0.9)
    plain = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(10 + me)
    initial = flat_params[:numel].clone()
    trace = []
    for _ in range(STEPS):
        x, y = torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)
        # the learner's model is the flat vector: load it, backward, flatten the grads
        with torch.no_grad():
            unflatten_into(params, flat_params)
        torch.nn.functional.mse_loss(model(x), y).backward()
        flat_grads = flatten_padded(params, padded, [p.grad for p in params])
        for p in params:
            p.grad = None
        with torch.no_grad():
            zero1_step(flat_params, flat_grads, shard, optimizer)
        # the unsharded baseline: average the gradients, step Adam on everything
        torch.nn.functional.mse_loss(reference(x), y).backward()
        for p in reference.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        plain.step()
        plain.zero_grad()
        trace.append(
            (
                flat_params[:numel].clone(),
                flatten_padded(list(reference.parameters()), padded)[:numel],
            )
        )
    state = sum(t.numel() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    return trace, state, numel, shard_numel, initial


def _update_hint(before, got, want, world: int) -> str:
    """What the learner's update is, compared with the right one, on one shard."""
    right, theirs = want - before, got - before
    moved = right.abs() > 1e-7
    if not moved.any():
        return ""
    ratio = (theirs[moved] / right[moved]).median().item()
    if abs(ratio - world) < 0.15 * world:
        return (
            f" Your update is {ratio:.2f}× the right one, about N = {world}: the gradients "
            "were summed, not averaged (ring_reduce_scatter(..., op='avg'))."
        )
    if abs(ratio) < 0.05:
        return (
            " This part did not change at all: the updated shard never reached this rank. "
            "All-gather every rank's shard into flat_params after optimizer.step()."
        )
    return f" Your update is {ratio:.2f}× the right one there."


def check_zero1_step(zero1_step, world_size: int = 3, timeout: float = 60.0) -> Report:
    """Check ``zero1_step(flat_params, flat_grads, shard, optimizer)`` against the unsharded step.

    Over 10 steps on ``world_size`` ranks (SGD with momentum), every rank's full
    parameter vector must match the unsharded optimizer on the averaged
    gradients, and each rank's optimizer state must cover its shard only.
    """
    report = Report("zero1_step")
    results = run_or_report(report, f"zero1_step on {world_size} ranks", _run, zero1_step,
                            world_size=world_size, timeout=timeout)  # fmt: skip
    if results is None:
        return report
    worst = None
    for rank, ((trace, _, _, shard_numel, initial), _) in enumerate(results):
        before = initial
        for step, (got, want) in enumerate(trace, start=1):
            i = worst_element((got - want).abs())
            if i is not None:
                owner = i // shard_numel
                part = slice(owner * shard_numel, (owner + 1) * shard_numel)
                hint = _update_hint(before[part], got[part], want[part], world_size)
                worst = (rank, step, i, owner, want[i].item(), got[i].item(), hint)
                break
            before = want
        if worst:
            break
    if worst:
        rank, step, i, owner, want, got, hint = worst
        report.fail(
            f"after step {step}, rank {rank}'s parameter {i} (in rank {owner}'s shard) "
            f"is {got:.6g}; unsharded SGD on the averaged gradients gives {want:.6g}."
            + (hint or " Did you average (op='avg') and all-gather every rank's updated shard?")
        )
    else:
        report.ok(
            f"{STEPS} steps on {world_size} ranks: every rank matches the unsharded optimizer"
        )
    states = [r[0][1] for r in results]
    numel, shard_numel = results[0][0][2], results[0][0][3]  # (trace, state, numel, shard, ...)
    if all(s == shard_numel for s in states):
        report.ok(f"each rank holds momentum for its shard only: {shard_numel} of {numel} values")
    else:
        report.fail(
            f"optimizer state per rank is {states} values; expected {shard_numel} (the shard)"
        )
    return report
