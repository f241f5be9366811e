"""The exercise checks pass a right answer and say precisely what is wrong with a wrong one."""

from __future__ import annotations

import contextlib
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import all_reduce as early_bound_all_reduce

import overlapkit as ok
from overlapkit.grading import traffic

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")


def _ring_over(tensor, bounds, mistake=None):
    """A learner-style ring AllReduce on ok.p2p over the given chunk bounds, with an
    optional planted ``mistake`` (as learners make them)."""
    me, world = dist.get_rank(), dist.get_world_size()
    flat, right, left = tensor.view(-1), (me + 1) % world, (me - 1) % world
    isend, irecv = ok.p2p.isend, ok.p2p.irecv
    if mistake == "torch p2p":
        isend, irecv = dist.isend, dist.irecv

    def step(send, recv):
        tmp = torch.empty(recv[1] - recv[0])
        reqs = []
        if send[1] > send[0] or mistake != "skip empty on the sender only":
            reqs.append(isend(flat[send[0] : send[1]].clone(), right))
        reqs.append(irecv(tmp, left))
        for q in reqs[:1] if mistake == "wait on the first handle only" else reqs:
            q.wait()
        return tmp

    for k in range(world - 1):  # reduce-scatter
        back = 1 if mistake == "receive chunk r-k-1" else 2
        recv = bounds[(me - k - back) % world]
        got = step(bounds[(me - k - 1) % world], recv)
        if mistake == "receive without adding":
            flat[recv[0] : recv[1]] = got
        else:
            flat[recv[0] : recv[1]] += got
    for k in range(world - 1):  # all-gather
        recv = bounds[(me - k - 1) % world]
        flat[recv[0] : recv[1]] = step(bounds[(me - k) % world], recv)


def student_ring(tensor, mistake=None):
    """Uneven chunks handled: sizes differ by at most one element."""
    bounds = ok.collectives.chunk_bounds(tensor.numel(), dist.get_world_size())
    _ring_over(tensor, bounds, mistake)


def assumes_divisible(tensor):
    """Chunks of numel // world: the last elements are never reduced when it does not divide."""
    world = dist.get_world_size()
    n = tensor.numel() // world
    _ring_over(tensor, [(i * n, (i + 1) * n) for i in range(world)])


def uses_builtin(tensor):
    dist.all_reduce(tensor)


def uses_the_kit(tensor):
    ok.ring_all_reduce(tensor, check=False)


def returns_a_copy(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    return out


def blocking_sends_first(tensor):
    """Everybody sends first with a blocking send: a deadlock for large enough messages."""
    me, world = dist.get_rank(), dist.get_world_size()
    big = torch.zeros(8 << 20)
    dist.send(big, (me + 1) % world)
    dist.recv(big, (me - 1) % world)


def not_done(tensor):
    raise NotImplementedError


def test_a_correct_from_scratch_ring_passes_on_2_3_and_4_ranks():
    report = ok.grading.check_all_reduce(student_ring)
    assert report.all_passed and report.total == 3, report.cases


def test_a_ring_that_assumes_divisible_sizes_is_told_which_rank_and_chunk_differ():
    report = ok.grading.check_all_reduce(assumes_divisible, world_sizes=(3,))
    ((passed, message),) = report.cases
    assert not passed
    # 12 elements pass; 1031 = 3 × 343 + 2: the last two elements are never reduced
    # the inputs are drawn per run; rank 1's and 2's parts are missing in every element
    assert re.match(
        r"3 ranks, a tensor of 1031 elements: rank 0, chunk 2 \(elements 688-1030\) differs "
        r"first at element 1029: expected -?\d+, got -?\d+\.",
        message,
    ), message
    assert "chunks must cover every element" in message


def _mistake(mistake):
    def ring(tensor):
        student_ring(tensor, mistake)

    return ring


@pytest.mark.parametrize(
    "mistake, world, expected",
    [
        # 2 ranks, 8 elements: rank 0 adds rank 1's chunk into the chunk it sends
        ("receive chunk r-k-1", 2, "It holds x0 (xr: rank r's input there), not x0 + x1: "
                                   "this rank's own input, untouched"),
        # 3 ranks: the evenly divisible case, reported first, says more than a size error
        ("receive chunk r-k-1", 3, "12 elements: rank 0, chunk 0 (elements 0-3) differs first "
                                   "at element 0: expected "),
        ("receive without adding", 3, "one rank's values only. Either a received chunk "
                                      "replaced the local one instead of being added to it"),
        ("skip empty on the sender only", 3, "on a tensor of 2 elements: rank 1 posted a receive "
                                             "of 0 bytes"),
        ("skip empty on the sender only", 3, "an empty chunk must be skipped by both ends or "
                                             "by neither"),
        ("wait on the first handle only", 2, "never waited on 2 handle(s), first receive of"),
        ("torch p2p", 2, "rank 0 used torch.distributed.irecv, torch.distributed.isend: send "
                         "and receive with ok.p2p"),
    ],
)  # fmt: skip
def test_each_typical_ring_mistake_is_named_by_the_check(mistake, world, expected):
    start = time.monotonic()
    report = ok.grading.check_all_reduce(_mistake(mistake), world_sizes=(world,))
    ((passed, message),) = report.cases
    assert not passed and expected in message, message
    assert "SIGABRT" not in message and time.monotonic() - start < 12


def test_a_rank_that_returns_before_its_unwaited_receive_landed_stays_for_its_peers():
    """A receive posted and never waited is landed by the rank's inbox thread; a rank that
    ended as soon as it returned left its peer's send waiting for a taker, so the check
    named a hang, not the unwaited handle (one CI run in a few, loaded). Here the inbox
    thread of rank 1 is made slow on purpose, so that rank returns first every time."""

    def slow_inbox_then_ring(tensor):
        import threading
        import time as _time

        from overlapkit import p2p

        progress = p2p._SharedInbox.progress

        def late(self, receive=None):  # rank 1's inbox thread lands 0.3 s late
            if threading.current_thread().name == "overlapkit-inbox" and dist.get_rank():
                _time.sleep(0.3)
            progress(self, receive)

        if not hasattr(progress, "late"):  # once: the check calls this for each size
            late.late = True
            p2p._SharedInbox.progress = late
        student_ring(tensor, "wait on the first handle only")

    report = ok.grading.check_all_reduce(slow_inbox_then_ring, world_sizes=(2,))
    ((passed, message),) = report.cases
    assert not passed and "never waited on 2 handle(s), first receive of" in message, message


def test_calling_a_built_in_or_the_kit_collective_fails_a_from_scratch_exercise():
    report = ok.grading.check_all_reduce(uses_builtin, world_sizes=(2,))
    assert report.cases == [
        (False, "rank 0 called all_reduce: build it from send/recv (isend/irecv) only")
    ]
    ((passed, message),) = ok.grading.check_all_reduce(uses_the_kit, world_sizes=(2,)).cases
    # the kit's ring refuses to run while the check watches: its first function is named
    assert not passed and " ran ok.collectives.ring_all_reduce, the kit's own" in message
    assert ok.grading.check_all_reduce(
        uses_builtin, from_scratch=False, world_sizes=(2,)
    ).all_passed


def test_a_result_returned_instead_of_written_in_place_gets_a_hint():
    report = ok.grading.check_all_reduce(returns_a_copy, from_scratch=False, world_sizes=(2,))
    assert "the operation must be in place" in report.cases[0][1]


def test_a_deadlocking_attempt_is_stopped_and_located():
    start = time.monotonic()
    # 10 s: the ranks import this test module (pytest with it) before they reach the line
    # the message must name; beside a CPU hog 3 s were not enough (fresh-clone run 43: the
    # stack was still in iniconfig's import)
    report = ok.grading.check_all_reduce(blocking_sends_first, world_sizes=(2,), timeout=10)
    assert time.monotonic() - start < 40
    ((passed, message),) = report.cases
    assert not passed and "did not finish within 10 s" in message
    assert "dist.send(big, (me + 1) % world)" in message


def test_an_unfinished_exercise_is_reported_as_not_implemented():
    report = ok.grading.check_all_reduce(not_done)
    assert report.cases == [
        (
            False,
            "not_done on 2 ranks: not implemented yet (not_done still raises NotImplementedError)",
        ),
        # the world sizes after it are not reached: each counts as failed
        (False, "not_done on 3 ranks: not reached: the check stops at its first failure (above)"),
        (False, "not_done on 4 ranks: not reached: the check stops at its first failure (above)"),
    ]


def test_reduce_scatter_and_all_gather_checks_accept_the_kit_and_reject_a_shifted_answer():
    assert ok.grading.check_reduce_scatter(ok.ring_reduce_scatter, from_scratch=False).all_passed
    assert ok.grading.check_all_gather(ok.ring_all_gather, from_scratch=False).all_passed

    def off_by_one_rank(output, input):
        ok.ring_all_gather(output, input, check=False)
        output.copy_(output.roll(1))

    report = ok.grading.check_all_gather(off_by_one_rank, from_scratch=False, world_sizes=(3,))
    assert "rank 0, chunk 0" in report.cases[0][1] and "expected" in report.cases[0][1]


def test_recording_counts_a_kit_message_once_and_restores_everything():
    before = (dist.isend, ok.p2p.isend, ok.ring_all_reduce)

    def send_one():
        with traffic.recording() as seen:
            if ok.rank() == 0:
                ok.p2p.send(torch.zeros(10), 1)
            else:
                ok.p2p.recv(torch.zeros(10), 0)
        return seen.sent, seen.received

    (sent0, recv0), (sent1, recv1) = ok.launch(send_one, world_size=2, link=ok.Link(10, 1))
    assert sent0 == [(1, 40)] and recv1 == [(0, 40)] and recv0 == [] and sent1 == []
    assert (dist.isend, ok.p2p.isend, ok.ring_all_reduce) == before


def test_recording_is_not_called_tampered_by_an_operation_still_running_on_a_thread():
    # an async op the learner never waited may still note a call from its thread while
    # the record closes: that is no change to the record. Here the thread is caught
    # between the record's two copies (its first append holds on) as the record closes.
    import threading

    halfway = threading.Event()

    class HoldsOn(list):
        def append(self, value):
            super().append(value)
            halfway.set()
            time.sleep(0.3)

    def one_call():
        with contextlib.suppress(Exception):  # noted, then refused: no group here
            dist.all_reduce(None)

    with traffic.recording() as seen:
        seen.collectives = HoldsOn(seen.collectives)  # the same entries: no change
        thread = threading.Thread(target=one_call)
        thread.start()
        assert halfway.wait(10)
    thread.join()
    assert not seen.tampered
    assert seen.collectives == ["all_reduce"]


def test_bytes_check_tells_total_from_per_rank_and_chunk_from_tensor():
    def total(collective, nbytes, world):
        one_pass = (world - 1) / world * nbytes  # its own count: the kit's would be refused
        return (2 * one_pass if collective == "all_reduce" else one_pass) * world

    def whole_tensor_each_step(collective, nbytes, world):
        return nbytes * (world - 1)

    messages = [m for _, m in ok.grading.check_bytes_moved(total).cases]
    assert "That is the total over all ranks; the question is per rank." in messages[0]
    messages = [m for _, m in ok.grading.check_bytes_moved(whole_tensor_each_step).cases]
    assert "Each step moves one chunk of S/N bytes, not the whole tensor." in messages[0]

    def one_phase_only(collective, nbytes, world):
        return (world - 1) / world * nbytes

    messages = [m for ok_, m in ok.grading.check_bytes_moved(one_phase_only).cases if not ok_]
    assert "That is one phase: an AllReduce is a ReduceScatter and then an AllGather" in messages[0]


def zero1_right(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    ok.ring_reduce_scatter(grad, flat_grads, op="avg")
    shard.grad = grad
    optimizer.step()
    ok.ring_all_gather(flat_params, shard.detach())


def zero1_sums(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    ok.ring_reduce_scatter(grad, flat_grads)  # sum, not average
    shard.grad = grad
    optimizer.step()
    ok.ring_all_gather(flat_params, shard.detach())


def zero1_forgets_to_gather(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    ok.ring_reduce_scatter(grad, flat_grads, op="avg")
    shard.grad = grad
    optimizer.step()


def zero1_own_gradient_only(flat_params, flat_grads, shard, optimizer):
    me, n = ok.rank(), shard.numel()
    shard.grad = flat_grads[me * n : (me + 1) * n].clone()  # no reduce: this rank's batch only
    optimizer.step()
    ok.ring_all_gather(flat_params, shard.detach())


def test_zero1_check_passes_a_right_step_and_locates_wrong_ones():
    assert ok.grading.check_zero1_step(zero1_right).all_passed
    (passed, message), _ = ok.grading.check_zero1_step(zero1_sums).cases
    assert not passed and message.startswith("after step 1")
    assert "about N = 3: the gradients were summed, not averaged" in message
    (passed, message), _ = ok.grading.check_zero1_step(zero1_forgets_to_gather).cases
    assert not passed and "the updated shard never reached this rank" in message
    (passed, message), _ = ok.grading.check_zero1_step(zero1_own_gradient_only).cases
    assert not passed and "after step 1" in message and "× the right one" in message


# ---------------------------------------------------------------- lab 02: naive AllReduce


def _naive(tensor, mistake=None):
    """A learner-style master-worker AllReduce on ok.p2p, with an optional planted mistake."""
    me, world = dist.get_rank(), dist.get_world_size()
    if me == 0:
        bufs = [torch.empty_like(tensor) for _ in range(1, world)]
        if mistake == "one receive buffer for all":
            bufs = [bufs[0]] * (world - 1)
        ok.p2p.wait_all([ok.p2p.irecv(b, src) for src, b in enumerate(bufs, start=1)])
        if mistake == "root forgets its own value":
            tensor.zero_()
        for b in bufs if mistake != "one receive buffer for all" else bufs[:1]:
            tensor += b
        if mistake != "root never sends back":
            ok.p2p.wait_all([ok.p2p.isend(tensor, dst) for dst in range(1, world)])
    else:
        if mistake == "receive before sending":
            ok.p2p.recv(tensor, 0)
        ok.p2p.send(tensor, 0)
        if mistake not in ("root never sends back", "receive before sending"):
            ok.p2p.recv(tensor, 0)


def _naive_mistake(mistake):
    def naive_all_reduce(tensor):
        _naive(tensor, mistake)

    return naive_all_reduce


def test_a_right_naive_all_reduce_passes():
    assert ok.grading.check_all_reduce(_naive_mistake(None)).all_passed


@pytest.mark.parametrize(
    "mistake, expected",
    [
        ("root never sends back", "rank 1, chunk 0 (elements 0-3) differs first at element 0: "
                                  "expected "),
        ("root never sends back", "The whole tensor is exactly this rank's input"),
        ("root forgets its own value", "It holds x1 + x2 (xr: rank r's input there), not "
                                       "x0 + x1 + x2: rank(s) [0] missing"),
        # both receives land in one buffer: whichever lands last wins, rank 1's or rank 2's
        ("one receive buffer for all", "missing. Every rank's values must be added exactly once"),
        ("receive before sending", "did not finish within 20 s"),
    ],
)  # fmt: skip
def test_each_typical_naive_mistake_is_named_by_the_check(mistake, expected):
    start = time.monotonic()
    report = ok.grading.check_all_reduce(_naive_mistake(mistake), world_sizes=(3,))
    ((passed, message),) = report.cases
    assert not passed and expected in message, message
    assert time.monotonic() - start < 30


# ---------------------------------------------------------------- lab 01: RS + AG = AR


def rs_then_ag(tensor, mistake=None):
    """AllReduce = ring ReduceScatter + ring AllGather (lab 01), with a planted mistake."""
    world = dist.get_world_size()
    flat = tensor.view(-1)
    n = -(-flat.numel() // world)
    padded = torch.zeros(n * world)
    padded[: flat.numel()] = flat
    shard = torch.empty(n)
    ok.ring_reduce_scatter(shard, padded)
    if mistake == "gather the input shard":
        shard = padded[dist.get_rank() * n : (dist.get_rank() + 1) * n].clone()
    if mistake != "no all-gather":
        ok.ring_all_gather(padded, shard)
    if mistake == "average instead of sum":
        padded /= world
    flat.copy_(padded[: flat.numel()])


@pytest.mark.parametrize(
    "mistake, expected",
    [
        (None, None),
        ("no all-gather", "differs first"),
        ("gather the input shard", "It holds x0 (xr: rank r's input there)"),
        ("average instead of sum", "differs first"),
    ],
)
def test_rs_plus_ag_exercise_mistakes_are_located(mistake, expected):
    def all_reduce_via_rs_ag(tensor):
        rs_then_ag(tensor, mistake)

    report = ok.grading.check_all_reduce(all_reduce_via_rs_ag, from_scratch=False, world_sizes=(3,))
    if expected is None:
        assert report.all_passed, report.cases
    else:
        ((passed, message),) = report.cases
        assert not passed and expected in message, message


def blocking_send_then_recv(tensor):
    """Section 1's deadlock inside the ring: each rank sends (blocking) before receiving."""
    me, world = dist.get_rank(), dist.get_world_size()
    bounds = ok.collectives.chunk_bounds(tensor.numel(), world)
    flat, right, left = tensor.view(-1), (me + 1) % world, (me - 1) % world
    for k in range(world - 1):
        s, r = bounds[(me - k - 1) % world], bounds[(me - k - 2) % world]
        tmp = torch.empty(r[1] - r[0])
        ok.p2p.send(flat[s[0] : s[1]], right)
        ok.p2p.recv(tmp, left)
        flat[r[0] : r[1]] += tmp


def neighbour_without_mod(tensor):
    me = dist.get_rank()
    ok.p2p.send(tensor, me + 1)  # rank N-1 sends to rank N, which does not exist


def test_blocking_sends_deadlock_in_the_check_as_on_a_real_transport_and_are_named():
    start = time.monotonic()
    report = ok.grading.check_all_reduce(blocking_send_then_recv, world_sizes=(2,))
    ((passed, message),) = report.cases
    assert not passed and "did not finish within 20 s" in message
    assert "ok.p2p.send(flat[s[0] : s[1]], right)" in message  # the learner's line, not the kit's
    assert "Every rank is blocked in a send that waits for its receiver" in message
    assert time.monotonic() - start < 30


def test_a_neighbour_outside_the_world_is_an_error_at_once():
    start = time.monotonic()
    report = ok.grading.check_all_reduce(neighbour_without_mod, world_sizes=(2,))
    ((passed, message),) = report.cases
    assert not passed and "rank 1 sends to rank 2, but the ranks are 0..1" in message
    assert "(me + 1) % world" in message and time.monotonic() - start < 8


def wait_on_the_receive_before_sending(tensor):
    me, world = dist.get_rank(), dist.get_world_size()
    right, left = (me + 1) % world, (me - 1) % world
    into = torch.empty_like(tensor)
    ok.p2p.irecv(into, left).wait()  # nobody has sent yet: every rank waits here
    ok.p2p.send(tensor, right)


def test_every_rank_waiting_in_a_receive_is_named_with_its_line():
    report = ok.grading.check_all_reduce(wait_on_the_receive_before_sending, world_sizes=(2,))
    ((passed, message),) = report.cases
    assert "ok.p2p.irecv(into, left).wait()" in message
    assert "\nEvery rank waits in a receive, and no rank has posted the send" in message


def all_reduce_bound_by_name(tensor):
    early_bound_all_reduce(tensor)  # `from torch.distributed import all_reduce`, before the check


def test_a_built_in_imported_by_name_before_the_check_is_still_seen():
    report = ok.grading.check_all_reduce(all_reduce_bound_by_name)
    assert not report.all_passed
    assert "called all_reduce" in " ".join(m for _, m in report.cases)


@pytest.mark.parametrize("world", [2, 3])
def test_a_root_that_forgets_its_own_value_gets_master_worker_advice_not_ring_advice(world):
    """Lab 02's check (pattern="root"): the root's own input missing from the sum is told
    so in master-worker terms; the ring's chunks and reduce-scatter are lab 03's."""
    report = ok.grading.check_all_reduce(
        _naive_mistake("root forgets its own value"), pattern="root", world_sizes=(world,)
    )
    ((passed, message),) = report.cases
    assert not passed
    assert "In master-worker the root adds every buffer it received" in message or (
        "the root adds its own values and every buffer it received" in message
    ), message
    assert "reduce-scatter" not in message and "ring" not in message, message


def test_bytes_check_gives_one_mistake_one_hint_on_every_line():
    """Sent and received counted together (twice the figure) was told 'the whole tensor'
    on one line, 'an AllReduce's figure' on three and nothing on two; the whole tensor each
    step was 'the total over all ranks' on its ReduceScatter line."""

    def one_way(collective, nbytes, world):
        return (2 if collective == "all_reduce" else 1) * (world - 1) / world * nbytes

    def both_ways(collective, nbytes, world):
        return 2 * one_way(collective, nbytes, world)

    def whole_tensor_each_step(collective, nbytes, world):
        return nbytes * (world - 1)

    twice = ("That is twice the figure: what a rank sends and what it receives, counted "
             "together. The question counts what each rank sends")  # fmt: skip
    for fn, hint in ((both_ways, twice), (whole_tensor_each_step, "not the whole tensor.")):
        wrong = [m for ok_, m in ok.grading.check_bytes_moved(fn).cases if not ok_]
        assert len(wrong) == 6 and all(m.endswith(".") and hint in m for m in wrong), wrong
        assert not any("AllReduce's figure" in m or "total over all" in m for m in wrong), wrong
