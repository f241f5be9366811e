"""A fully sharded step as a plan: the actions of lab 12, read and run one by one.

``"gather K"``, ``"wait K"``, ``"forward K"``, ``"backward K"``, ``"free K"``, ``"reduce K"``
and ``"finish"`` drive ``ok.FullyShardedDP``'s own gathers, frees and ReduceScatters
(:meth:`FullyShardedDP.run_plan <overlapkit.fsdp.FullyShardedDP.run_plan>`); an action that
does not parse (its words are :data:`overlapkit.plans.FSDP`'s), or that computes with a unit
that is not whole, raises :class:`PlanError`.
"""

from __future__ import annotations

from .plans import FSDP, Finish, PlanSyntaxError, UnitAction


class PlanError(RuntimeError):
    """A plan (:meth:`FullyShardedDP.run_plan`) used a unit that was not whole, or named
    an action that does not exist."""


def _parse_action(action, n: int, i: int) -> tuple[str, int | None]:
    """Action ``i`` (1-based) of a plan for ``n`` units, read by :data:`overlapkit.plans.FSDP`:
    (its op, its unit; None for "finish")."""
    try:
        step = FSDP.parse_step(action)
    except PlanSyntaxError:
        step = None
    if isinstance(step, Finish):
        return "finish", None
    if isinstance(step, UnitAction) and 0 <= step.unit < n:
        return step.op, step.unit
    raise PlanError(
        f"action {i} {action!r}: expected {FSDP.expected()}, with K a unit from 0 to {n - 1}"
    )


def _state(u) -> str:
    if u.pending is not None:
        return "its AllGather was not waited"
    return "whole" if u.gathered else "sharded: gather and wait it first"


def _run_plan(fsdp, plan, x, target, loss_fn) -> float:
    """:meth:`FullyShardedDP.run_plan <overlapkit.fsdp.FullyShardedDP.run_plan>` on the
    wrapper ``fsdp``: its units gathered, waited, freed and reduced where the plan says."""
    n = len(fsdp.units)
    if any(u.module is None for u in fsdp.units) or [u.module for u in fsdp.units] != list(
        fsdp.module.children()
    ):
        raise ValueError(
            "run_plan runs a model that is a Sequential of its units only (every "
            "parameter in a unit, the units in order)"
        )
    fsdp._ran, fsdp._manual, fsdp._in_forward = [], True, True
    fsdp._state = "plan"
    for u in fsdp.units:
        u.ready, u.complete, u.launched, u.backward_started = 0, False, False, False
    inputs, outputs, grads, loss = {}, {}, {}, None
    try:
        for i, action in enumerate(plan, start=1):
            op, k = _parse_action(action, n, i)
            u = fsdp.units[k] if k is not None else None
            try:
                if op == "gather":
                    fsdp._issue(u)
                elif op == "wait":
                    fsdp._wait(u)
                elif op == "free":
                    fsdp._free(u)
                elif op == "forward":
                    if k > 0 and k - 1 not in outputs:
                        raise PlanError(f"forward {k - 1} has not run: it makes the input")
                    h = x if k == 0 else outputs[k - 1].detach().requires_grad_()
                    inputs[k], outputs[k] = h, u.module(h)
                elif op == "backward":
                    if not u.gathered or u.pending is not None:
                        raise PlanError(f"unit {k} is not whole ({_state(u)})")
                    if k not in outputs or (k < n - 1 and k + 1 not in grads):
                        first = f"forward {k}" if k not in outputs else f"backward {k + 1}"
                        raise PlanError(f"{first} has not run: backward {k} needs it")
                    u.backward_start = fsdp._stamp(u)
                    if k == n - 1:
                        loss = loss_fn(outputs[k], target)
                        loss.backward()
                    else:
                        outputs[k].backward(grads[k + 1])
                    if k > 0:
                        grads[k] = inputs[k].grad
                    grads.setdefault(k, None)
                    u.complete = True
                elif op == "reduce":
                    if not u.complete or u.launched:
                        raise PlanError(
                            "already reduced" if u.launched else "its backward has not run"
                        )
                    fsdp._launch(u)
                else:
                    fsdp.finish_gradient_synchronization()
            except PlanError as exc:
                raise PlanError(f"action {i} {action!r}: {exc}") from None
    finally:
        fsdp._manual, fsdp._in_forward = False, False
        if fsdp._state == "plan":
            fsdp._state = "idle"
    return loss.item() if loss is not None else float("nan")
