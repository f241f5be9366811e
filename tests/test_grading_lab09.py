"""Lab 09's check: the solution passes; typical mistakes are named."""

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


@pytest.mark.parametrize("fn", [average_parameters, async_under_no_grad])
def test_the_average_parameters_solutions_pass(fn):
    """Also asynchronously inside torch.no_grad(), whose grad mode the kit's worker
    thread does not share: collectives run outside autograd, as the built-ins do."""
    assert ok.grading.check_average_parameters(fn).all_passed


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        (summed, "that is the sum over the 2 ranks"),
        (averaged_grads, "not their .grad"),
        (first_only, "this one is not: is every parameter averaged?"),
        (builtin, "called torch.distributed.all_reduce"),
        (new_parameters, "new parameter objects: the optimizer still holds the old ones"),
        (whole_state_dict, "running_mean changed"),
        (skip_first, "'0.bias' is averaged, this one is not: is every parameter averaged?"),
        (without_no_grad, "do it under torch.no_grad()"),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_average_parameters_mistakes_are_named(fn, words):
    report = ok.grading.check_average_parameters(fn)
    assert not report.all_passed
    assert words in "\n".join(m for _, m in report.cases)
