"""ok.costmodel: the α-β formulas, the fit, and the exact figures the labs state."""

from __future__ import annotations

import math
import random

import pytest

from overlapkit import costmodel as cm

A, B = 50e-6, 1e-9  # 50 µs, 1 GB/s


def test_fit_recovers_alpha_and_beta_and_survives_relative_noise():
    sizes = [8 * 4**k for k in range(12)]
    exact = [A + B * s for s in sizes]
    assert cm.fit_alpha_beta(sizes, exact) == pytest.approx((A, B), rel=1e-9)
    rng = random.Random(1)
    noisy = [t * rng.uniform(0.9, 1.1) for t in exact]
    alpha, beta = cm.fit_alpha_beta(sizes, noisy)
    assert alpha == pytest.approx(A, rel=0.2) and beta == pytest.approx(B, rel=0.1)


@pytest.mark.parametrize("times", [[1.0], [1.0, -1.0], [1.0, float("nan")]])
def test_fit_rejects_too_few_or_non_positive_times(times):
    with pytest.raises(ValueError):
        cm.fit_alpha_beta([1, 2][: len(times)], times)


def test_naive_all_reduce_is_linear_in_the_number_of_ranks():
    S = 64e6
    assert cm.naive_all_reduce(S, 4, A, B) == pytest.approx(2 * A + 6 * S * B)
    assert cm.naive_all_reduce(S, 1, A, B) == 0.0


def test_ring_all_reduce_bandwidth_term_is_bounded_but_latency_term_grows():
    S = 64e6
    assert cm.ring_all_reduce(S, 4, A, B) == pytest.approx(6 * A + 1.5 * S * B)
    big = cm.ring_all_reduce(S, 1024, 0.0, B)
    assert big == pytest.approx(2 * 1023 / 1024 * S * B) and big < 2 * S * B
    assert cm.ring_all_reduce(S, 1024, A, 0.0) == pytest.approx(2 * 1023 * A)


def test_ring_is_reduce_scatter_plus_all_gather():
    S, N, G = 1e6, 5, 2e-10
    assert cm.ring_all_reduce(S, N, A, B, G) == pytest.approx(
        cm.ring_reduce_scatter(S, N, A, B, G) + cm.ring_all_gather(S, N, A, B)
    )


def test_other_algorithms_match_their_textbook_formulas():
    S, N = 1e6, 8
    assert cm.recursive_doubling_all_reduce(S, N, A, B) == pytest.approx(3 * (A + S * B))
    assert cm.halving_doubling_all_reduce(S, N, A, B) == pytest.approx(6 * A + 2 * 7 / 8 * S * B)
    assert cm.tree_all_reduce(S, N, A, B, chunks=1) == pytest.approx(2 * 3 * (A + S * B))
    assert cm.tree_all_reduce(S, N, A, B, chunks=4) == pytest.approx(2 * 6 * (A + S / 4 * B))


def test_bucketing_pays_latency_per_bucket_and_bandwidth_once():
    S, N = 100e6, 4
    one, many = cm.bucketed_all_reduce(S, N, 1, A, B), cm.bucketed_all_reduce(S, N, 100, A, B)
    assert many - one == pytest.approx(99 * 2 * (N - 1) * A)


def test_bytes_moved_per_rank_are_the_exact_figures_not_o1():
    S = 1000.0
    assert cm.bytes_moved_per_rank("all_reduce", S, 4) == pytest.approx(1500.0)
    assert cm.bytes_moved_per_rank("all_gather", S, 4) == pytest.approx(750.0)
    assert cm.bytes_moved_per_rank("reduce_scatter", S, 1) == 0.0


def test_pipeline_bubble():
    assert cm.pipeline_bubble(2, 1) == pytest.approx(0.5)
    assert cm.pipeline_bubble(4, 8) == pytest.approx(3 / 11)


def test_projection_to_1024_ranks_ranks_the_algorithms():
    rows = cm.project(256e6, [2, 1024], A, B)
    big = rows[-1]
    assert big["ranks"] == 1024
    assert big["ring"] < big["naive"] / 100  # the root's link is the bottleneck
    small_message = cm.project(8e3, [1024], A, B)[0]
    assert small_message["tree"] < small_message["ring"]  # latency-bound: log N wins
    assert math.isclose(rows[0]["naive"], cm.naive_all_reduce(256e6, 2, A, B))


def test_default_tree_is_pipelined_with_the_best_piece_count():
    S, N = 256e6, 1024
    best = cm.tree_all_reduce(S, N, A, B)
    assert best == min(cm.tree_all_reduce(S, N, A, B, chunks=k) for k in range(1, 2000))
    assert best < cm.tree_all_reduce(S, N, A, B, chunks=1) / 5


# --------------------------------------------------------------------------- data-parallel step

# 8 gradients of 1 MiB, ready every 1 ms during an 8 ms backward
READY = [((i + 1) * 1e-3, 2**20) for i in range(8)]
ALPHA, BETA = 100e-6, 1 / 0.25e9  # Link(100 µs, 0.25 GB/s)


def test_naive_ddp_step_is_forward_plus_backward_plus_every_all_reduce_after_it():
    got = cm.ddp_step(READY, 2e-3, 8e-3, 2, ALPHA, BETA, "naive")
    one = cm.ring_all_reduce(2**20, 2, ALPHA, BETA)
    assert got["step"] == pytest.approx(2e-3 + 8e-3 + 8 * one)
    assert got["hidden_fraction"] == pytest.approx(0.0)


def test_bucketed_ddp_step_exposes_only_what_runs_past_backward():
    got = cm.ddp_step(READY, 2e-3, 8e-3, 2, ALPHA, BETA, "bucketed", bucket_mb=2)
    pair = cm.ring_all_reduce(2 * 2**20, 2, ALPHA, BETA)
    # 4 buckets of 2 MiB ready at 2, 4, 6, 8 ms; each takes ~8.6 ms: the link is the limit
    assert got["buckets"] == 4
    assert got["step"] == pytest.approx(2e-3 + 2e-3 + 4 * pair)
    assert got["exposed"] == pytest.approx(2e-3 + 4 * pair - 8e-3)


def test_one_bucket_starts_only_when_backward_is_over():
    got = cm.ddp_step(READY, 0.0, 8e-3, 2, ALPHA, BETA, "bucketed", bucket_mb=None)
    assert got["buckets"] == 1 and got["spans"][0][0] == pytest.approx(8e-3)


def test_a_per_message_cost_makes_tiny_buckets_slow_and_picks_a_middle_size():
    ready = [((i + 1) * 1e-4, 64 * 2**10) for i in range(256)]  # 16 MiB in 64 KiB pieces
    fast = dict(N=2, alpha=ALPHA, beta=BETA)
    tiny = cm.ddp_step(ready, 0, 0.0256, **fast, strategy="overlap", per_op=3e-4)
    mid = cm.ddp_step(ready, 0, 0.0256, **fast, strategy="bucketed", bucket_mb=2,
                             per_op=3e-4)  # fmt: skip
    assert tiny["step"] > mid["step"]
    best = cm.best_bucket_mb(ready, 0, 0.0256, 2, ALPHA, BETA, per_op=3e-4)
    assert 0.25 <= best <= 8


def test_communication_cpu_stretches_an_overlapped_backward_not_a_naive_one():
    fast = BETA / 10  # the link keeps up: each bucket's AllReduce starts when it is full
    base = cm.ddp_step(READY, 0, 8e-3, 2, ALPHA, fast, "bucketed", 2)
    host = cm.HostCost(cpu_per_op=1e-3)  # 4 buckets, 3 of them start during backward
    cpu = cm.ddp_step(READY, 0, 8e-3, 2, ALPHA, fast, "bucketed", 2, host=host)
    assert cpu["backward"] == pytest.approx(8e-3 + 3e-3)  # the last starts at its end
    assert cpu["spans"][0][0] == pytest.approx(base["spans"][0][0] * 11 / 8)
    naive = cm.ddp_step(READY, 0, 8e-3, 2, ALPHA, BETA, "naive", host=host)
    assert naive["backward"] == 8e-3


def test_one_bucket_after_backward_takes_nothing_from_it():
    host = cm.HostCost(cpu_per_op=1e-3, cpu_per_byte=1e-9)
    one = cm.ddp_step(READY, 0, 8e-3, 2, ALPHA, BETA, "bucketed", None, host=host)
    assert one["backward"] == 8e-3


def test_a_busy_rank_pays_its_per_op_cost_during_backward_only():
    host = cm.HostCost(per_op=1e-4, per_op_busy=1e-3)
    got = cm.ddp_step(READY, 0, 8e-3, 2, ALPHA, BETA, "overlap", host=host)
    one = cm.ring_all_reduce(2**20, 2, ALPHA, BETA)
    first = got["spans"][0]
    assert first[1] - first[0] == pytest.approx(1e-3 + one)
    last = got["spans"][-1]
    assert last[0] >= 8e-3 and last[1] - last[0] == pytest.approx(1e-4 + one)


# --------------------------------------------------------------------------- pipeline


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, m", [(2, 1), (2, 4), (2, 8), (3, 8), (4, 3)])
def test_a_simulated_pipeline_without_transfers_has_the_textbook_bubble(schedule, stages, m):
    from overlapkit.pipeline import make_schedule

    got = cm.pipeline_step(make_schedule(schedule, stages, m), 1.0, 2.0)
    assert got["step"] == pytest.approx((m + stages - 1) * 3.0)
    assert got["bubble"] == pytest.approx(cm.pipeline_bubble(stages, m))


def test_transfers_add_to_the_fill_and_drain_and_more_without_overlap():
    from overlapkit.pipeline import make_schedule

    plan = make_schedule("gpipe", 2, 4)
    base = cm.pipeline_step(plan, 1.0, 1.0)["step"]
    hidden = cm.pipeline_step(plan, 1.0, 1.0, transfer=0.5, overlap=True)["step"]
    serial = cm.pipeline_step(plan, 1.0, 1.0, transfer=0.5, overlap=False)["step"]
    assert hidden == pytest.approx(base + 2 * 0.5)  # one activation in, one gradient out
    assert serial > hidden


def test_all_to_all_pays_one_latency_and_one_block_per_peer():
    assert cm.all_to_all(4e6, 4, 1e-4, 1e-9) == pytest.approx(3 * (1e-4 + 1e6 * 1e-9))
    assert cm.all_to_all(4e6, 1, 1e-4, 1e-9) == 0


# ------------------------------------------------------------------ decomposition


def test_collective_matmul_in_one_piece_hides_the_transfer_only_under_the_own_shard():
    # 2 ranks, transfer = 2 × one shard's product: serial 2 + 2; decomposed max(1, 2) + 1
    r = cm.collective_matmul(2, 1, compute=1.0, transfer=2.0)
    assert r["serial"] == pytest.approx(4.0) and r["step"] == pytest.approx(3.0)
    assert r["hidden"] == pytest.approx(0.5)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_collective_matmul_hides_more_in_more_pieces_and_nothing_without_a_transfer(kind):
    steps = [cm.collective_matmul(3, k, 1 / k, 1.5 / k, kind)["step"] for k in (1, 2, 8)]
    assert steps[0] > steps[1] > steps[2]
    free = cm.collective_matmul(3, 4, 0.25, 0.0, kind)
    assert free["step"] == pytest.approx(3.0) and free["hidden"] == 0.0


def test_moe_step_in_one_chunk_is_route_dispatch_compute_combine():
    r = cm.moe_step(1, route=0.1, expert=1.0, all_to_all=0.5)
    assert r["step"] == pytest.approx(2.1) and r["hidden"] == 0.0


def test_moe_step_pipelines_chunks_behind_one_another():
    # expert = both all-to-alls per chunk: after D0 the link and the expert keep pace
    r = cm.moe_step(4, route=0.0, expert=0.25, all_to_all=0.125)
    assert r["step"] == pytest.approx(0.125 + 4 * 0.25 + 0.125)
    assert r["hidden"] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="one expert time and one all-to-all time per chunk"):
        cm.moe_step(3, 0.0, [1.0, 1.0], 0.1)


def test_moe_step_local_first_hides_the_first_dispatch_under_the_own_tokens():
    # 2 ranks: half the compute is the own tokens; the others' half travels each way
    plain = cm.moe_step(4, route=0.0, expert=0.25, all_to_all=0.125)
    first = cm.moe_step(4, route=0.0, expert=0.125, all_to_all=0.125, local=0.5)
    # the four dispatches (0.5 s) travel under the own tokens; then each chunk's combine
    # keeps pace with the next chunk's compute, and only the last one is exposed
    assert first["step"] == pytest.approx(0.5 + 4 * 0.125 + 0.125)
    assert first["step"] < plain["step"] and first["hidden"] > plain["hidden"]
    assert ("compute", "expert local", 0.0, 0.5) in first["spans"]
    serial_first = cm.moe_step(1, route=0.0, expert=0.5, all_to_all=0.5, local=0.5)
    assert serial_first["step"] == pytest.approx(1.5) and serial_first["hidden"] == 0.5


def test_moe_best_chunks_trades_hidden_transfer_against_latency():
    fast, _ = cm.moe_best_chunks(1e-3, 10e-3, 2e6, 2, alpha=1e-5, beta=5e-9)
    slow, steps = cm.moe_best_chunks(1e-3, 10e-3, 2e6, 2, alpha=3e-3, beta=5e-9)
    assert fast > slow >= 1 and steps[slow] == min(steps.values())


def _fsdp(prefetch, **kw):
    # four units: forward 10 ms, backward 20 ms, 4 MB each; 2 ranks on a link where one
    # unit's AllGather takes 8.1 ms (100 µs + 2 MB at 0.25 GB/s)
    units = [(0.010, 0.020, 4e6)] * 4
    return cm.fsdp_step(units, 2, 100e-6, 1 / 0.25e9, prefetch, **kw)


def test_fsdp_step_without_prefetch_waits_for_every_forward_all_gather():
    plain = _fsdp("none")
    assert plain["forward_wait"] == pytest.approx(4 * 8.1e-3)
    assert _fsdp("implicit")["step"] == plain["step"]  # a CPU host does not run ahead


def test_fsdp_step_with_explicit_prefetch_waits_only_for_the_first_unit():
    plain, early = _fsdp("none"), _fsdp("explicit")
    assert early["forward_wait"] == pytest.approx(8.1e-3)
    assert early["step"] == pytest.approx(plain["step"] - 3 * 8.1e-3)
    assert 0 < early["hidden_fraction"] <= 1 and early["exposed"] < plain["exposed"]


def test_fsdp_step_on_a_free_link_is_the_compute_alone():
    free = cm.fsdp_step([(0.01, 0.02, 4e6)] * 3, 4, 0.0, 0.0, "explicit")
    assert free["step"] == pytest.approx(free["compute"]) and free["exposed"] == pytest.approx(0)


@pytest.mark.parametrize("kw, units_whole", [
    ({"prefetch_depth": 1}, 2), ({"prefetch_depth": 3}, 4),
    ({"reshard_after_forward": False}, 4), ({"backward_prefetch": False}, 2),
])  # fmt: skip
def test_fsdp_step_holds_as_many_whole_units_as_prefetch_and_resharding_allow(kw, units_whole):
    assert _fsdp("explicit", **kw)["peak_gathered"] == units_whole * 4e6


def test_fsdp_step_adds_a_host_cost_per_all_gather_and_its_own_per_reduce_scatter():
    plain = _fsdp("none")
    slower_gathers = _fsdp("none", per_op=2e-3, per_op_rs=0.0)
    # without prefetch the forward waits through each of its 4 gathers; in backward (which
    # prefetches one unit) only the first re-gather is waited for, the rest sit under a
    # 20 ms backward that has room for 2 ms more
    assert slower_gathers["forward_wait"] == pytest.approx(plain["forward_wait"] + 4 * 2e-3)
    assert slower_gathers["step"] == pytest.approx(plain["step"] + 5 * 2e-3)
    both = _fsdp("none", per_op=2e-3)  # per_op_rs defaults to per_op
    assert both["comm"] == pytest.approx(plain["comm"] + 12 * 2e-3)
