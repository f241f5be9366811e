"""The kit's CUDA paths that the CPU suite cannot reach: CUDA ranks over an emulated link,
compression, tensor parallelism, hybrid meshes, fully sharded training and the pipeline,
each against a single-process reference, with its tensors checked to be on CUDA.

Every test here is marked ``gpu`` (tests/conftest.py skips them without CUDA) and skips
itself, saying why, where the machine has fewer GPUs than its ranks need: a rank needs a
GPU of its own (NCCL refuses two ranks on one device), so on a 1-GPU box (the hosted
notebooks' case) multi-rank launches run gloo on the CPU, and what runs there on cuda:0 is
each area's single-rank or in-process form. ``scripts/gpu_check.sh`` runs them one area at
a time (``-k cuda_link``, ``-k cuda_compression``, ``-k cuda_tp``, ``-k cuda_hybrid``,
``-k cuda_fsdp``, ``-k cuda_pipeline``).

A rank computes on ``torch.device("cuda", ok.rank())`` and reports, with its results,
``ok.backend()``, ``ok.device()`` and the devices its tensors were on (results come back
to the caller on the CPU, so where they were is asked on the rank). A rank's backend may be
NCCL alone or the mixed default group "cpu:gloo,cuda:nccl"; either way it must contain
NCCL, and ``ok.device()`` must be the rank's own GPU: a rank that fell back to the CPU
fails.
"""

from __future__ import annotations

import time

import pytest
import torch

import overlapkit as ok
from overlapkit import hybrid
from overlapkit.compression import Half, PowerSGD, TopK
from overlapkit.pipeline import PipelineStage, run_on_one_device
from overlapkit.tensor_parallel import (
    all_gather_matmul,
    matmul_reduce_scatter,
)
from tests.test_tensor_parallel import mlp_checks

pytestmark = pytest.mark.gpu


# ------------------------------------------------------------------ where things ran


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def need_gpus(n: int) -> None:
    """Skip, saying why, unless this machine has ``n`` GPUs (one per rank)."""
    have = gpus()
    if have >= n:
        return
    if have == 0:
        pytest.skip("needs CUDA: no CUDA device here")
    pytest.skip(
        f"needs {n} GPUs, one per rank (NCCL refuses two ranks on one device); this machine "
        f"has {have}: with fewer, ranks run gloo on the CPU"
    )


def _device() -> torch.device:
    """The GPU this rank computes on: its own (``ok.rank()``); cuda:0 in the caller."""
    return torch.device("cuda", ok.rank())


def _where(*tensors) -> dict:
    """On a rank: its backend and device, and the devices ``tensors`` were on."""
    return {
        "backend": str(ok.backend()),
        "device": str(ok.device()),
        "tensors": sorted({str(t.device) for t in tensors if t is not None}),
    }


def backend_devices(wheres: list[dict]) -> str:
    """The line gpu_check.sh reports: ``backend=... devices=...`` (one device per rank)."""
    backends = sorted({w["backend"] for w in wheres})
    return f"backend={','.join(backends) or '-'} devices={','.join(w['device'] for w in wheres)}"


def assert_on_cuda(wheres: list[dict]) -> None:
    """Every rank ran NCCL (alone or in a mixed group), ``ok.device()`` was its own GPU, and
    the tensors it reported stayed there; prints the backend/devices line."""
    print(backend_devices(wheres))
    for r, w in enumerate(wheres):
        mine = f"cuda:{r}"
        assert "nccl" in w["backend"], (
            f"rank {r} fell back to the CPU: backend {w['backend']!r} has no NCCL "
            f"(expected 'nccl' or a group with 'cuda:nccl')"
        )
        assert w["device"] == mine, f"rank {r}: ok.device() is {w['device']}, not {mine}"
        assert w["tensors"] == [mine], f"rank {r}: tensors on {w['tensors']}, not [{mine!r}]"


# ------------------------------------------------------------------ CUDA ranks over a link

#: slow enough that its cost shows: every message of a ring step takes at least 20 ms
SLOW = ok.Link(latency_us=20_000, bandwidth_gbps=5)


def _ring_over_the_link(n: int = 1001):
    """A ring AllReduce (sum, then max) of CUDA tensors, a user-stream p2p exchange round
    the ring, and the time a ring AllReduce took, all over the launch's link."""
    me, world = ok.rank(), ok.world_size()
    dev = _device()
    t = torch.arange(n, dtype=torch.float32, device=dev) * (me + 1)
    ok.ring_all_reduce(t)
    m = torch.full((5,), float(me), device=dev)
    ok.ring_all_reduce(m, op="max")
    got = torch.full((7,), -1.0, device=dev)
    if world > 1:
        out = torch.full((7,), float(me), device=dev)
        ok.p2p.wait_all([ok.p2p.isend(out, (me + 1) % world), ok.p2p.irecv(got, (me - 1) % world)])
    ones = torch.ones(4096, device=dev)
    torch.cuda.synchronize(dev)
    start = time.perf_counter()
    ok.ring_all_reduce(ones)
    torch.cuda.synchronize(dev)
    end = time.perf_counter()  # the ranks share the clock (one machine)
    where = _where(t, m, got, ones)
    return t.cpu(), m.tolist(), got.tolist(), ones[:2].tolist(), (start, end), where


@pytest.mark.parametrize("world", [1, 2, 3])
def test_cuda_link_ring_all_reduce_of_cuda_tensors_over_an_emulated_link(world):
    """One rank per GPU over ``ok.Link``: the sums and maxima are exact, the p2p messages
    arrive from the left neighbour, and each of the ring's 2(N−1) steps paid the link's
    latency (the emulation was not bypassed for CUDA tensors)."""
    need_gpus(world)
    results = ok.launch(_ring_over_the_link, world_size=world, link=SLOW, timeout=60)
    assert_on_cuda([r[-1] for r in results])
    want = torch.arange(1001, dtype=torch.float32) * (world * (world + 1) // 2)
    for me, (t, m, got, ones, _, _) in enumerate(results):
        assert torch.equal(t, want), f"rank {me}: ring sum differs by {(t - want).abs().max()}"
        assert m == [float(world - 1)] * 5, f"rank {me}: ring max {m}"
        assert ones == [float(world)] * 2, f"rank {me}: {ones}"
        if world > 1:
            assert got == [float((me - 1) % world)] * 7, f"rank {me} received {got}"
    if world > 1:  # from the first rank's start to the last one's end: 2(N−1) latencies
        took = max(r[4][1] for r in results) - min(r[4][0] for r in results)
        floor = 2 * (world - 1) * SLOW.alpha
        assert took >= 0.9 * floor, f"the ring took {took:.3f} s < the link's {floor:.3f} s"


def _one_gpu_two_ranks():
    """What a rank of a 1-GPU box gets: its backend and device, ring AllReduces over the
    link of a CPU tensor and of a tensor on cuda:0 (the GPU it shares: its bytes travel
    through the host, as gloo moves CPU tensors only), and a product computed in-process on
    cuda:0."""
    t = torch.full((100,), float(ok.rank() + 1))
    ok.ring_all_reduce(t)
    c = torch.full((1001,), float(ok.rank() + 1), device="cuda:0")
    ok.ring_all_reduce(c)
    x = torch.ones(64, 64, device="cuda:0")
    y = (x @ x).sum().item()  # 64 · 64 · 64
    where = str(c.device)
    return str(ok.backend()), str(ok.device()), t[:2].tolist(), c[-2:].tolist(), where, y


def test_cuda_link_one_gpu_two_ranks_run_gloo_on_the_cpu_and_share_cuda0():
    """The hosted notebooks' case: two ranks, one GPU. They run gloo on the CPU (NCCL
    would refuse two ranks on one device), the kit's collectives work on CPU tensors and on
    tensors both ranks keep on cuda:0, and each rank computes on cuda:0 in its own process."""
    if gpus() != 1:
        pytest.skip(
            f"the 1-GPU case (this machine has {gpus()}): with 2+ GPUs each rank gets its own "
            "(test_cuda_link_ring_all_reduce_of_cuda_tensors_over_an_emulated_link)"
        )
    results = ok.launch(_one_gpu_two_ranks, world_size=2, link=ok.Link(20, 5), timeout=60)
    print(f"backend={results[0][0]} devices={','.join(r[1] for r in results)}")
    for me, (backend, device, t, c, where, y) in enumerate(results):
        assert backend == "gloo" and device == "cpu", (me, backend, device)
        assert t == [3.0, 3.0] and y == 64.0**3, (me, t, y)
        assert c == [3.0, 3.0] and where == "cuda:0", (me, c, where)


# ------------------------------------------------------------------ compression

NUMEL = 600
PSGD_SHAPES = [torch.Size([20, 10]), torch.Size([10])]  # 210 elements
PSGD_STEPS = 3  # two plain AllReduces, then PowerSGD


def _grads(rank, numel, step=0):
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * rank + step))


def _buckets_on_cuda(compressor, numel, shapes, steps):
    """(what this rank sent in, what it got) per step, its residual, the counts, devices."""
    dev = _device()
    out, seen = [], []
    for step in range(steps):
        mine = _grads(ok.rank(), numel, step)
        flat = mine.to(dev, copy=True)
        compressor(flat, shapes=shapes).wait()
        seen.append(flat)
        out.append((mine, flat.cpu()))
    residual = compressor.residuals.get(0, [None, None])[1]
    return out, residual, dict(compressor.stats), seen + [residual]


def _mlp_on(dev):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)]
    return torch.nn.Sequential(*layers).to(dev)


def _wrapper_on_cuda(all_reduce, steps=4):
    """``ok.BucketedDDP`` with ``all_reduce`` on the rank's GPU: its parameters after
    ``steps`` SGD steps, each rank on its own batch."""
    dev = _device()
    model = _mlp_on(dev)
    ddp = ok.BucketedDDP(model, all_reduce=all_reduce, bucket_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(ok.rank())
    for _ in range(steps):
        ddp(torch.randn(8, 16, generator=gen).to(dev)).square().mean().backward()
        ddp.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    params = list(model.parameters())
    return [p.detach().cpu() for p in params], params


def _one_process_reference(world, steps=4):
    """The same model trained in one process on every rank's batch (DDP's average)."""
    dev = _device()
    model = _mlp_on(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    for _ in range(steps):
        x = torch.cat([torch.randn(8, 16, generator=g) for g in gens]).to(dev)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().cpu() for p in model.parameters()]


def _full_rank_powersgd():
    return PowerSGD(rank=10, start_iter=2, min_compression_rate=0.1)


def _compression_on_cuda():
    """Each compressor on CUDA buckets, then the kit's wrapper with one: results (or the
    error each raised, so one failing compressor does not hide the others)."""
    cases = {
        "Half": (Half, NUMEL, None, 1),
        "TopK(1.0)": (lambda: TopK(1.0), NUMEL, None, 1),
        "TopK(0.05)": (lambda: TopK(0.05), NUMEL, None, 1),
        "PowerSGD(full rank)": (_full_rank_powersgd, 210, PSGD_SHAPES, PSGD_STEPS),
    }
    out, tensors = {}, []
    for name, (make, numel, shapes, steps) in cases.items():
        try:
            steps_out, residual, stats, seen = _buckets_on_cuda(make(), numel, shapes, steps)
            out[name] = (steps_out, None if residual is None else residual.cpu(), stats)
            tensors += seen
        except Exception as exc:  # noqa: BLE001 - reported by the caller, with the others
            out[name] = f"{type(exc).__name__}: {str(exc)[:400]}"
    for name, all_reduce in (("BucketedDDP(ring)", "ring"), ("BucketedDDP(TopK(1.0))", TopK(1.0))):
        try:
            params, live = _wrapper_on_cuda(all_reduce)
            out[name] = params
            tensors += live
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {str(exc)[:400]}"
    out["reference"] = _one_process_reference(ok.world_size())
    return out, _where(*tensors)


def _compression_problems(results, world) -> list[str]:
    """What differs from the CPU tests' references, compressor by compressor (one that
    raised is named with its error; the others are still checked)."""
    problems, ok_names = [], []
    for name in results[0][0]:
        failed = [(r, res[name]) for r, (res, _) in enumerate(results)
                  if isinstance(res[name], str)]  # fmt: skip
        problems += [f"{name} raised on rank {r}: {why}" for r, why in failed]
        if not failed:
            ok_names.append(name)

    def exact(name, step=0):
        return torch.stack([res[name][0][step][0] for res, _ in results]).mean(0)

    def off(got, want):
        return f"off by {(got - want).abs().max():.3g}"

    for r, (res, _) in enumerate(results):
        if "Half" in ok_names:
            got, want = res["Half"][0][0][1], exact("Half")
            if not torch.allclose(got, want, atol=2e-3, rtol=2e-3):
                problems.append(f"Half, rank {r}: {off(got, want)}")
            sent = res["Half"][2]["bytes_sent"]
            if sent != round(NUMEL * 2 * 2 * (world - 1) / world):  # 2(N−1)/N · S/2
                problems.append(f"Half, rank {r}: sent {sent} B")
        if "TopK(1.0)" in ok_names:
            got, want = res["TopK(1.0)"][0][0][1], exact("TopK(1.0)")
            if not torch.allclose(got, want, atol=1e-6):
                problems.append(f"TopK(1.0), rank {r}: {off(got, want)}")
            if torch.count_nonzero(res["TopK(1.0)"][1]):
                problems.append(f"TopK(1.0), rank {r}: kept a residual, yet it sends everything")
        if "PowerSGD(full rank)" in ok_names:
            for step in range(PSGD_STEPS):
                got = res["PowerSGD(full rank)"][0][step][1]
                want = exact("PowerSGD(full rank)", step)
                if not torch.allclose(got, want, atol=1e-5):
                    problems.append(f"PowerSGD at full rank, rank {r}, step {step}: "
                                    f"{off(got, want)}")  # fmt: skip
        for name in ("BucketedDDP(ring)", "BucketedDDP(TopK(1.0))"):
            if name in ok_names:
                for p, q in zip(res[name], res["reference"], strict=True):
                    if not torch.allclose(p, q, atol=1e-5):
                        problems.append(f"{name}, rank {r}: a parameter is {off(p, q)} from "
                                        "one process's")  # fmt: skip
    if "TopK(0.05)" in ok_names:
        k = 30  # 5% of 600
        expected = torch.zeros(NUMEL)
        for r, (res, _) in enumerate(results):
            mine = res["TopK(0.05)"][0][0][0]
            sent = torch.zeros(NUMEL)
            top = mine.abs().topk(k).indices
            sent[top] = mine[top]
            expected += sent / world
            if not torch.equal(res["TopK(0.05)"][1], mine - sent):
                problems.append(f"TopK(0.05), rank {r}: its residual is not what it did not send")
            if res["TopK(0.05)"][2]["bytes_sent"] != (world - 1) * k * (4 + 8):
                problems.append(f"TopK(0.05), rank {r}: sent "
                                f"{res['TopK(0.05)'][2]['bytes_sent']} B")  # fmt: skip
        for r, (res, _) in enumerate(results):
            got = res["TopK(0.05)"][0][0][1]
            if not torch.allclose(got, expected, atol=1e-6):
                problems.append(f"TopK(0.05), rank {r}: {off(got, expected)}")
    return problems


@pytest.mark.parametrize("world", [1, 2])
def test_cuda_compression_averages_cuda_buckets_as_one_process_does(world):
    """fp16, top-k (all of it and 5%) and PowerSGD at full rank average CUDA buckets as
    the CPU tests' references say, and ``ok.BucketedDDP`` with the ring or a compressor
    trains on CUDA as one process on every rank's batch."""
    need_gpus(world)
    results = ok.launch(_compression_on_cuda, world_size=world, timeout=60)
    problems = _compression_problems(results, world)
    assert not problems, "\n".join(problems)
    assert_on_cuda([w for _, w in results])


# ------------------------------------------------------------------ tensor parallel


def _mlp_on_ranks(sequence_parallel):
    """tests/test_tensor_parallel.py's MLP on the rank's GPU: the differences from one
    device (the same GPU) in output and every gradient, and where the tensors were."""
    checks, (col, row) = mlp_checks(sequence_parallel, _device())
    diffs = {k: (a - b).abs().max().item() for k, (a, b) in checks.items()}
    return diffs, _where(*(a for a, _ in checks.values()), col.weight, row.weight)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_cuda_tp_a_tensor_parallel_mlp_equals_one_device(world, sequence_parallel):
    need_gpus(world)
    link = ok.Link(20, 5) if world == 3 else None  # as the CPU test: one world over a link
    results = ok.launch(_mlp_on_ranks, sequence_parallel, world_size=world, link=link,
                        timeout=60)  # fmt: skip
    for rank, (diffs, _) in enumerate(results):
        for what, diff in diffs.items():
            assert diff < 1e-5, f"rank {rank}, {what}: {diff}"
    assert_on_cuda([w for _, w in results])


def _decomposed_on_cuda(world_rows, chunks):
    """The decomposed AllGather-matmul and matmul-ReduceScatter on the rank's GPU, against
    the plain products on the same GPU: (differences of output, weight grad, input grad)
    for each, and where the tensors were."""
    me, world = ok.rank(), ok.world_size()
    dev = _device()
    torch.manual_seed(0)
    weight = torch.randn(2 * world, 4).to(dev).requires_grad_(True)
    x = torch.randn(world * world_rows, 4, generator=torch.Generator().manual_seed(1)).to(dev)
    x.requires_grad_(True)
    y = x @ weight.t()
    y.square().sum().backward()
    rows = slice(me * world_rows, (me + 1) * world_rows)
    feats = slice(2 * me, 2 * me + 2)
    shard = x[rows].detach().requires_grad_(True)
    w = weight[feats].detach().clone().requires_grad_(True)
    out = all_gather_matmul(shard, w, chunks=chunks)
    out.square().sum().backward()
    gather = (
        (out - y[:, feats].detach()).abs().max().item(),
        (w.grad - weight.grad[feats]).abs().max().item(),
        (shard.grad - x.grad[rows]).abs().max().item(),
    )
    torch.manual_seed(0)
    weight2 = torch.randn(5, 2 * world).to(dev).requires_grad_(True)
    x2 = torch.randn(world * world_rows, 2 * world, generator=torch.Generator().manual_seed(1))
    x2 = x2.to(dev).requires_grad_(True)
    y2 = x2 @ weight2.t()
    y2.square().sum().backward()
    mine = x2[:, feats].detach().requires_grad_(True)
    w2 = weight2[:, feats].detach().clone().requires_grad_(True)
    out2 = matmul_reduce_scatter(mine, w2, chunks=chunks)
    out2.square().sum().backward()
    scatter = (
        (out2 - y2[rows].detach()).abs().max().item(),
        (w2.grad - weight2.grad[:, feats]).abs().max().item(),
        (mine.grad - x2.grad[:, feats]).abs().max().item(),
    )
    return gather, scatter, _where(out, w.grad, shard.grad, out2, w2.grad, mine.grad)


@pytest.mark.parametrize(("world", "rows", "chunks", "link"), [
    (1, 3, 1, True), (2, 5, 3, True), (2, 4, 2, False), (3, 4, 4, True),
])  # fmt: skip
def test_cuda_tp_the_decomposed_matmuls_equal_the_plain_ones(world, rows, chunks, link):
    """Shards that travel whole and in (uneven) pieces, over a link and (2, 4, 2) without
    one, where the shape check's message and the pieces go through the default group."""
    need_gpus(world)
    results = ok.launch(_decomposed_on_cuda, rows, chunks, world_size=world, timeout=60,
                        link=ok.Link(20, 5) if link else None)  # fmt: skip
    for rank, (gather, scatter, _) in enumerate(results):
        assert gather[0] < 1e-5 and gather[1] < 1e-4 and gather[2] < 1e-4, (rank, gather)
        assert scatter[0] < 1e-4 and scatter[1] < 1e-4 and scatter[2] < 1e-4, (rank, scatter)
    assert_on_cuda([w for _, _, w in results])


# ------------------------------------------------------------------ hybrid

WIDTH, BLOCKS, HYBRID_BATCH, HYBRID_STEPS = 16, 4, 12, 3


def _hybrid_model(dev):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
          for _ in range(BLOCKS)]
    ).to(dev)  # fmt: skip


def _hybrid_data(dev):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(HYBRID_BATCH, WIDTH, generator=g), torch.randn(HYBRID_BATCH, WIDTH,
                                                                        generator=g)  # fmt: skip
    return x.to(dev), y.to(dev)


def _hybrid_on_cuda(dp, pp, dp_start, micro):
    """tests/test_hybrid.py's training on the rank's GPU: this stage's parameters after the
    steps, one device's (the same GPU) for the same blocks, the lanes, and where."""
    dev = _device()
    mesh = hybrid.make_mesh(dp, pp)
    full = _hybrid_model(dev)
    per = BLOCKS // pp
    piece = full[mesh.stage * per : (mesh.stage + 1) * per]
    stage = hybrid.HybridStage(piece, mesh, bucket_mb=WIDTH * (WIDTH + 1) * 4 / 2**20)
    x, y = (t.chunk(dp)[mesh.replica] for t in _hybrid_data(dev))
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    tl = ok.Timeline()
    for _ in range(HYBRID_STEPS):
        result = stage.step(x if mesh.stage == 0 else None, y if mesh.stage == pp - 1 else None,
                            torch.nn.functional.mse_loss, micro_batches=micro,
                            dp_start=dp_start, timeline=tl)  # fmt: skip
        opt.step()
        grads = [p.grad for p in piece.parameters()]
        opt.zero_grad()
    alone = _hybrid_model(dev)
    ax, ay = _hybrid_data(dev)
    ref = torch.optim.SGD(alone.parameters(), lr=0.1)
    for _ in range(HYBRID_STEPS):
        torch.nn.functional.mse_loss(alone(ax), ay).backward()
        ref.step()
        ref.zero_grad()
    want = list(alone[mesh.stage * per : (mesh.stage + 1) * per].parameters())
    got = list(piece.parameters())
    return (mesh.stage, [p.detach().cpu() for p in got], [p.detach().cpu() for p in want],
            set(tl.lanes), result.reduce_launched is not None,
            _where(*got, *grads))  # fmt: skip


@pytest.mark.parametrize(("dp", "pp", "dp_start"), [
    (1, 1, "overlap"), (2, 1, "overlap"), (1, 2, "flush"), (2, 2, "overlap"), (2, 2, "flush"),
])  # fmt: skip
def test_cuda_hybrid_every_mesh_trains_as_one_device(dp, pp, dp_start):
    need_gpus(dp * pp)
    results = ok.launch(_hybrid_on_cuda, dp, pp, dp_start, 2, world_size=dp * pp, timeout=60)
    for _, got, want, lanes, launched, _ in results:
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        assert ("comm dp" in lanes) == (dp > 1) and ("comm pp" in lanes) == (pp > 1), lanes
        assert launched == (dp > 1)
    assert_on_cuda([r[-1] for r in results])


# ------------------------------------------------------------------ fully sharded


def _fsdp_on_cuda(prefetch, collective, steps=6):
    """tests/test_fsdp.py's training with the model on the rank's GPU: the largest
    parameter difference from one device (the same GPU) on the whole batch, the memory
    counts, and where the shards, the whole state and the gathered units were."""
    from tests.test_fsdp import UNITS, Net, _batch  # noqa: PLC0415

    me, world = ok.rank(), ok.world_size()
    dev = _device()
    model, alone = Net().to(dev), Net().to(dev)
    fsdp = ok.FullyShardedDP(model, units=UNITS, prefetch=prefetch, all_gather=collective,
                             reduce_scatter=collective)  # fmt: skip
    opt = torch.optim.AdamW(fsdp.parameters(), lr=0.01, weight_decay=0.1)
    ref = torch.optim.AdamW([p for p in alone.parameters() if p.requires_grad], lr=0.01,
                            weight_decay=0.1)  # fmt: skip
    for step in range(steps):
        x, y = (t.to(dev) for t in _batch(step, world))
        mine = slice(4 * me, 4 * me + 4)
        torch.nn.functional.mse_loss(fsdp(x[mine]), y[mine]).backward()
        fsdp.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(alone(x), y).backward()
        ref.step()
        ref.zero_grad()
    whole = fsdp.full_state_dict()
    gap = max((whole[k] - v).abs().max().item() for k, v in alone.state_dict().items())
    memory = fsdp.memory(opt)
    return gap, memory, _where(*fsdp.shards, *whole.values(), *(u.full for u in fsdp.units))


@pytest.mark.parametrize(("world", "prefetch", "collective", "link"), [
    (1, "explicit", "ring", False), (1, "none", None, False), (2, "explicit", "ring", False),
    (2, "implicit", None, False), (2, "explicit", "ring", True), (3, "explicit", "ring", False),
])  # fmt: skip
def test_cuda_fsdp_fully_sharded_training_equals_one_device(world, prefetch, collective, link):
    """Tolerance: the existing GPU test's (tests/test_fsdp.py, 1e-5 after AdamW steps)."""
    need_gpus(world)
    results = ok.launch(_fsdp_on_cuda, prefetch, collective, world_size=world, timeout=60,
                        link=ok.Link(50, 1.0) if link else None)  # fmt: skip
    for rank, (gap, memory, _) in enumerate(results):
        assert gap <= 1e-5, f"rank {rank}: a parameter differs by {gap:.3g}"
        assert memory.get("allocator_peak", 0) >= memory["shards"], (
            f"rank {rank}: no CUDA allocator peak in {memory} (the units were not on CUDA)"
        )
    assert_on_cuda([w for _, _, w in results])


# ------------------------------------------------------------------ pipeline

PIPE_BATCH = 10
CUTS = {2: [0, 2, 5], 3: [0, 2, 4, 5]}


def _pipe_model(dev="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    ).to(dev)  # fmt: skip


def _pipe_data(dev="cpu"):
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(PIPE_BATCH, 6, generator=gen), torch.randn(PIPE_BATCH, 3, generator=gen)
    return x.to(dev), y.to(dev)


@pytest.mark.parametrize("schedule", ["sequential", "gpipe", "1f1b"])
@pytest.mark.parametrize("stages, m", [(2, 4), (3, 7)])
def test_cuda_pipeline_stages_on_streams_of_one_gpu_give_one_devices_gradients(
    schedule, stages, m, record_property
):
    """In-process on cuda:0, a stream per stage (the 1-GPU form): every schedule gives the
    same gradients as the whole model on the same GPU, on CUDA, with a lane per stage."""
    need_gpus(1)
    dev = torch.device("cuda", 0)
    x, y = _pipe_data(dev)
    full = _pipe_model(dev)
    loss = torch.nn.functional.mse_loss(full(x), y)
    loss.backward()
    split = _pipe_model(dev)
    pieces = [split[CUTS[stages][s] : CUTS[stages][s + 1]] for s in range(stages)]
    tl = ok.Timeline()
    res = run_on_one_device(pieces, x, y, torch.nn.functional.mse_loss, m, schedule, timeline=tl)
    line = f"backend=none (in-process) devices={dev}"
    print(line)
    record_property("backend_devices", line)
    for q, w in zip(split.parameters(), full.parameters(), strict=True):
        assert q.grad.device == dev, f"a gradient is on {q.grad.device}"
        torch.testing.assert_close(q.grad, w.grad, rtol=0, atol=1e-5)
    assert res.loss == pytest.approx(loss.item(), rel=1e-5)
    micro = 1 if schedule == "sequential" else m
    assert res.peak_activations == (min(stages, micro) if schedule == "1f1b" else micro)
    assert {f"stage {s}" for s in range(stages)} <= set(tl.lanes), tl.lanes


def _pipeline_on_cuda():
    """tests/test_pipeline.py's every-schedule run with each stage on its rank's GPU: the
    worst gradient difference from one device (the same GPU) per (schedule, overlap, m),
    the peak activations and the loss."""
    s, p = ok.rank(), ok.world_size()
    dev = _device()
    x, y = _pipe_data(dev)
    full = _pipe_model(dev)
    torch.nn.functional.mse_loss(full(x), y).backward()
    lo, hi = CUTS[p][s], CUTS[p][s + 1]
    want = [q.grad for q in full[lo:hi].parameters()]
    worst, grads = {}, []
    for schedule in ("sequential", "gpipe", "1f1b"):
        for overlap in (False, True):
            for m in (1, 4, 7):
                piece = _pipe_model(dev)[lo:hi]
                res = PipelineStage(piece).step(x if s == 0 else None, y if s == p - 1 else None,
                                                torch.nn.functional.mse_loss, m, schedule,
                                                overlap)  # fmt: skip
                grads += [q.grad for q in piece.parameters()]
                diff = max((q.grad - w).abs().max().item()
                           for q, w in zip(piece.parameters(), want, strict=True))  # fmt: skip
                worst[(schedule, overlap, m)] = (diff, res.peak_activations, res.loss)
    return worst, _where(*grads)


@pytest.mark.parametrize("stages", [2, 3])
def test_cuda_pipeline_stages_on_their_own_gpus_over_a_link_give_one_devices_gradients(stages):
    """Activations and gradients of CUDA tensors over ``ok.Link`` between GPUs."""
    need_gpus(stages)
    results = ok.launch(_pipeline_on_cuda, world_size=stages, link=ok.Link(20, 5), timeout=60)
    for s, (worst, _) in enumerate(results):
        for (schedule, overlap, m), (diff, peak, _) in worst.items():
            assert diff < 1e-5, f"stage {s}, {schedule}, overlap={overlap}, m={m}: {diff}"
            micro = 1 if schedule == "sequential" else m
            if schedule == "1f1b":
                assert peak <= min(stages - s, micro), (s, m, peak)
            else:
                assert peak == micro
    x, y = _pipe_data()
    want = torch.nn.functional.mse_loss(_pipe_model()(x), y).item()
    assert results[-1][0][("gpipe", True, 7)][2] == pytest.approx(want, rel=1e-5)
    assert_on_cuda([w for _, w in results])
