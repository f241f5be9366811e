"""ok.compression: averages from fewer bytes, error feedback that loses nothing for good,
the kit wrappers and PyTorch's DDP driven by it, and PyTorch's own PowerSGD beside it."""

import pytest
import torch
import torch.distributed as dist

import overlapkit as ok
from overlapkit.compression import FromFunction, Half, PowerSGD, TopK, orthogonalize
from tests.test_ddp import torch_ddp_backward_error
from tests.test_grading_lab13 import topk_right

# ------------------------------------------------------------------ one process


def test_orthogonalize_gives_orthonormal_columns_spanning_the_same_space():
    m = torch.randn(50, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    before = m.clone()
    q = orthogonalize(m)
    assert q is m
    assert torch.allclose(q.T @ q, torch.eye(4, dtype=torch.float64), atol=1e-12)
    # the same column space: projecting the old columns onto the new ones changes nothing
    assert torch.allclose(q @ (q.T @ before), before, atol=1e-10)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: TopK(5), "0 < fraction ≤ 1"),
        (lambda: TopK(0), "0 < fraction ≤ 1"),
        (lambda: TopK(True), "0 < fraction ≤ 1"),
        (lambda: PowerSGD(rank=0), "rank must be a whole number ≥ 1"),
        (lambda: PowerSGD(rank=2, start_iter=1), "start_iter must be ≥ 2"),
        (lambda: Half(torch.float64), "torch.float16 or torch.bfloat16"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(make, says):
    with pytest.raises(ValueError, match=says):
        make()


def test_k_is_a_share_of_the_bucket_never_zero_never_more_than_all():
    assert TopK(0.01).k_of(1000) == 10
    assert TopK(0.01).k_of(10) == 1
    assert TopK(1.0).k_of(7) == 7


def test_powersgd_sends_a_matrix_low_rank_only_where_that_saves_the_rate():
    low, whole = PowerSGD(rank=4).splits(
        [torch.Size([64, 32]), torch.Size([64]), torch.Size([4, 4]), torch.Size([8, 3, 3])]
    )
    # 64×32: 4·(64+32)·2 = 768 < 2048; bias: 1-D; 4×4: r=4, 4·8·2 > 16; 8×9: 4·17·2 > 72
    assert (low, whole) == ([0], [1, 2, 3])


# ------------------------------------------------------------------ on ranks


def _grads(rank, numel, step=0):
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * rank + step))


def _one_bucket(compressor, numel=600, shapes=None, steps=1, exact_tail=0):
    """Every rank averages its own random buckets; returns what each got, its residual and
    the compressor's counts."""
    out = []
    for step in range(steps):
        flat = _grads(dist.get_rank(), numel, step)
        mine = flat.clone()
        compressor(flat, shapes=shapes, exact_tail=exact_tail).wait()
        out.append((mine, flat))
    residual = compressor.residuals.get(0, [None, None])[1]
    return out, residual, dict(compressor.stats)


def _averages(results, step=0):
    return torch.stack([r[0][step][0] for r in results]).mean(0)


def test_half_averages_within_its_rounding_from_half_the_bytes():
    results = ok.launch(_one_bucket, Half(), world_size=2, timeout=60)
    exact = _averages(results)
    for rank, (steps, _, stats) in enumerate(results):
        got = steps[0][1]
        assert torch.allclose(got, exact, atol=2e-3, rtol=2e-3), f"rank {rank}"
        assert not torch.equal(got, exact)  # it did go through 16 bits
        assert stats["bytes_sent"] == 600 * 2  # 2(N−1)/N · S/2 with N = 2, S = 2400 bytes


def test_topk_of_everything_is_the_exact_average():
    results = ok.launch(_one_bucket, TopK(1.0), world_size=3, timeout=60)
    exact = _averages(results)
    for steps, residual, _ in results:
        assert torch.allclose(steps[0][1], exact, atol=1e-6)
        assert torch.count_nonzero(residual) == 0


def test_topk_sends_each_ranks_largest_entries_and_keeps_the_rest_as_its_residual():
    results = ok.launch(_one_bucket, TopK(0.05), world_size=2, timeout=60)
    expected = torch.zeros(600)
    for steps, residual, stats in results:
        mine = steps[0][0]
        top = mine.abs().topk(30).indices
        sent = torch.zeros(600)
        sent[top] = mine[top]
        expected += sent / 2
        assert torch.equal(residual, mine - sent)  # what was not sent waits for next step
        assert stats["bytes_sent"] == 30 * (4 + 8)  # (N−1)·k values and int64 indices
    for steps, _, _ in results:
        assert torch.allclose(steps[0][1], expected, atol=1e-6)


def test_a_function_made_a_compressor_keeps_its_residual_and_matches_the_kits_top_k():
    """Lab 13's adapter: the learner's top-k, step after step, gives TopK's averages."""
    theirs = ok.launch(_one_bucket, TopK(0.05), 600, None, 3, world_size=2, timeout=60)
    mine = ok.launch(_one_bucket, FromFunction(topk_right, 0.05), 600, None, 3,
                     world_size=2, timeout=60)  # fmt: skip
    for a, b in zip(theirs, mine, strict=True):
        for t in range(3):
            assert torch.allclose(a[0][t][1], b[0][t][1], atol=1e-6)
        assert torch.allclose(a[1], b[1], atol=1e-6)  # the residual it keeps
    with pytest.raises(TypeError, match="must return the new residual"):
        ok.launch(_one_bucket, FromFunction(lambda f, r, x: None, 0.05), world_size=2,
                  timeout=60)  # fmt: skip


def test_with_error_feedback_top_k_loses_nothing_for_good():
    """Over steps, what was applied plus what the ranks still hold is all that was sent in."""
    steps = 6
    results = ok.launch(_one_bucket, TopK(0.02), 600, None, steps, world_size=2, timeout=60)
    applied = sum(results[0][0][t][1] for t in range(steps))
    grads = sum(_averages(results, t) for t in range(steps))
    held = torch.stack([r[1] for r in results]).mean(0)
    assert torch.allclose(applied + held, grads, atol=1e-5)
    without = ok.launch(_one_bucket, TopK(0.02, error_feedback=False), 600, None, steps,
                        world_size=2, timeout=60)  # fmt: skip
    lost = grads - sum(without[0][0][t][1] for t in range(steps))
    assert lost.abs().max() > 0.5  # without it, most of every gradient is gone for good


def test_powersgd_at_full_rank_is_the_exact_average_and_at_low_rank_sends_less():
    shapes = [torch.Size([20, 10]), torch.Size([10])]  # 210 elements
    full = ok.launch(_one_bucket, PowerSGD(rank=10, start_iter=2, min_compression_rate=0.1),
                     210, shapes, 3, world_size=2, timeout=60)  # fmt: skip
    for t in range(3):  # steps 0-1 plain AllReduce, then PowerSGD
        exact = _averages(full, t)
        for steps, _, _ in full:
            assert torch.allclose(steps[t][1], exact, atol=1e-5), f"step {t}"
    low = ok.launch(_one_bucket, PowerSGD(rank=1, start_iter=2), 210, shapes, 3,
                    world_size=2, timeout=60)  # fmt: skip
    stats = low[0][2]
    # two plain steps (210 each), then P (20) + Q (10) + the bias (10)
    assert stats["elements_sent"] == 2 * 210 + 40
    exact = _averages(low, 2)
    assert not torch.allclose(low[0][0][2][1], exact, atol=1e-3)  # rank 1 is an approximation
    assert torch.equal(low[0][0][2][1], low[1][0][2][1])  # ... the same on every rank


def test_the_exact_tail_is_averaged_exactly_under_any_compressor():
    results = ok.launch(_one_bucket, TopK(0.01), 610, None, 1, 10, world_size=2, timeout=60)
    exact = _averages(results)
    for steps, _, _ in results:
        assert torch.allclose(steps[0][1][-10:], exact[-10:], atol=1e-6)


def _train_with(all_reduce, steps=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = ok.BucketedDDP(model, all_reduce=all_reduce, bucket_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        ddp(x).square().mean().backward()
        ddp.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_a_kit_wrapper_takes_a_compressor_as_its_all_reduce():
    plain = ok.launch(_train_with, "ring", world_size=2, timeout=60)
    everything = ok.launch(_train_with, TopK(1.0), world_size=2, timeout=60)
    for a, b in zip(plain[0], everything[0], strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    low = ok.launch(_train_with, PowerSGD(rank=1), world_size=2, timeout=60)
    for a, b in zip(low[0], low[1], strict=True):
        assert torch.equal(a, b)  # the replicas agree
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(plain[0], low[0], strict=True))


def _beside_torchs_powersgd(steps=12, rank=2):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    def train(hook, state):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 1))  # fmt: skip
        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(dist.get_rank())
        w = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
        losses = []
        for _ in range(steps):
            x = torch.randn(16, 32, generator=gen)
            loss = (ddp(x) - x @ w).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    state = psgd.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
    theirs = train(psgd.powerSGD_hook, state)
    kit = PowerSGD(rank=rank, start_iter=2)
    ours = train(ok.ddp_comm_hook(compress=kit), None)
    # PyTorch counts from its first PowerSGD step; the kit counts its 2 plain ones too
    numel = sum(p.numel() for p in torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(
        64, 64), torch.nn.Linear(64, 1)).parameters())  # fmt: skip
    return theirs, ours, state.total_numel_after_compression, kit.stats["elements_sent"] - 2 * numel


def test_the_kits_powersgd_hook_follows_torchs_step_by_step_from_the_same_bytes():
    for theirs, ours, their_numel, our_numel in ok.launch(_beside_torchs_powersgd,
                                                          world_size=2, timeout=120):  # fmt: skip
        assert our_numel == their_numel
        # the same first Q as PyTorch draws, the same algorithm: the same losses but for the
        # order of float additions (the contract asks within 5%)
        for step, (a, b) in enumerate(zip(theirs, ours, strict=True)):
            assert abs(a - b) <= 1e-3 * a, (step, theirs, ours)
        assert ours[-1] < 0.8 * ours[0]  # and it trains


def test_a_bucket_that_is_not_flat_or_whose_shapes_do_not_add_up_is_refused():
    with pytest.raises(TypeError, match="flat .1-D. floating-point gradient bucket"):
        TopK(0.1)(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="holds 10 elements .* add up to 12"):
        PowerSGD()(torch.zeros(10), shapes=[(3, 4)])


# ------------------------------------------------------------------ the cost model


def test_compression_pays_below_the_bandwidth_where_the_two_times_cross():
    shapes = [(1000, 1000)]
    pays = ok.costmodel.compression_pays_below("topk", shapes, 2, 100e-6, 5e-3, fraction=0.01)
    assert pays == pytest.approx((4e6 - 10_000 * 12) / 5e-3 / 1e9)
    for gbps, wins in ((0.5 * pays, True), (2 * pays, False)):
        beta = 1 / (gbps * 1e9)
        plain = ok.costmodel.compressed_all_reduce("none", shapes, 2, 100e-6, beta)["time"]
        small = ok.costmodel.compressed_all_reduce("topk", shapes, 2, 100e-6, beta, 5e-3,
                                                   fraction=0.01)["time"]  # fmt: skip
        assert (small < plain) == wins
    # no fewer bytes: never; no extra latency or compute: always
    assert ok.costmodel.compression_pays_below("topk", [(10,)], 2, 1e-4, fraction=1.0) == 0
    assert ok.costmodel.compression_pays_below("half", shapes, 2, 1e-4) == float("inf")


def _bytes_of(compressor, shapes, steps):
    numel = sum(torch.Size(s).numel() for s in shapes)
    _one_bucket(compressor, numel, shapes, steps)
    return compressor.stats["bytes_sent"]


@pytest.mark.parametrize("world", [2, 3])
def test_the_model_counts_the_bytes_each_compressor_sent(world):
    shapes = [(40, 30), (30,), (30, 7)]
    model = ok.costmodel.compressed_all_reduce
    cases = [
        (Half(), "half", {}, 1),
        (TopK(0.05), "topk", {"fraction": 0.05}, 1),
        (PowerSGD(rank=3, start_iter=2), "powersgd", {"rank": 3}, 3),  # 2 plain steps first
    ]
    for compressor, kind, settings, steps in cases:
        sent = ok.launch(_bytes_of, compressor, shapes, steps, world_size=world, timeout=60)
        expected = model(kind, shapes, world, 0, 0, **settings)["bytes"]
        if kind == "powersgd":
            expected += 2 * model("none", shapes, world, 0, 0)["bytes"]
        assert sent == [pytest.approx(expected, abs=world)] * world, kind


class _Failing(TopK):
    def _compressed_average(self, body, group, world, key, shapes):
        raise ValueError("this compressor fails on purpose")


def test_a_compressor_that_fails_inside_torchs_ddp_fails_its_backward_with_the_reason():
    told = ok.launch(torch_ddp_backward_error, compress=_Failing(0.5), world_size=2, timeout=60)
    for said in told:
        assert "this compressor fails on purpose" in said


# --------------------------------------------------- lab 13 where a GPU exists


def _lab13_beside_torch():
    """The solution notebook's ``beside_torch``, defined as its cell defines it."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "solutions" / "13_compression.ipynb"
    nb = json.loads(path.read_text(encoding="utf-8"))
    (cell,) = (
        "".join(c["source"]) for c in nb["cells"] if "def beside_torch" in "".join(c["source"])
    )
    definition = cell[: cell.index("\npairs = ")]
    where = {"ok": ok, "torch": torch, "Half": Half, "PowerSGD": PowerSGD}
    exec(compile(definition, "13_compression.ipynb", "exec"), where)
    return where["beside_torch"]


def _beside_torch_where_cuda_is_reported(beside_torch):
    # the rank's buckets stay on the CPU while torch reports a GPU: a GPU box with more
    # ranks than GPUs, where PyTorch's powerSGD_hook calls torch.cuda.synchronize(cpu)
    torch.cuda.is_available = lambda: True
    return beside_torch(steps=4)


def test_lab13_compares_with_pytorchs_powersgd_on_cpu_ranks_of_a_gpu_box():
    pairs = ok.launch(
        _beside_torch_where_cuda_is_reported, _lab13_beside_torch(), world_size=2, timeout=120
    )[0]
    theirs, ours = pairs["PowerSGD r4"]
    assert len(theirs) == len(ours) == 4
    assert theirs == pytest.approx(ours, rel=1e-5)
