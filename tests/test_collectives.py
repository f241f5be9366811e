"""Kit collectives against a reference: world sizes 1-5, dtypes, ops, awkward sizes, layouts."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import overlapkit as ok
from overlapkit.collectives import OPS, buckets_by_size, chunk_bounds

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.int8, torch.uint8]  # fmt: skip
SIZES = [0, 1, 2, 3, 4, 5, 7, 64, 1031]


def inputs_of_every_rank(world, numel, dtype, op, seed):
    """Each rank's input, generated identically on every rank (so each can compute the truth)."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        if dtype.is_floating_point:
            t = torch.randn(numel, generator=g).to(dtype)
        elif op == "product":
            lo = 0 if dtype == torch.uint8 else -1
            t = torch.randint(lo, 2, (numel,), generator=g, dtype=torch.int64).to(dtype)
        else:
            lo = 0 if dtype == torch.uint8 else -9
            t = torch.randint(lo, 10, (numel,), generator=g, dtype=torch.int64).to(dtype)
        out.append(t)
    return out


def reference(stack, op, world):
    wide = stack.double() if stack.dtype.is_floating_point else stack.long()
    if op in ("sum", "avg"):
        r = wide.sum(0)
        if op == "avg":
            r = (
                r / world
                if stack.dtype.is_floating_point
                else torch.div(r, world, rounding_mode="trunc")
            )
    elif op == "max":
        r = wide.amax(0)
    elif op == "min":
        r = wide.amin(0)
    else:
        r = wide.prod(0)
    return r.to(stack.dtype)


def close(got, want):
    if got.dtype.is_floating_point:
        tol = {torch.float16: 2e-2, torch.bfloat16: 5e-2}.get(got.dtype, 1e-5)
        return torch.allclose(got.double(), want.double(), rtol=tol, atol=tol * 4)
    return torch.equal(got, want)


def _all_reduce_cases(algorithm):
    fn = {"ring": ok.ring_all_reduce, "naive": ok.naive_all_reduce}[algorithm]
    world, me = ok.world_size(), ok.rank()
    failures, seed = [], 0
    for dtype in DTYPES:
        for op in OPS:
            for numel in SIZES:
                seed += 1
                everyone = inputs_of_every_rank(world, numel, dtype, op, seed)
                want = reference(torch.stack(everyone), op, world)
                got = everyone[me].clone()
                fn(got, op=op)
                if not close(got, want):
                    failures.append(
                        f"{dtype} {op} numel={numel}: "
                        f"got {got[:4].tolist()} want {want[:4].tolist()}"
                    )
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_ring_all_reduce_matches_the_reference_for_every_dtype_op_and_size(world):
    for failures in ok.launch(_all_reduce_cases, "ring", world_size=world, timeout=240):
        assert failures == []


@pytest.mark.parametrize("world", [1, 3, 4])
def test_naive_all_reduce_matches_the_reference_for_every_dtype_op_and_size(world):
    for failures in ok.launch(_all_reduce_cases, "naive", world_size=world, timeout=240):
        assert failures == []


def _layouts():
    """Non-contiguous and multi-dimensional tensors, and a 0-d one."""
    me = ok.rank()
    base = torch.arange(30, dtype=torch.float32).reshape(5, 6) * (me + 1)
    transposed = base.t()  # non-contiguous view
    ok.ring_all_reduce(transposed)
    strided = torch.arange(20, dtype=torch.int64)[::3] * (me + 1)
    ok.ring_all_reduce(strided, op="max")
    scalar = torch.tensor(float(me))
    ok.naive_all_reduce(scalar, op="sum")
    return transposed.contiguous(), strided, scalar


def test_non_contiguous_and_multidimensional_tensors_are_reduced_in_place():
    world = 3
    total = sum(range(1, world + 1))
    for transposed, strided, scalar in ok.launch(_layouts, world_size=world):
        assert torch.equal(
            transposed, torch.arange(30, dtype=torch.float32).reshape(5, 6).t() * total
        )
        assert torch.equal(strided, torch.arange(20)[::3] * world)
        assert scalar.item() == sum(range(world))


def _rs_ag_cases():
    world, me = ok.world_size(), ok.rank()
    failures = []
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        for op in OPS:
            for per_rank in (0, 1, 3, 17):
                everyone = inputs_of_every_rank(world, world * per_rank, dtype, op, per_rank + 7)
                want = reference(torch.stack(everyone), op, world).view(world, per_rank)[me]
                out = torch.empty(per_rank, dtype=dtype)
                mine = everyone[me].clone()
                ok.ring_reduce_scatter(out, mine, op=op)
                if not close(out, want):
                    failures.append(
                        f"reduce_scatter {dtype} {op} {per_rank}: {out.tolist()} vs {want.tolist()}"
                    )
                if not torch.equal(mine, everyone[me]):
                    failures.append("reduce_scatter modified its input")
        for per_rank in (0, 1, 5):
            chunk = torch.full((per_rank,), me + 1).to(dtype)
            gathered = torch.empty(world * per_rank, dtype=dtype)
            ok.ring_all_gather(gathered, chunk)
            want = torch.arange(1, world + 1).repeat_interleave(per_rank).to(dtype)
            if not torch.equal(gathered, want):
                failures.append(f"all_gather {dtype} {per_rank}: {gathered.tolist()}")
    # 2-D output like all_gather_into_tensor with a stacked output
    grid = torch.empty(world, 2)
    ok.ring_all_gather(grid, torch.tensor([me, -me], dtype=torch.float32))
    if not torch.equal(grid, torch.tensor([[r, -r] for r in range(world)], dtype=torch.float32)):
        failures.append(f"all_gather 2-D: {grid.tolist()}")
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_ring_reduce_scatter_and_all_gather_match_the_reference(world):
    for failures in ok.launch(_rs_ag_cases, world_size=world, timeout=240):
        assert failures == []


def _rs_ag_match_builtins():
    me = ok.rank()
    x = torch.randn(4 * 6, generator=torch.Generator().manual_seed(me))
    ours, theirs = torch.empty(6), torch.empty(6)
    ok.ring_reduce_scatter(ours, x.clone())
    ok.builtin.reduce_scatter_tensor(theirs, x.clone())
    g_ours, g_theirs = torch.empty(4 * 6), torch.empty(4 * 6)
    ok.ring_all_gather(g_ours, ours)
    ok.builtin.all_gather_tensor(g_theirs, theirs)
    return torch.allclose(ours, theirs, atol=1e-5), torch.allclose(g_ours, g_theirs, atol=1e-5)


def test_reduce_scatter_and_all_gather_agree_with_torch_built_ins():
    try:
        results = ok.launch(_rs_ag_match_builtins, world_size=4)
    except RuntimeError as exc:  # an old gloo without the *_tensor collectives
        pytest.skip(f"built-in not available on gloo here: {exc}")
    assert results == [(True, True)] * 4


def _async_in_order():
    me = ok.rank()
    tensors = [torch.full((1000,), float(me + k)) for k in range(5)]
    handles = [ok.ring_all_reduce(t, async_op=True) for t in tensors]
    states = [h.is_completed() for h in handles]  # may be True or False; must not raise
    for h in handles:
        assert h.wait() is True
    blocking = torch.ones(3)
    ok.ring_all_reduce(blocking)  # a blocking call after async ones keeps the order
    return (
        [t[0].item() for t in tensors],
        blocking.tolist(),
        all(isinstance(s, bool) for s in states),
    )


def test_async_ring_returns_handles_and_runs_in_issue_order():
    world = 3
    for values, blocking, states_ok in ok.launch(_async_in_order, world_size=world):
        assert values == [sum(r + k for r in range(world)) for k in range(5)]
        assert blocking == [3.0] * 3 and states_ok


def _async_error():
    t = torch.ones(5 if ok.rank() == 0 else 6)
    handle = ok.ring_all_reduce(t, async_op=True)
    handle.wait()


def test_async_failure_is_raised_by_wait():
    with pytest.raises(ok.CollectiveMismatchError):
        ok.launch(_async_error, world_size=2, timeout=30)


def _bucketed():
    me = ok.rank()
    tensors = [torch.full((n,), float(me + 1)) for n in (10, 200_000, 7, 1, 250_000)]
    tensors.append(torch.full((4,), me + 1, dtype=torch.int64))
    n_buckets = ok.bucketed_all_reduce(tensors, bucket_mb=1)
    builtin = [torch.full((n,), float(me + 1)) for n in (10, 200_000)]
    ok.bucketed_all_reduce(builtin, bucket_mb=0.001, all_reduce=dist.all_reduce, op="avg")
    return n_buckets, [t.unique().tolist() for t in tensors], [t.unique().tolist() for t in builtin]


def test_bucketed_all_reduce_fuses_tensors_and_reduces_each_one():
    world = 3
    total = float(sum(range(1, world + 1)))
    for n_buckets, values, averaged in ok.launch(_bucketed, world_size=world):
        # 1 MiB buckets: 40 + 800,000 + 28 + 4 bytes | 1,000,000 bytes | the int64 tensor
        assert n_buckets == 3
        assert values == [[total]] * 5 + [[total]]
        assert averaged == [[total / world]] * 2


def test_buckets_group_in_order_by_size_dtype_and_device():
    f = [torch.empty(2**18) for _ in range(5)]  # 1 MiB each
    assert buckets_by_size(f, bucket_mb=2) == [[0, 1], [2, 3], [4]]
    assert buckets_by_size(f, bucket_mb=0.5) == [[0], [1], [2], [3], [4]]  # bigger than a bucket
    mixed = [torch.empty(4), torch.empty(4, dtype=torch.int64), torch.empty(4)]
    assert buckets_by_size(mixed, bucket_mb=25) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="bucket_mb must be positive"):
        buckets_by_size(f, 0)


def test_chunk_bounds_cover_every_element_once_with_sizes_differing_by_at_most_one():
    for numel in (0, 1, 3, 10, 1031):
        for parts in (1, 2, 3, 4, 7):
            bounds = chunk_bounds(numel, parts)
            sizes = [e - s for s, e in bounds]
            assert len(bounds) == parts and sum(sizes) == numel
            assert bounds[0][0] == 0 and all(
                bounds[i][1] == bounds[i + 1][0] for i in range(parts - 1)
            )
            assert max(sizes) - min(sizes) <= 1


# ----------------------------------------------------------------- bad input


def _sizes_differ():
    ok.ring_all_reduce(torch.ones(1000 if ok.rank() != 2 else 999))


def _dtypes_differ():
    ok.naive_all_reduce(torch.ones(8, dtype=torch.float32 if ok.rank() == 0 else torch.float64))


def _ops_differ():
    ok.ring_all_reduce(torch.ones(8), op="sum" if ok.rank() == 0 else "max")


@pytest.mark.parametrize(
    "fn, expected",
    [
        (_sizes_differ, ["ring_all_reduce of 1000 × float32, op 'sum'",
                         "ring_all_reduce of 999 × float32, op 'sum'"]),
        (_dtypes_differ, ["naive_all_reduce of 8 × float32, op 'sum'",
                          "naive_all_reduce of 8 × float64, op 'sum'"]),
        (_ops_differ, ["ring_all_reduce of 8 × float32, op 'sum'",
                       "ring_all_reduce of 8 × float32, op 'max'"]),
    ],
)  # fmt: skip
def test_mismatched_ranks_get_an_error_naming_both_calls_within_seconds(fn, expected):
    start = time.monotonic()
    with pytest.raises(ok.CollectiveMismatchError) as info:
        ok.launch(fn, world_size=3 if fn is _sizes_differ else 2, timeout=30)
    message = str(info.value)
    assert "disagree on kit operation #1" in message
    for call in expected:
        assert call in message
    assert "issued at test_collectives.py:" in message  # the learner's line, not the kit's
    assert time.monotonic() - start < 15


def _bad_shapes():
    errors = []
    for call in (
        lambda: ok.ring_reduce_scatter(torch.empty(3), torch.empty(10)),
        lambda: ok.ring_all_gather(torch.empty(10), torch.empty(3)),
        lambda: ok.ring_all_gather(torch.empty(6), torch.empty(3, dtype=torch.int64)),
        lambda: ok.ring_all_reduce(torch.empty(3), op="mean"),
    ):
        try:
            call()
            errors.append("no error")
        except (ValueError, TypeError) as exc:
            errors.append(str(exc))
    return errors


def test_output_input_size_mismatch_and_unknown_ops_are_rejected_locally():
    errors = ok.launch(_bad_shapes, world_size=2)[0]
    assert "input has 10 elements, expected world_size × output = 2 × 3 = 6" in errors[0]
    assert "output has 10 elements, expected world_size × input = 2 × 3 = 6" in errors[1]
    assert "output is torch.float32 but input is torch.int64" in errors[2]
    assert "unknown op 'mean': expected one of sum, avg, max, min, product" in errors[3]
