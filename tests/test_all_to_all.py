"""ok.all_to_all: block j of rank r's input lands in block r of rank j's output."""

import pytest
import torch
import torch.distributed as dist

import overlapkit as ok


def _splits(world, uneven):
    """Rows rank r sends to rank j: uneven (and sometimes empty) when asked."""
    if not uneven:
        return [[2] * world for _ in range(world)]
    return [[(r + 2 * j) % 3 for j in range(world)] for r in range(world)]


def _exchange(uneven, dtype):
    me, world = ok.rank(), ok.world_size()
    table = _splits(world, uneven)
    send, recv = table[me], [table[r][me] for r in range(world)]
    # row i of the block for rank j holds (me, j, i): every row is recognisable
    rows = [torch.tensor([[me, j, i]]) for j in range(world) for i in range(send[j])]
    inp = torch.cat(rows) if rows else torch.empty(0, 3)
    inp = inp.to(dtype)
    out = torch.full((sum(recv), 3), -1).to(dtype)
    kwargs = {"output_split_sizes": recv, "input_split_sizes": send} if uneven else {}
    ok.all_to_all(out, inp, **kwargs)
    want = [torch.tensor([[r, me, i]]) for r in range(world) for i in range(recv[r])]
    want = (torch.cat(want) if want else torch.empty(0, 3)).to(dtype)
    builtin = None
    if dtype == torch.float32:  # against the built-in, where gloo has it
        builtin = torch.full_like(out, -1)
        dist.all_to_all_single(builtin, inp, **kwargs)
    return out, want, builtin


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("uneven", [False, True])
def test_all_to_all_matches_the_definition_and_the_builtin(world, uneven):
    for rank, (out, want, builtin) in enumerate(
        ok.launch(_exchange, uneven, torch.float32, world_size=world, link=ok.Link(20, 5))
    ):
        assert torch.equal(out, want), (rank, out, want)
        assert torch.equal(builtin, want), rank


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.bfloat16, torch.uint8])
def test_all_to_all_moves_every_dtype(dtype):
    for out, want, _ in ok.launch(_exchange, True, dtype, world_size=3):
        assert torch.equal(out, want)


def _async_exchange():
    me, world = ok.rank(), ok.world_size()
    inp = torch.arange(4 * world, dtype=torch.float32).reshape(world * 2, 2) + 100 * me
    out = torch.empty_like(inp)
    handle = ok.all_to_all(out, inp, async_op=True)
    handle.wait()
    want = torch.cat([(torch.arange(4 * world, dtype=torch.float32).reshape(world * 2, 2)
                       + 100 * r)[2 * me : 2 * me + 2] for r in range(world)])  # fmt: skip
    return torch.equal(out, want)


def test_async_all_to_all_returns_a_handle():
    assert all(ok.launch(_async_exchange, world_size=3, link=ok.Link(50, 1)))


def _disagreeing_counts():
    me = ok.rank()
    inp, out = torch.zeros(3, 2), torch.zeros(3, 2)
    # rank 0 sends 2 rows to rank 1, but rank 1 expects 1 from rank 0
    send = [1, 2] if me == 0 else [2, 1]
    recv = [1, 2] if me == 0 else [1, 2]
    ok.all_to_all(out, inp, output_split_sizes=recv, input_split_sizes=send)


def test_split_sizes_that_disagree_between_ranks_name_both_ranks():
    with pytest.raises(ValueError, match="rank 0 sends 2 rows to rank 1, but rank 1's"):
        ok.launch(_disagreeing_counts, world_size=2, timeout=30)


def _bad_sum():
    ok.all_to_all(torch.zeros(4, 2), torch.zeros(4, 2), input_split_sizes=[1, 2])


def test_split_sizes_that_do_not_add_up_are_refused():
    with pytest.raises(ValueError, match=r"input_split_sizes \[1, 2\] must be 2 counts"):
        ok.launch(_bad_sum, world_size=2, timeout=30)


def _uneven_rows():
    ok.all_to_all(torch.zeros(3, 2), torch.zeros(3, 2))


def test_rows_that_do_not_split_evenly_ask_for_split_sizes():
    with pytest.raises(ValueError, match="do not split into 2 equal blocks"):
        ok.launch(_uneven_rows, world_size=2, timeout=30)
