"""Lab 09's check: the solutions pass; typical mistakes (what is averaged, and when) are
named."""

import pytest
import torch

import overlapkit as ok


def average_parameters(model):
    with torch.no_grad():
        for p in model.parameters():
            ok.ring_all_reduce(p.data, op="avg")


def summed(model):
    with torch.no_grad():
        for p in model.parameters():
            ok.ring_all_reduce(p.data)


def averaged_grads(model):
    for p in model.parameters():
        ok.ring_all_reduce(p.grad, op="avg")


def first_only(model):
    with torch.no_grad():
        ok.ring_all_reduce(next(iter(model.parameters())).data, op="avg")


def builtin(model):
    with torch.no_grad():
        for p in model.parameters():
            torch.distributed.all_reduce(p.data)
            p.data /= ok.world_size()


def new_parameters(model):
    for module in model.children():
        for name, p in list(module.named_parameters(recurse=False)):
            mean = p.detach().clone()
            ok.ring_all_reduce(mean, op="avg")
            setattr(module, name, torch.nn.Parameter(mean))


def whole_state_dict(model):
    for value in model.state_dict().values():
        if value.is_floating_point():
            ok.ring_all_reduce(value, op="avg")


def async_under_no_grad(model):
    with torch.no_grad():
        handles = [ok.ring_all_reduce(p, op="avg", async_op=True) for p in model.parameters()]
        for handle in handles:
            handle.wait()


def skip_first(model):
    with torch.no_grad():
        for p in list(model.parameters())[1:]:
            ok.ring_all_reduce(p.data, op="avg")


def without_no_grad(model):
    for p in model.parameters():
        ok.ring_all_reduce(p, op="sum")
        p.div_(ok.world_size())


def copy_without_no_grad(model):
    for p in model.parameters():
        mean = p.detach().clone()
        ok.ring_all_reduce(mean, op="avg")
        p.copy_(mean)


def collective_alone(model):
    """No torch.no_grad(): the collective writes into the parameter outside autograd."""
    for p in model.parameters():
        ok.ring_all_reduce(p, op="avg")


def on_data_without_no_grad(model):
    for p in model.parameters():
        ok.ring_all_reduce(p.data, op="sum")
        p.data /= ok.world_size()


def divided_by_two(model):
    """The world size written as a number: right on 2 ranks only."""
    with torch.no_grad():
        for p in model.parameters():
            ok.ring_all_reduce(p)
            p /= 2


def divided_by_three(model):
    with torch.no_grad():
        for p in model.parameters():
            ok.ring_all_reduce(p)
            p /= 3


def averaged_then_divided(model):
    with torch.no_grad():
        for p in model.parameters():
            ok.ring_all_reduce(p, op="avg")
            p /= ok.world_size()


def async_never_waited(model):
    for p in model.parameters():
        ok.ring_all_reduce(p, op="avg", async_op=True)


def async_last_waited(model):
    """Only the last handle waited: the others are still in the check's books."""
    handles = [ok.ring_all_reduce(p, op="avg", async_op=True) for p in model.parameters()]
    handles[-1].wait()


def read_before_wait(model):
    with torch.no_grad():
        for p in model.parameters():
            mean = p.detach().clone()
            handle = ok.ring_all_reduce(mean, op="avg", async_op=True)
            p.copy_(mean)  # the mean is not there yet
            handle.wait()


def averaged_a_clone(model):
    for p in model.parameters():
        mean = p.detach().clone()
        ok.ring_all_reduce(mean, op="avg")  # never copied back


def only_rank_zero(model):
    if ok.rank() == 0:
        collective_alone(model)


def averaged_and_cleared_the_grads(model):
    """The parameters averaged right, then the gradients cleared (not the average's business)."""
    average_parameters(model)
    model.zero_grad()


def averaged_params_and_grads(model):
    average_parameters(model)
    for p in model.parameters():
        ok.ring_all_reduce(p.grad, op="avg")


def one_flat_vector(model):
    flat = torch.nn.utils.parameters_to_vector(model.parameters())
    ok.ring_all_reduce(flat, op="avg")
    torch.nn.utils.vector_to_parameters(flat, model.parameters())


@pytest.mark.parametrize(
    "fn",
    [
        average_parameters,
        async_under_no_grad,
        collective_alone,
        on_data_without_no_grad,
        one_flat_vector,
    ],
    ids=lambda f: f.__name__,
)
def test_the_average_parameters_solutions_pass(fn):
    """Also asynchronously inside torch.no_grad(), whose grad mode the kit's worker
    thread does not share: collectives run outside autograd, as the built-ins do; and
    without torch.no_grad() where nothing of the learner's changes a parameter in place
    through autograd (the prose says so)."""
    report = ok.grading.check_average_parameters(fn)
    assert report.all_passed, report.cases


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        (summed, "that is the sum over the 2 ranks"),
        (
            averaged_grads,
            (
                "unchanged, while its .grad changed: average the parameters themselves (not their "
                ".grad)"
            ),
        ),
        (
            averaged_a_clone,
            (
                "unchanged: the average must land in the parameters themselves "
                "(in place, or copied back)"
            ),
        ),
        (
            divided_by_two,
            "that is the sum divided by 2 with N = 3 ranks: divide by ok.world_size()",
        ),
        (
            divided_by_three,
            "that is the sum divided by 3 with N = 2 ranks: divide by ok.world_size()",
        ),
        (
            averaged_then_divided,
            "that is the mean divided by 2 once more: op='avg' already divides",
        ),
        (async_never_waited, "rank 0 never waited for 5 operation(s)"),
        (
            async_never_waited,
            (
                "is NaN (the check poisons a tensor while an operation on it is in flight): call "
                ".wait() on every handle"
            ),
        ),
        (async_last_waited, "rank 0 never waited for 4 operation(s)"),
        (
            read_before_wait,
            (
                "got nan — NaN: the check poisons a tensor while an operation on it is in "
                "flight, so this was read before that operation's wait()"
            ),
        ),
        (
            only_rank_zero,
            (
                "rank 0 raised RuntimeError: its ok.ring_all_reduce #1 can never finish: rank 1 "
                "returned from average_parameters having called ok.ring_all_reduce 0 time(s). A "
                "collective completes only when every rank calls it: every rank averages"
            ),
        ),
        (first_only, "this one is not: is every parameter averaged?"),
        (builtin, "called torch.distributed.all_reduce"),
        (new_parameters, "new parameter objects: the optimizer still holds the old ones"),
        (whole_state_dict, "running_mean changed"),
        (averaged_and_cleared_the_grads, "was cleared: leave the gradients as they are"),
        (averaged_params_and_grads, "changed: local SGD averages the parameters, not the grad"),
        (skip_first, "'0.bias' is averaged, this one is not: is every parameter averaged?"),
        (without_no_grad, "your own in-place change of a parameter (p /= …, p.copy_(…))"),
        (copy_without_no_grad, "make that change under torch.no_grad() (or on p.data)"),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_average_parameters_mistakes_are_named(fn, words):
    report = ok.grading.check_average_parameters(fn)
    assert not report.all_passed
    assert words in "\n".join(m for _, m in report.cases)


# --------------------------------------------------------------------------- local SGD


def _loss_backward(model, batch):
    x, y = batch
    torch.nn.functional.mse_loss(model(x), y).backward()


def local_sgd_step(model, optimizer, batch, step, k):
    optimizer.zero_grad()
    _loss_backward(model, batch)
    optimizer.step()
    if step % k == 0:
        average_parameters(model)


def local_sgd_manual_update(model, optimizer, batch, step, k):
    """The update written out (the optimizer's learning rate), the mean via p.data."""
    model.zero_grad()
    _loss_backward(model, batch)
    with torch.no_grad():
        for p in model.parameters():
            p -= optimizer.param_groups[0]["lr"] * p.grad
    if step % k == 0:
        collective_alone(model)


def averaged_every_step(model, optimizer, batch, step, k):
    optimizer.zero_grad()
    _loss_backward(model, batch)
    optimizer.step()
    average_parameters(model)


def steps_counted_from_zero(model, optimizer, batch, step, k):
    optimizer.zero_grad()
    _loss_backward(model, batch)
    optimizer.step()
    if (step + 1) % k == 0:
        average_parameters(model)


def averaged_before_the_update(model, optimizer, batch, step, k):
    optimizer.zero_grad()
    _loss_backward(model, batch)
    if step % k == 0:
        average_parameters(model)
    optimizer.step()


def averaged_at_the_next_step(model, optimizer, batch, step, k):
    if step > 1 and (step - 1) % k == 0:
        average_parameters(model)
    optimizer.zero_grad()
    _loss_backward(model, batch)
    optimizer.step()


def averaged_gradients(model, optimizer, batch, step, k):
    optimizer.zero_grad()
    _loss_backward(model, batch)
    if step % k == 0:
        for p in model.parameters():
            ok.ring_all_reduce(p.grad, op="avg")
    optimizer.step()


def gradients_never_cleared(model, optimizer, batch, step, k):
    _loss_backward(model, batch)
    optimizer.step()
    if step % k == 0:
        average_parameters(model)


def never_averaged(model, optimizer, batch, step, k):
    optimizer.zero_grad()
    _loss_backward(model, batch)
    optimizer.step()


def fixed_period(model, optimizer, batch, step, k):
    """k written as the number the lab's text happened to show."""
    optimizer.zero_grad()
    _loss_backward(model, batch)
    optimizer.step()
    if step % 3 == 0:
        average_parameters(model)


def fixed_period_two(model, optimizer, batch, step, k):
    optimizer.zero_grad()
    _loss_backward(model, batch)
    optimizer.step()
    if step % 2 == 0:
        average_parameters(model)


def gradients_every_step(model, optimizer, batch, step, k):
    """The DDP habit: the gradients all-reduced every step, before the update."""
    optimizer.zero_grad()
    _loss_backward(model, batch)
    averaged_grads(model)
    optimizer.step()


def gradients_every_step_and_parameters(model, optimizer, batch, step, k):
    gradients_every_step(model, optimizer, batch, step, k)
    if step % k == 0:
        average_parameters(model)


def flat_gradients_every_step(model, optimizer, batch, step, k):
    """The gradients all-reduced as one flat copy, written back."""
    optimizer.zero_grad()
    _loss_backward(model, batch)
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    ok.ring_all_reduce(flat, op="avg")
    torch.nn.utils.vector_to_parameters(flat, grads)
    optimizer.step()


def summed_loss(model, optimizer, batch, step, k):
    x, y = batch
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y, reduction="sum").backward()
    optimizer.step()
    if step % k == 0:
        average_parameters(model)


def half_the_loss(model, optimizer, batch, step, k):
    x, y = batch
    optimizer.zero_grad()
    (0.5 * torch.nn.functional.mse_loss(model(x), y)).backward()
    optimizer.step()
    if step % k == 0:
        average_parameters(model)


def only_rank_zero_averages(model, optimizer, batch, step, k):
    optimizer.zero_grad()
    _loss_backward(model, batch)
    optimizer.step()
    if step % k == 0 and ok.rank() == 0:
        average_parameters(model)


def async_average_never_waited(model, optimizer, batch, step, k):
    optimizer.zero_grad()
    _loss_backward(model, batch)
    optimizer.step()
    if step % k == 0:
        async_never_waited(model)


@pytest.mark.parametrize("fn", [local_sgd_step, local_sgd_manual_update], ids=lambda f: f.__name__)
def test_the_local_sgd_step_solutions_pass(fn):
    report = ok.grading.check_average_parameters(average_parameters, fn)
    assert report.all_passed, report.cases
    assert report.total == 4


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        (averaged_every_step, "after step 1 every rank holds the same model: rank 0 averaged"),
        (steps_counted_from_zero, "after step 2 every rank holds the same model"),
        (averaged_before_the_update, "averaged before its update of step 3"),
        (averaged_at_the_next_step, "it averaged at the start of step 4, too late"),
        (averaged_gradients, "averaged the gradients at step 3"),
        (gradients_never_cleared, "clear them every step (optimizer.zero_grad())"),
        (never_averaged, "ran no AllReduce in step 3: with k = 3, average after steps 3, 6"),
        (
            fixed_period,
            (
                "averaged after steps 3, 6 — every 3 steps, with k = 2: average every k steps (the "
                "argument k), not a fixed number"
            ),
        ),
        (
            fixed_period_two,
            "averaged after steps 2, 4, 6 — every 2 steps, with k = 3: average every k steps",
        ),
        (
            gradients_every_step,
            "rank 0 all-reduced the gradients in every step, so every rank took the same update",
        ),
        (
            gradients_every_step,
            (
                "Local SGD communicates only after steps 3, 6, … (k = 3), and then averages the "
                "parameters"
            ),
        ),
        (gradients_every_step_and_parameters, "rank 0 all-reduced the gradients in every step"),
        (flat_gradients_every_step, "rank 0 all-reduced the gradients in every step"),
        (
            summed_loss,
            (
                "this step moved the parameters 6× as far as local SGD's, and the batch has 6 "
                "targets — the loss summed the squared errors; use their mean"
            ),
        ),
        (
            half_the_loss,
            "this step moved the parameters 0.5× as far as local SGD's, in the same direction",
        ),
        (
            only_rank_zero_averages,
            (
                "its ok.ring_all_reduce #1 (in step 3) can never finish: rank 1 finished all 7 "
                "steps having called ok.ring_all_reduce 0 time(s)"
            ),
        ),
        (
            async_average_never_waited,
            "in an earlier operation that was not waited yet: wait() for it",
        ),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_local_sgd_step_mistakes_are_named(fn, words):
    report = ok.grading.check_average_parameters(average_parameters, fn)
    assert not report.all_passed
    assert words in "\n".join(m for _, m in report.cases), report.cases


def test_local_sgd_step_is_not_checked_on_a_wrong_average():
    """The check stops at its first failure; the cases after it count as not passed, so
    the score reads out of every case (0/4 here, not 0/1)."""
    report = ok.grading.check_average_parameters(summed, local_sgd_step)
    assert (report.passed, report.total) == (0, 4)
    later = [m for _, m in report.cases if "local_sgd_step" in m]
    assert len(later) == 2
    assert all("not reached: the check stops at its first failure" in m for m in later)


def builtin_through_c10d(model):
    import torch.distributed.distributed_c10d as c10d  # noqa: PLC0415

    with torch.no_grad():
        for p in model.parameters():
            c10d.all_reduce(p.data)
            p.data /= ok.world_size()


def builtin_through_the_group(model):
    import torch.distributed.distributed_c10d as c10d  # noqa: PLC0415

    group = c10d._get_default_group()
    with torch.no_grad():
        for p in model.parameters():
            group.allreduce([p.data]).wait()
            p.data /= ok.world_size()


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        (builtin_through_c10d, "called torch.distributed.distributed_c10d.all_reduce"),
        (builtin_through_the_group, "ProcessGroup.allreduce (called on a process group directly)"),
    ],
    ids=["distributed_c10d.all_reduce", "the group's own allreduce"],
)
def test_a_builtin_collective_by_another_door_is_refused(fn, words):
    report = ok.grading.check_average_parameters(fn)
    assert not report.all_passed
    assert words in "\n".join(m for _, m in report.cases), report.cases
