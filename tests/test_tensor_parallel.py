"""Column- and row-parallel layers (and their sequence-parallel form) equal one device."""

import re

import pytest
import torch

import overlapkit as ok
from overlapkit.collectives import chunk_bounds
from overlapkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear

ROWS = 6  # divisible by 2 and 3 ranks: the sequence shards


def mlp_checks(sequence_parallel, device="cpu"):
    """The tensor-parallel MLP beside one device (on ``device``): {what: (this rank's
    tensor, one device's)}, and the rank's two sharded layers."""
    me, world = ok.rank(), ok.world_size()
    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(8, 16).to(device), torch.nn.Linear(16, 8).to(device)
    x = torch.randn(ROWS, 8, generator=torch.Generator().manual_seed(1)).to(device)
    x.requires_grad_(True)
    target = torch.randn(ROWS, 8, generator=torch.Generator().manual_seed(2)).to(device)
    # one device
    loss = torch.nn.functional.mse_loss(l2(torch.nn.functional.gelu(l1(x))), target)
    loss.backward()
    # tensor parallel
    col = ColumnParallelLinear(8, 16, from_layer=l1, sequence_parallel=sequence_parallel)
    row = RowParallelLinear(16, 8, from_layer=l2, sequence_parallel=sequence_parallel)
    lo, hi = me * ROWS // world, (me + 1) * ROWS // world
    xin = (x[lo:hi] if sequence_parallel else x).detach().requires_grad_(True)
    y = row(torch.nn.functional.gelu(col(xin)))
    want_y = l2(torch.nn.functional.gelu(l1(x))).detach()
    mine = target[lo:hi] if sequence_parallel else target
    # the same mean over all rows: each rank's share of it when rows are split
    tp_loss = torch.nn.functional.mse_loss(y, mine, reduction="sum") / target.numel()
    tp_loss.backward()
    c_lo, c_hi = chunk_bounds(16, world)[me]
    checks = {
        "output": (y, want_y[lo:hi] if sequence_parallel else want_y),
        "column weight grad": (col.weight.grad, l1.weight.grad[c_lo:c_hi]),
        "column bias grad": (col.bias.grad, l1.bias.grad[c_lo:c_hi]),
        "row weight grad": (row.weight.grad, l2.weight.grad[:, c_lo:c_hi]),
        "row bias grad": (row.bias.grad, l2.bias.grad),
        # what flows on to the layers before: whole only if f / the AllGather's
        # backward summed every rank's part
        "input grad": (xin.grad, x.grad[lo:hi] if sequence_parallel else x.grad),
    }
    return checks, (col, row)


def _mlp_on_ranks(sequence_parallel):
    checks, _ = mlp_checks(sequence_parallel)
    return {k: (a - b).abs().max().item() for k, (a, b) in checks.items()}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_tensor_parallel_mlp_equals_one_device_forward_and_backward(world, sequence_parallel):
    link = ok.Link(20, 5) if world == 3 else None
    for rank, diffs in enumerate(
        ok.launch(_mlp_on_ranks, sequence_parallel, world_size=world, link=link, timeout=60)
    ):
        for what, diff in diffs.items():
            assert diff < 1e-5, f"rank {rank}, {what}: {diff}"


def _decomposed(world_rows, chunks=1):
    """Column-parallel with sequence-split input: rank r holds rows r of x and output
    features r of W; its output is every row of its features."""
    from overlapkit.tensor_parallel import all_gather_matmul

    me, world = ok.rank(), ok.world_size()
    torch.manual_seed(0)
    weight = torch.randn(2 * world, 4, requires_grad=True)
    x = torch.randn(world * world_rows, 4, generator=torch.Generator().manual_seed(1))
    x.requires_grad_(True)
    y = x @ weight.t()
    y.square().sum().backward()
    rows = slice(me * world_rows, (me + 1) * world_rows)
    feats = slice(2 * me, 2 * me + 2)
    shard = x[rows].detach().requires_grad_(True)
    w = weight[feats].detach().clone().requires_grad_(True)
    out = all_gather_matmul(shard, w, chunks=chunks)
    out.square().sum().backward()  # each rank's share of the same loss
    return (
        (out - y[:, feats].detach()).abs().max().item(),
        (w.grad - weight.grad[feats]).abs().max().item(),
        (shard.grad - x.grad[rows]).abs().max().item(),
    )


@pytest.mark.parametrize(("world", "rows", "chunks"), [(2, 3, 1), (3, 3, 1), (2, 5, 3), (3, 4, 4)])
def test_the_decomposed_all_gather_matmul_equals_gather_then_multiply(world, rows, chunks):
    """Whole shards, and shards that travel in pieces (uneven ones too)."""
    results = ok.launch(_decomposed, rows, chunks, world_size=world, link=ok.Link(20, 5))
    for rank, (out, weight_grad, input_grad) in enumerate(results):
        assert out < 1e-5 and weight_grad < 1e-4 and input_grad < 1e-4, (rank, results[rank])


def _decomposed_reduce_scatter(world_rows, chunks=1):
    """Row-parallel with sequence-split output: rank r holds input features r of W and of
    every row of x; its output is its rows, summed over every rank's features."""
    from overlapkit.tensor_parallel import matmul_reduce_scatter

    me, world = ok.rank(), ok.world_size()
    torch.manual_seed(0)
    weight = torch.randn(5, 2 * world, requires_grad=True)
    x = torch.randn(world * world_rows, 2 * world, generator=torch.Generator().manual_seed(1))
    x.requires_grad_(True)
    y = x @ weight.t()
    y.square().sum().backward()
    rows, feats = slice(me * world_rows, (me + 1) * world_rows), slice(2 * me, 2 * me + 2)
    mine = x[:, feats].detach().requires_grad_(True)
    w = weight[:, feats].detach().clone().requires_grad_(True)
    out = matmul_reduce_scatter(mine, w, chunks=chunks)
    out.square().sum().backward()
    return (
        (out - y[rows].detach()).abs().max().item(),
        (w.grad - weight.grad[:, feats]).abs().max().item(),
        (mine.grad - x.grad[:, feats]).abs().max().item(),
    )


@pytest.mark.parametrize(("world", "rows", "chunks"), [(2, 2, 1), (3, 2, 1), (2, 5, 2), (3, 3, 3)])
def test_the_decomposed_matmul_reduce_scatter_equals_multiply_then_reduce_scatter(
    world, rows, chunks
):
    results = ok.launch(
        _decomposed_reduce_scatter, rows, chunks, world_size=world, link=ok.Link(20, 5)
    )
    for rank, (out, weight_grad, input_grad) in enumerate(results):
        assert out < 1e-4 and weight_grad < 1e-4 and input_grad < 1e-4, (rank, results[rank])


def _bad_decomposed(case):
    from overlapkit.tensor_parallel import all_gather_matmul, matmul_reduce_scatter

    me = ok.rank()
    if case == "too many chunks":
        return all_gather_matmul(torch.ones(3, 4), torch.ones(2, 4), chunks=4)
    if case == "shapes differ":  # rank 1's shard has a different width
        return all_gather_matmul(torch.ones(3, 4 + me), torch.ones(2, 4 + me))
    return matmul_reduce_scatter(torch.ones(5, 4), torch.ones(2, 4))  # 5 rows, 2 blocks


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("too many chunks", "chunks=4 is more than the 3 rows of its input shard"),
        ("shapes differ", "rank 0 has input [3, 4] and weight [2, 4], but rank 1 has input [3, 5]"),
        ("rows do not split", "5 rows do not split into 2 blocks"),
    ],
)
def test_the_decomposed_matmuls_refuse_bad_input_naming_rank_and_sizes(case, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        ok.launch(_bad_decomposed, case, world_size=2, timeout=30)


def _row_parallel_bias_built_by_each_rank():
    torch.manual_seed(100 + ok.rank())  # each rank's own random numbers, as in a real job
    return RowParallelLinear(6, 4).bias.detach().clone()


def test_a_row_parallel_bias_built_without_a_layer_is_the_same_on_every_rank():
    """A replicated bias drawn from each rank's own random numbers would differ on every
    rank after the sum; it is zero-initialised, as Megatron does."""
    biases = ok.launch(_row_parallel_bias_built_by_each_rank, world_size=2, timeout=60)
    assert torch.equal(biases[0], biases[1]), biases
    assert torch.equal(biases[0], torch.zeros(4))
