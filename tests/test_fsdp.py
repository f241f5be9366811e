"""ok.FullyShardedDP (ZeRO-3): one process's training, 1/N of the parameters, prefetch that
starts gathers early, and bad input named."""

from __future__ import annotations

import pytest
import torch

import overlapkit as ok

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")


class Head(torch.nn.Module):
    """Two outputs of one tied weight: a parameter used twice inside one unit."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(9, 3), torch.nn.Linear(9, 3)
        self.b.weight = self.a.weight

    def forward(self, h):
        return self.a(h) + self.b(h)


class Net(torch.nn.Module):
    """Units of awkward sizes (none divides by 2, 3 or 4 evenly every time), a frozen unit,
    a LayerNorm, a tied pair inside one unit, a parameter of the root, and a unit that runs
    only when asked (``skip``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # every rank builds the same model
        self.inp = torch.nn.Linear(5, 7)
        self.frozen = torch.nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.mid = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.LayerNorm(9))
        self.sometimes = torch.nn.Linear(9, 9)
        self.out = Head()
        self.scale = torch.nn.Parameter(torch.tensor(1.5))  # the root's own
        self.skip = False

    def forward(self, x):
        h = torch.tanh(self.frozen(torch.tanh(self.inp(x))))
        h = self.mid(h)
        if not self.skip:
            h = h + self.sometimes(h)
        return self.scale * self.out(h)


UNITS = ["inp", "frozen", "mid", "sometimes", "out"]


def _batch(step, world):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(4 * world, 5, generator=gen), torch.randn(4 * world, 3, generator=gen)


def _train(prefetch, collective, steps=10, skip_every=0, reshard=True, gpu=False):
    """The wrapper beside one process (on the CPU) that trains on the whole batch; the
    largest difference of any parameter after ``steps`` AdamW steps, and the memory counts.
    ``gpu``: the wrapped model on the GPU (both ranks share one over gloo, or each its own
    with NCCL)."""
    me, world = ok.rank(), ok.world_size()
    device = torch.device("cpu")
    if gpu:
        device = ok.device() if ok.device().type == "cuda" else torch.device("cuda", 0)
    model, alone = Net().to(device), Net()
    fsdp = ok.FullyShardedDP(model, units=UNITS, prefetch=prefetch, all_gather=collective,
                             reduce_scatter=collective, reshard_after_forward=reshard)  # fmt: skip
    opt = torch.optim.AdamW(fsdp.parameters(), lr=0.01, weight_decay=0.1)
    ref = torch.optim.AdamW([p for p in alone.parameters() if p.requires_grad], lr=0.01,
                            weight_decay=0.1)  # fmt: skip
    for step in range(steps):
        x, y = _batch(step, world)
        model.skip = alone.skip = bool(skip_every) and step % skip_every == 0
        mine = slice(4 * me, 4 * me + 4)
        loss = torch.nn.functional.mse_loss(fsdp(x[mine].to(device)), y[mine].to(device))
        loss.backward()
        fsdp.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(alone(x), y).backward()
        ref.step()
        ref.zero_grad()
    whole = fsdp.full_state_dict()
    gap = max((whole[k].cpu() - v).abs().max().item() for k, v in alone.state_dict().items())
    return gap, fsdp.memory(opt), [u.bytes for u in fsdp.units]


@pytest.mark.parametrize("world, prefetch, collective", [
    (2, "none", None), (2, "explicit", "ring"), (3, "explicit", "ring"), (3, "none", None),
    (3, "implicit", "ring"), (4, "explicit", None), (4, "none", "ring"),
])  # fmt: skip
def test_fully_sharded_training_equals_one_process_training_on_the_whole_batch(
    world, prefetch, collective
):
    for rank, (gap, _, _) in enumerate(ok.launch(_train, prefetch, collective,
                                                 world_size=world, timeout=120)):  # fmt: skip
        assert gap <= 1e-6, f"rank {rank}: a parameter differs by {gap:.3g} after 10 steps"


def test_a_forward_that_skips_a_prefetched_unit_neither_hangs_nor_keeps_it_whole():
    """'sometimes' is skipped every other step after explicit prefetch gathered it."""
    for rank, (gap, memory, _) in enumerate(ok.launch(_train, "explicit", "ring", 6, 2,
                                                      world_size=2, timeout=120)):  # fmt: skip
        assert gap <= 1e-6, f"rank {rank}: differs by {gap:.3g}"
        assert memory["peak_gathered"] > 0


def _held_after_a_step(prefetch, reshard, depth=1):
    model = Net()
    fsdp = ok.FullyShardedDP(model, units=UNITS, prefetch=prefetch,
                             reshard_after_forward=reshard, prefetch_depth=depth)  # fmt: skip
    x, y = _batch(0, ok.world_size())
    torch.nn.functional.mse_loss(fsdp(x), y).backward()
    fsdp.finish_gradient_synchronization()
    sizes = {u.name: u.bytes for u in fsdp.units}
    return fsdp.memory(), sizes, fsdp._held["gathered"]


@pytest.mark.parametrize("prefetch, reshard, depth, most", [
    ("none", True, 1, 2),  # the unit computing, and in backward the next one gathering
    ("explicit", True, 1, 2),
    ("explicit", True, 2, 3),
    ("none", False, 1, 5),  # nothing freed before backward: every unit whole at once
])  # fmt: skip
def test_whole_parameters_held_at_once_are_the_root_and_the_units_prefetch_allows(
    prefetch, reshard, depth, most
):
    memory, sizes, after = ok.launch(_held_after_a_step, prefetch, reshard, depth,
                                     world_size=2, timeout=60)[0]  # fmt: skip
    root = sizes.pop("(root)")
    largest = sorted(sizes.values(), reverse=True)
    assert memory["peak_gathered"] <= root + sum(largest[:most])
    assert memory["peak_gathered"] > root + sum(largest[: most - 1]) - 1 or most == 5
    assert after == 0, f"{after} bytes of whole parameters still held after the step"


def _overlap(prefetch):
    """Four 512×512 units over a link slow enough that a unit's AllGather takes about as
    long as its forward: when each AllGather started against when the forward before it
    ended."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    timeline = ok.Timeline()
    fsdp = ok.FullyShardedDP(model, prefetch=prefetch, all_gather="ring",
                             reduce_scatter="ring", timeline=timeline)  # fmt: skip
    x = torch.randn(64, 512)
    for _ in range(2):
        timeline.spans.clear()
        fsdp(x).square().mean().backward()
        fsdp.finish_gradient_synchronization()
    spans = {}
    for s in timeline.spans:  # the forward's: each unit is gathered again in backward
        spans.setdefault(s.name, s)
    return [(spans[f"AG {k}"].start, spans[f"F {k - 1}"].end) for k in range(1, 4)]


@pytest.mark.parametrize("prefetch", ["none", "explicit"])
def test_explicit_prefetch_starts_the_next_units_gather_before_this_forward_ends(prefetch):
    starts = ok.launch(_overlap, prefetch, world_size=2, timeout=120,
                       link=ok.Link(50, 1.0))[0]  # fmt: skip
    early = [start < previous_end for start, previous_end in starts]
    assert early == ([True] * 3 if prefetch == "explicit" else [False] * 3), starts


def _refused(case):
    model = Net()
    if case == "not a submodule":
        ok.FullyShardedDP(model, units=[torch.nn.Linear(2, 2)])
    elif case == "no such name":
        ok.FullyShardedDP(model, units=["inp", "middle"])
    elif case == "two units share a parameter":
        model.sometimes.weight = model.mid[0].weight = torch.nn.Parameter(torch.zeros(9, 9))
        ok.FullyShardedDP(model, units=["mid", "sometimes"])
    elif case == "units overlap":
        ok.FullyShardedDP(model, units=["mid", "mid.0"])
    elif case == "mixed dtypes":
        model.mid[1].double()
        ok.FullyShardedDP(model, units=["mid"])
    elif case == "the inner module called":
        fsdp = ok.FullyShardedDP(model, units=UNITS)
        fsdp.module(torch.randn(2, 5))
    elif case == "no finish":
        fsdp = ok.FullyShardedDP(model, units=UNITS)
        fsdp(torch.randn(2, 5)).sum().backward()
        fsdp(torch.randn(2, 5))
    elif case == "a container as a unit":
        model.mid = torch.nn.ModuleList(model.mid)
        ok.FullyShardedDP(model, units=["mid"])
    elif case == "bad prefetch":
        ok.FullyShardedDP(model, prefetch="eager")


@pytest.mark.parametrize("case, words", [
    ("not a submodule", "unit #0 (Linear) is not a submodule"),
    ("no such name", "unit #1 'middle' names no submodule"),
    ("two units share a parameter", "a parameter shared by two units"),
    ("units overlap", "units 'mid' and 'mid.0' overlap"),
    ("mixed dtypes", "unit 'mid' mixes dtypes"),
    ("the inner module called", "call the FullyShardedDP object"),
    ("no finish", "call finish_gradient_synchronization()"),
    ("a container as a unit", "unit 'mid' is a ModuleList, which is never called"),
    ("bad prefetch", "prefetch must be one of none, implicit, explicit"),
])  # fmt: skip
def test_bad_input_is_refused_with_what_was_wrong(case, words):
    with pytest.raises((ValueError, RuntimeError)) as info:
        ok.launch(_refused, case, world_size=2, timeout=60)
    assert words in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("collective", [None, "ring"])
def test_on_a_gpu_fully_sharded_training_equals_one_process(collective):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    results = ok.launch(_train, "explicit", collective, 5, 0, True, True, world_size=2,
                        timeout=180)  # fmt: skip
    for rank, (gap, memory, _) in enumerate(results):
        assert gap <= 1e-5, f"rank {rank}: differs by {gap:.3g}"
        assert memory["allocator_peak"] >= memory["shards"]


def _beside_fully_shard(steps=10):
    """The kit and torch's fully_shard (one per block, then the root; explicit forward
    prefetch on both) train the same blocks with AdamW: the largest parameter difference."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    def blocks():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(7, 7), torch.nn.Tanh())
                                     for _ in range(3)])  # fmt: skip

    theirs = blocks()
    mesh = init_device_mesh("cpu", (ok.world_size(),))
    for block in theirs:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    for block, after in zip(theirs, list(theirs)[1:], strict=False):
        block.set_modules_to_forward_prefetch([after])
    ours = ok.FullyShardedDP(blocks(), prefetch="explicit")
    optims = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (ours, theirs)]
    for step in range(steps):
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * step + ok.rank()))
        for model, opt in zip((ours, theirs), optims, strict=True):
            model(x).square().mean().backward()
            if model is ours:
                ours.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad()
    mine = ours.full_state_dict()
    return max((mine[k] - v.full_tensor()).abs().max().item()
               for k, v in theirs.state_dict().items())  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
def test_the_kit_trains_as_torch_fully_shard_does(world):
    gaps = ok.launch(_beside_fully_shard, world_size=world, timeout=120)
    assert max(gaps) <= 1e-6, gaps
