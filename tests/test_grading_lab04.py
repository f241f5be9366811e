"""Lab 04's checks: every honest ZeRO-1 step passes, every typical mistake fails with a
message that names it (the race guard makes the NaN cases fail every run, not by luck)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import overlapkit as ok
from overlapkit.grading.lab04_zero1 import MEMORY_CASES, memory_reference

# ------------------------------------------------------------------ zero1_step: honest


def zero1_right(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    ok.ring_reduce_scatter(grad, flat_grads, op="avg")
    shard.grad = grad
    optimizer.step()
    ok.ring_all_gather(flat_params, shard.detach())


def zero1_async_waited_sum_divided(flat_params, flat_grads, shard, optimizer):
    shard.grad = torch.empty_like(shard)
    ok.ring_reduce_scatter(shard.grad, flat_grads, async_op=True).wait()
    shard.grad /= ok.world_size()
    optimizer.step()
    optimizer.zero_grad()  # leaves shard.grad None: the step already used it
    gathered = torch.empty_like(flat_params)
    handle = ok.ring_all_gather(gathered, shard, async_op=True)
    handle.wait()
    flat_params.copy_(gathered)


@pytest.mark.parametrize("step", [zero1_right, zero1_async_waited_sum_divided])
def test_zero1_check_passes_honest_steps(step):
    report = ok.grading.check_zero1_step(step)
    assert report.all_passed, report.cases
    assert report.total == 2


# ------------------------------------------------------------------ zero1_step: mistakes


def zero1_all_reduce_then_slice(flat_params, flat_grads, shard, optimizer):
    ok.ring_all_reduce(flat_grads, op="avg")
    n = shard.numel()
    shard.grad = flat_grads[ok.rank() * n : (ok.rank() + 1) * n].clone()
    optimizer.step()
    ok.ring_all_gather(flat_params, shard.detach())


def zero1_builtins(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    ok.builtin.reduce_scatter_tensor(grad, flat_grads)
    shard.grad = grad / dist.get_world_size()
    optimizer.step()
    ok.builtin.all_gather_tensor(flat_params, shard.detach())


def zero1_torch_all_reduce(flat_params, flat_grads, shard, optimizer):
    dist.all_reduce(flat_grads)
    n, me = shard.numel(), dist.get_rank()
    shard.grad = flat_grads[me * n : (me + 1) * n] / dist.get_world_size()
    optimizer.step()
    ok.ring_all_gather(flat_params, shard.detach())


def zero1_grad_never_set(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    ok.ring_reduce_scatter(grad, flat_grads, op="avg")
    optimizer.step()  # shard.grad is None: nothing moves
    ok.ring_all_gather(flat_params, shard.detach())


def zero1_divides_by_two(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    ok.ring_reduce_scatter(grad, flat_grads)
    shard.grad = grad / 2  # the world size written as a number
    optimizer.step()
    ok.ring_all_gather(flat_params, shard.detach())


def zero1_sums(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    ok.ring_reduce_scatter(grad, flat_grads)  # sum, not average
    shard.grad = grad
    optimizer.step()
    ok.ring_all_gather(flat_params, shard.detach())


def zero1_wrong_shard(flat_params, flat_grads, shard, optimizer):
    ok.ring_all_reduce(flat_grads, op="avg")
    n, k = shard.numel(), (ok.rank() + 1) % ok.world_size()
    shard.grad = flat_grads[k * n : (k + 1) * n].clone()
    optimizer.step()
    ok.ring_all_gather(flat_params, shard.detach())


def zero1_own_gradient_only(flat_params, flat_grads, shard, optimizer):
    me, n = ok.rank(), shard.numel()
    shard.grad = flat_grads[me * n : (me + 1) * n].clone()  # no reduce: this rank's batch only
    optimizer.step()
    ok.ring_all_gather(flat_params, shard.detach())


def zero1_gathers_the_gradient(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    ok.ring_reduce_scatter(grad, flat_grads, op="avg")
    shard.grad = grad
    optimizer.step()
    ok.ring_all_gather(flat_params, shard.grad)


def zero1_reads_before_wait(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    handle = ok.ring_reduce_scatter(grad, flat_grads, op="avg", async_op=True)
    shard.grad = grad
    optimizer.step()  # the ReduceScatter may still be running
    handle.wait()
    ok.ring_all_gather(flat_params, shard.detach())


def zero1_never_waits_the_reduce_scatter(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    ok.ring_reduce_scatter(grad, flat_grads, op="avg", async_op=True)
    shard.grad = grad
    optimizer.step()
    ok.ring_all_gather(flat_params, shard.detach())


def zero1_never_waits_the_gather(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    ok.ring_reduce_scatter(grad, flat_grads, op="avg")
    shard.grad = grad
    optimizer.step()
    ok.ring_all_gather(flat_params, shard.detach(), async_op=True)


def zero1_forgets_to_gather(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    ok.ring_reduce_scatter(grad, flat_grads, op="avg")
    shard.grad = grad
    optimizer.step()


def zero1_rebinds_flat_params(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    ok.ring_reduce_scatter(grad, flat_grads, op="avg")
    shard.grad = grad
    optimizer.step()
    gathered = torch.empty_like(flat_params)
    ok.ring_all_gather(gathered, shard.detach())
    flat_params = gathered  # noqa: F841 - the caller's tensor stays as it was


MISTAKES = {
    zero1_all_reduce_then_slice: (
        "rank 0 all-reduced the whole gradient (ok.ring_all_reduce): a ring AllReduce of "
        "S = 264 bytes sends 2(N−1)/N·S = 352 bytes per rank, twice the (N−1)/N·S = 176",
        "so each rank receives only its shard's sum",
    ),
    zero1_builtins: (
        "rank 0 called torch.distributed.",
        "reduce_scatter",
        "one step is ok.ring_reduce_scatter of the gradients and ok.ring_all_gather",
    ),
    zero1_torch_all_reduce: ("rank 0 called torch.distributed.all_reduce",),
    zero1_grad_never_set: (
        "The optimizer never saw a gradient: rank 0's shard parameter has no .grad",
        "Set shard.grad to this rank's reduced slice of the gradient before optimizer.step()",
    ),
    zero1_divides_by_two: (
        "Your update is 1.50× the right one: N/2 with N = 3",
        "a world size written as a number",
    ),
    zero1_sums: ("after step 1", "about N = 3: the gradients were summed, not averaged"),
    zero1_wrong_shard: (
        "Rank 0's optimizer stepped on the averaged gradient of rank 1's slice (elements 22…43)",
        "not of its own (0…21)",
    ),
    zero1_own_gradient_only: (
        "The update there is rank 0's own gradient, not reduced over the ranks",
        "Reduce-scatter the gradients",
    ),
    zero1_gathers_the_gradient: (
        "That value is a gradient, not a parameter: flat_params holds the gathered shard.grad",
    ),
    zero1_reads_before_wait: (
        "NaN: the check poisons a kit operation's output with NaN until its wait() returns",
        "Rank 0's optimizer stepped on a NaN gradient",
        "before handle.wait()",
    ),
    zero1_never_waits_the_reduce_scatter: (
        "rank 0 never waited for 10 operation(s), e.g. ring_reduce_scatter",
        "flat_params then held NaN (the check poisons",
        "call .wait() on every handle before reading what it delivers",
    ),
    zero1_forgets_to_gather: ("the updated shard never reached this rank",),
    zero1_rebinds_flat_params: (
        "flat_params did not change on rank 0, not even rank 0's own shard",
        "though it called an AllGather: write the gathered parameters into flat_params",
    ),
}


@pytest.mark.parametrize("step", list(MISTAKES), ids=[f.__name__ for f in MISTAKES])
def test_zero1_check_names_each_mistake(step):
    report = ok.grading.check_zero1_step(step)
    (passed, message), _ = report.cases
    assert not passed
    for words in MISTAKES[step]:
        assert words in message, message
    if step in (zero1_builtins, zero1_torch_all_reduce, zero1_all_reduce_then_slice):
        # the sharded state is not judged for a step the kit's collectives did not make
        assert report.score == 0, report.cases


def test_zero1_check_names_a_gather_never_waited():
    report = ok.grading.check_zero1_step(zero1_never_waits_the_gather)
    ((passed, message),) = report.cases
    assert not passed
    assert "is already in flight in an earlier operation that was not waited yet" in message
    assert "The operation of the step before on that tensor was never waited" in message


def test_zero1_state_case_says_the_optimizer_never_had_a_gradient():
    report = ok.grading.check_zero1_step(zero1_grad_never_set)
    _, (passed, message) = report.cases
    assert not passed
    assert "no rank's optimizer holds any momentum (state per rank [0, 0, 0])" in message
    assert "shard.grad was None on every rank, every step" in message


# ------------------------------------------------------------------ memory_per_rank


def memory_right(n_params, world_size, optimizer="adam", zero1=True):
    shard = -(-n_params // world_size) if zero1 else n_params
    states = {"adam": 2, "sgd-momentum": 1}[optimizer]
    return {"params": 4 * n_params, "grads": 4 * n_params, "optimizer_state": 4 * states * shard}


def memory_with_step_counter(n_params, world_size, optimizer="adam", zero1=True):
    got = memory_right(n_params, world_size, optimizer, zero1)
    got["optimizer_state"] += 4 if optimizer == "adam" else 0  # as the measured table counts
    return got


def test_memory_check_passes_right_answers_and_agrees_with_the_measurement():
    assert ok.grading.check_memory_per_rank(memory_right).all_passed
    assert ok.grading.check_memory_per_rank(memory_with_step_counter).all_passed
    for n_params, world, optimizer, zero1 in MEMORY_CASES:
        assert memory_right(n_params, world, optimizer, zero1) == memory_reference(
            n_params, world, optimizer, zero1
        )


def _mistake(change):
    def memory_per_rank(n_params, world_size, optimizer="adam", zero1=True):
        return change(memory_right(n_params, world_size, optimizer, zero1), n_params,
                      world_size, optimizer, zero1)  # fmt: skip

    return memory_per_rank


def _elements(got, n, N, opt, zero1):
    return {k: v // 4 for k, v in got.items()}


def _one_adam_state(got, n, N, opt, zero1):
    got["optimizer_state"] //= 2 if opt == "adam" else 1
    return got


def _two_sgd_states(got, n, N, opt, zero1):
    got["optimizer_state"] *= 2 if opt == "sgd-momentum" else 1
    return got


def _params_sharded(got, n, N, opt, zero1):
    if zero1:
        got["params"] = got["grads"] = 4 * -(-n // N)
    return got


def _state_not_sharded(got, n, N, opt, zero1):
    got["optimizer_state"] = 4 * {"adam": 2, "sgd-momentum": 1}[opt] * n
    return got


def _ddp_sharded(got, n, N, opt, zero1):
    got["optimizer_state"] = 4 * {"adam": 2, "sgd-momentum": 1}[opt] * -(-n // N)
    return got


def _floor(got, n, N, opt, zero1):
    got["optimizer_state"] = 4 * {"adam": 2, "sgd-momentum": 1}[opt] * (n // N if zero1 else n)
    return got


def _fraction(got, n, N, opt, zero1):
    got["optimizer_state"] = 4 * {"adam": 2, "sgd-momentum": 1}[opt] * (n / N if zero1 else n)
    return got


MEMORY_MISTAKES = {
    _elements: "That is a count of values, not bytes: each fp32 value takes 4 bytes.",
    _one_adam_state: "Adam keeps two values per parameter, exp_avg and exp_avg_sq",
    _two_sgd_states: "SGD with momentum keeps one buffer per parameter (momentum_buffer)",
    _params_sharded: "ZeRO-1 shards only the optimizer state: every rank keeps all parameters",
    _state_not_sharded: "That is the whole state, every rank's under plain data parallelism",
    _ddp_sharded: "Plain data parallelism (zero1=False) shards nothing",
    _floor: "The shard is padded: n = ",
    _fraction: "ranks is not a multiple of N, so every rank's shard holds ceil(n/N) = ",
}


@pytest.mark.parametrize("change", list(MEMORY_MISTAKES), ids=lambda f: f.__name__.strip("_"))
def test_memory_check_names_each_mistake(change):
    report = ok.grading.check_memory_per_rank(_mistake(change))
    failed = [m for passed, m in report.cases if not passed]
    assert failed, report.cases
    assert all(MEMORY_MISTAKES[change] in m for m in failed), failed


class EqualToAnything(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


def test_memory_check_refuses_numbers_equal_to_anything():
    report = ok.grading.check_memory_per_rank(
        lambda n, N, opt, zero1: {
            k: EqualToAnything(0) for k in ("params", "grads", "optimizer_state")
        }
    )
    assert report.passed == 0 and report.total > 0
    # it runs on a rank of its own, whose value comes back as plain data only
    assert "<lambda>() returned a value that cannot be read" in report.cases[0][1]
    assert "EqualToAnything: return plain data" in report.cases[0][1]


def test_memory_check_refuses_a_non_dict_and_an_unfinished_function():
    report = ok.grading.check_memory_per_rank(lambda n, N, opt, zero1: 4 * n)
    assert not report.cases[0][0] and "return a dict with the keys" in report.cases[0][1]

    def unfinished(n, N, opt, zero1):
        raise NotImplementedError

    report = ok.grading.check_memory_per_rank(unfinished)
    assert "not implemented yet" in report.cases[0][1]
    # the cases after it are not reached, and count as failed
    assert report.total == 6 and report.passed == 0, report.cases
    assert all(m.endswith("not reached: the check stops at its first failure (above)")
               for _, m in report.cases[1:])  # fmt: skip


def test_a_float_shard_is_told_to_round_up_not_that_it_dropped_the_remainder():
    """n / N (a float) was told "n // N drops the remainder", a mistake it did not make."""
    fraction = [m for p, m in ok.grading.check_memory_per_rank(_mistake(_fraction)).cases if not p]
    floor = [m for p, m in ok.grading.check_memory_per_rank(_mistake(_floor)).cases if not p]
    assert fraction and all("drops the remainder" not in m for m in fraction), fraction
    assert all("(n / N = 437,333.33 is no whole number of values: round it up" in m
               for m in fraction if "1,312,000, 3," in m), fraction  # fmt: skip
    assert floor and all("(n // N = " in m and "drops the remainder)." in m for m in floor), floor
