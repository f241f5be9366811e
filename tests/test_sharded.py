"""ok.ShardedOptimizer (ZeRO-1): same results as the unsharded optimizer, 1/N of the state."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import overlapkit as ok

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")


def _model():
    torch.manual_seed(0)  # every rank builds the same model
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))


def _train_both(opt_name, steps=10):
    cls, kwargs = {
        "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}),
        "adam": (torch.optim.Adam, {"lr": 1e-2}),
        "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    }[opt_name]
    sharded_model, reference = _model(), _model()
    sharded = ok.ShardedOptimizer(sharded_model.parameters(), cls, **kwargs)
    plain = cls(reference.parameters(), **kwargs)
    gen = torch.Generator().manual_seed(100 + ok.rank())  # each rank its own data
    for _ in range(steps):
        x, y = torch.randn(8, 7, generator=gen), torch.randn(8, 5, generator=gen)
        for model in (sharded_model, reference):
            torch.nn.functional.mse_loss(model(x), y).backward()
        sharded.step()
        sharded.zero_grad()
        for p in reference.parameters():  # the unsharded baseline: average grads, then step
            dist.all_reduce(p.grad)
            p.grad /= ok.world_size()
        plain.step()
        plain.zero_grad()
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(sharded_model.parameters(), reference.parameters(), strict=True)
    )
    total_state = sum(t.numel() for s in plain.state.values() for t in s.values() if t.dim() > 0)
    return diff, sharded.state_bytes() // 4, total_state, sharded.memory_report()


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw"])
def test_sharded_optimizer_matches_the_unsharded_one_over_ten_steps(opt_name):
    world = (
        3  # 7*13+13+13*5+5 = 174 parameters: not a multiple of 3... padded to 174? it is: 58 each
    )
    for diff, shard_state, full_state, report in ok.launch(_train_both, opt_name, world_size=world):
        assert diff < 1e-5
        # each rank holds ~1/N of the state (the shard is padded to a multiple of N)
        assert shard_state <= -(-full_state // world) + 2 * world
        assert report["optimizer_state_bytes"] * world == report["unsharded_optimizer_state_bytes"]


def _uneven():
    model = torch.nn.Linear(5, 2)  # 12 parameters over 5 ranks: padded to 15
    torch.manual_seed(1)
    opt = ok.ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p) * (ok.rank() + 1)
    opt.step()
    return [
        (b - p.detach()).unique().tolist() for b, p in zip(before, model.parameters(), strict=True)
    ]


def test_parameter_count_not_divisible_by_world_size_is_padded():
    world = 5
    mean_grad = sum(range(1, world + 1)) / world
    for deltas in ok.launch(_uneven, world_size=world):
        assert deltas == [[mean_grad], [mean_grad]]


def test_mixed_dtypes_are_rejected_with_a_clear_error():
    def mixed():
        params = [
            torch.nn.Parameter(torch.zeros(2)),
            torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)),
        ]
        ok.ShardedOptimizer(params, torch.optim.SGD, lr=0.1)

    with pytest.raises(TypeError, match="must share one dtype and device"):
        ok.launch(mixed, world_size=2)
