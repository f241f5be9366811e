"""The MoE layer equals one device; the pipelined layer equals the unpipelined one."""

import pytest
import torch

import overlapkit as ok
from overlapkit.moe import MoELayer, make_moe, reference_moe

D = 6


def _tokens(rank, n):
    return torch.randn(n, D, generator=torch.Generator().manual_seed(100 + rank))


def _moe_on_ranks(chunks, counts, skew, local_first=False):
    """Every rank's tokens through the kit's layer, and through the one-device reference
    on the same tokens; returns the differences and this rank's router gradient."""
    me, world = ok.rank(), ok.world_size()
    router, experts = make_moe(D, 10, world, seed=3)
    if skew:  # every token to expert 0: the others get none
        with torch.no_grad():
            router.bias.copy_(torch.tensor([50.0] + [0.0] * (world - 1)))
    # one device: every rank's tokens, the sum of every rank's loss
    xs = [_tokens(r, counts[r]).requires_grad_(True) for r in range(world)]
    total = sum((reference_moe(x, router, experts) ** 2).sum() for x in xs)
    total.backward()
    # the kit
    layer = MoELayer(router, experts, chunks=chunks, local_first=local_first)
    x = _tokens(me, counts[me]).requires_grad_(True)
    y = layer(x)
    (y**2).sum().backward()

    def diff(a, b):
        a = torch.zeros(()) if a is None else a
        b = torch.zeros(()) if b is None else b
        return (a - b).abs().max().item()

    want = reference_moe(xs[me].detach(), router, experts).detach()
    mine, ref = layer.expert.parameters(), experts[me].parameters()
    return {
        "output": diff(y, want),
        "input grad": diff(x.grad, xs[me].grad),
        "expert grad": max(diff(a.grad, b.grad) for a, b in zip(mine, ref, strict=True)),
        "router grad": [p.grad.clone() for p in layer.router.parameters()],
        "router grad (one device)": [p.grad.clone() for p in router.parameters()],
        "tokens in": int(
            torch.bincount(torch.softmax(router(x), -1).argmax(-1), minlength=world)[me]
        ),
    }


def _check(results):
    for rank, r in enumerate(results):
        for what in ("output", "input grad", "expert grad"):
            assert r[what] < 1e-5, f"rank {rank}, {what}: {r[what]}"
    # each rank's router gradient comes from its own tokens: they add up to one device's
    summed = [sum(r["router grad"][i] for r in results) for i in range(2)]
    for got, want in zip(summed, results[0]["router grad (one device)"], strict=True):
        assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("world", [2, 3])
def test_the_moe_layer_equals_one_device_outputs_and_gradients(world):
    _check(ok.launch(_moe_on_ranks, 1, [8] * world, False, world_size=world, timeout=60))


@pytest.mark.parametrize(("world", "chunks"), [(2, 2), (2, 5), (3, 3)])
def test_the_pipelined_moe_equals_the_unpipelined_layer_with_uneven_tokens(world, chunks):
    """Ranks hold different token counts (7, 8, 9), chunks do not divide them."""
    counts = [7 + r for r in range(world)]
    link = ok.Link(20, 5)
    _check(ok.launch(_moe_on_ranks, chunks, counts, False, world_size=world, link=link))


@pytest.mark.parametrize(("world", "chunks"), [(2, 1), (2, 5), (3, 3)])
def test_local_first_equals_one_device_outputs_and_gradients(world, chunks):
    """The own expert's tokens computed first, the others' dispatched in every chunk."""
    counts = [7 + r for r in range(world)]
    link = ok.Link(20, 5)
    _check(ok.launch(_moe_on_ranks, chunks, counts, False, True, world_size=world, link=link))


@pytest.mark.parametrize("local_first", [False, True])
def test_an_expert_that_gets_no_tokens_still_runs_its_chunks(local_first):
    results = ok.launch(_moe_on_ranks, 3, [6, 6], True, local_first, world_size=2, timeout=60)
    _check(results)
    assert results[1]["expert grad"] == 0


def _local_first_spans(local_first):
    me, world = ok.rank(), ok.world_size()
    router, experts = make_moe(D, 10, world, seed=3)
    tl = ok.Timeline()
    x = _tokens(me, 40)
    with torch.no_grad():
        layer = MoELayer(router, experts, chunks=4, timeline=tl, local_first=local_first)
        layer(x)
    expert = torch.softmax(router(x), -1).argmax(-1)
    spans = {s.name: s for s in tl.spans}
    return {
        "names": list(spans),
        "own": int((expert == me).sum()),
        "sent": layer.tokens_sent,
        "local starts": spans.get("expert local", spans["route"]).start,
        "dispatches issued": max(spans[f"dispatch {c}"].start for c in range(4)),
    }


def test_local_first_issues_every_dispatch_before_computing_the_own_tokens():
    for r in ok.launch(_local_first_spans, True, world_size=2, timeout=60):
        assert "expert local" in r["names"] and r["own"] + r["sent"] == 40
        assert r["dispatches issued"] <= r["local starts"]
    for r in ok.launch(_local_first_spans, False, world_size=2, timeout=60):
        assert "expert local" not in r["names"] and r["own"] + r["sent"] == 40


def _bad_moe(case):
    me = ok.rank()
    router, experts = make_moe(D, 10, 2)
    if case == "experts":
        return MoELayer(router, experts + experts)
    if case == "schedules differ":
        return MoELayer(router, experts, chunks=2, local_first=me == 0)(_tokens(me, 8))
    chunks = {"too many chunks": 9, "chunks differ": 2 + me}[case]
    return MoELayer(router, experts, chunks=chunks)(_tokens(me, 8))


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("too many chunks", "rank 0: chunks=9 must be an integer from 1 to the 8 tokens"),
        ("chunks differ", "MoELayer runs with chunks=2 here, but the ranks disagree"),
        ("experts", "one expert per rank: got 4 experts for 2 ranks"),
        (
            "schedules differ",
            r"MoELayer runs with local_first=(True|False) here, but rank [01] runs local_first=",
        ),
    ],
)
def test_the_moe_layer_refuses_bad_input_naming_rank_and_sizes(case, words):
    with pytest.raises(ValueError, match=words) as info:
        ok.launch(_bad_moe, case, world_size=2, timeout=30)
    print(info.value)


def _moe_on_a_gpu():
    me, world = ok.rank(), ok.world_size()
    device = ok.device() if ok.device().type == "cuda" else torch.device("cuda", 0)
    router, experts = make_moe(D, 10, world, seed=3)
    layer = MoELayer(router, experts, chunks=2, local_first=True).to(device)
    x = _tokens(me, 7)
    got = layer(x.to(device))
    return (got.cpu() - reference_moe(x, router, experts)).abs().max().item()


@pytest.mark.gpu
def test_on_a_gpu_the_moe_layer_keeps_its_bookkeeping_on_the_tokens_device():
    """Split sizes, arange and full are made on the tokens' device: made on the CPU, they
    would meet the router's choices on the GPU (a device mismatch)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    assert all(d < 1e-4 for d in ok.launch(_moe_on_a_gpu, world_size=2, timeout=120))
