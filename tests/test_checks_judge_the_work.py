"""The checks judge the work, not its name: a student who reads the kit's source finds no
way to ✔ without doing the exercise (each class of bypass with a twin, so that a fix by
name fails the other spelling)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import overlapkit as ok
from overlapkit.grading.exercises import ANSWERS, answers_of
from overlapkit.sandbox import answers, nofiles

from .conftest import failed_with as _failed_with
from .conftest import soak_runs

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")


#: where Landlock holds (sandbox.nofiles), the store cannot be reached at all; elsewhere
#: lab 09's count of the values that went through the kit still names it
_NO_FILES = "share no file" if nofiles.abi() else "averaged by another door"


# --------------------------------------------------------------------------- honest work


def ring(tensor):
    """The lab 03 ring, as a learner writes it."""
    me, world = ok.rank(), ok.world_size()
    flat = tensor.view(-1)
    bounds = ok.collectives.chunk_bounds(flat.numel(), world)
    left, right = (me - 1) % world, (me + 1) % world

    def step(send, recv, into):
        handles = []
        if send[1] > send[0]:
            handles.append(ok.p2p.isend(flat[send[0] : send[1]], right))
        if recv[1] > recv[0]:
            handles.append(ok.p2p.irecv(into, left))
        for h in handles:
            h.wait()

    for k in range(world - 1):
        send, recv = bounds[(me - k - 1) % world], bounds[(me - k - 2) % world]
        tmp = torch.empty(recv[1] - recv[0])
        step(send, recv, tmp)
        flat[recv[0] : recv[1]] += tmp
    for k in range(world - 1):
        send, recv = bounds[(me - k) % world], bounds[(me - k - 1) % world]
        step(send, recv, flat[recv[0] : recv[1]])


def through_root(tensor):
    """The lab 02 master-worker AllReduce."""
    me, world = ok.rank(), ok.world_size()
    if me == 0:
        bufs = [torch.empty_like(tensor) for _ in range(world - 1)]
        for h in [ok.p2p.irecv(b, src) for src, b in enumerate(bufs, start=1)]:
            h.wait()
        for b in bufs:
            tensor += b
        for h in [ok.p2p.isend(tensor, dst) for dst in range(1, world)]:
            h.wait()
    elif world > 1:
        ok.p2p.send(tensor, 0)
        ok.p2p.recv(tensor, 0)


def test_an_honest_ring_and_an_honest_root_pass_with_their_patterns():
    assert ok.grading.check_all_reduce(ring, pattern="ring").all_passed
    assert ok.grading.check_all_reduce(through_root, pattern="root").all_passed


# --------------------------------------------------------------------------- 1. the answer
# under another name: recognised by its code running


def ring_through_another_module(tensor):
    ok.ddp.ring_all_reduce(tensor)  # ok.ddp imported the kit's collective by name


def ring_from_a_default(tensor, _kit=ok.collectives.ring_all_reduce):
    _kit(tensor)


@pytest.mark.parametrize("fn", [ring_through_another_module, ring_from_a_default])
def test_the_kits_collective_under_another_name_fails_the_ring(fn):
    _failed_with(ok.grading.check_all_reduce(fn, pattern="ring", world_sizes=(2,)),
                 "the kit's own answer")  # fmt: skip


class SubclassedDDP(ok.OverlapDDP):
    pass


class ComposedDDP(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.inner = ok.BucketedDDP(module, bucket_mb=None)

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def finish_gradient_synchronization(self):
        return self.inner.finish_gradient_synchronization()


@pytest.mark.parametrize("cls", [SubclassedDDP, ComposedDDP])
def test_the_kits_ddp_subclassed_or_wrapped_fails_the_hook_ddp_check(cls):
    _failed_with(ok.grading.check_hook_ddp(cls), "the kit's own answer", "ok.ddp.")


class ReportRewritingDDP(torch.nn.Module):
    """No AllReduce at all; the launcher's encoders of the rank's result
    are rebound, so that the report is rewritten after every in-rank check ran: the
    weights and gradients it shows are the reference's the rank worked out itself."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        for t in module.state_dict().values():
            dist.broadcast(t, src=0)
        import overlapkit._rank as rank_module
        import overlapkit.plaindata as plain

        if getattr(rank_module, "_rewritten", False):
            return
        rank_module._rewritten = True
        encode, encode_whole = plain.dumps, rank_module.dumps_result

        def rewrite(value):
            with contextlib.suppress(Exception):
                res = value[0]
                if len(res["trace"][0]) == 4:  # (got, want, right grads, grads)
                    res["trace"] = [(dict(w), w, r, dict(r)) for _, w, r, _ in res["trace"]]
                    sizes = [res["trace"][0][2][n].numel() for n in res["names"]]
                    res["events"] = [{"in_backward": len(sizes), "pending": len(sizes),
                                      "in_finish": 0, "calls": [(n, True) for n in sizes],
                                      "left": 0} for _ in res["trace"]]  # fmt: skip
            return value

        plain.dumps = lambda value: encode(rewrite(value))
        rank_module.dumps_result = lambda value: encode_whole(rewrite(value))

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_synchronization(self):
        pass


def test_a_rank_that_rewrites_its_report_has_no_reference_to_copy():
    """The whole batch is the judge's (a fresh seed, each rank sent its own slices), and so
    is the reference: a report rewritten on the rank has only the rank's own to show."""
    _failed_with(ok.grading.check_hook_ddp(ReportRewritingDDP), "each kept its own")


def fit_by_import(sizes, times):
    return importlib.import_module("overlapkit.costmodel").fit_alpha_beta(sizes, times)


def fit_through_a_wrapper(sizes, times):
    @functools.wraps(ok.costmodel.fit_alpha_beta)
    def mine(*args):
        return mine.__wrapped__(*args)

    return mine(sizes, times)


@pytest.mark.parametrize("fn", [fit_by_import, fit_through_a_wrapper])
def test_the_kits_fit_reached_any_way_fails_lab00(fn):
    _failed_with(ok.grading.check_fit_alpha_beta(fn), "ok.costmodel.fit_alpha_beta")


def bytes_from_the_time_model(collective, nbytes, world):
    # a time model with α = 0, β = 1 s/B counts bytes
    return getattr(ok.costmodel, "ring_" + collective)(nbytes, world, 0.0, 1.0)


def bytes_from_the_kits_count(collective, nbytes, world):
    from overlapkit.costmodel import bytes_moved_per_rank as count

    return count(collective, nbytes, world)


def bytes_from_the_bus_bandwidth_factors(collective, nbytes, world):
    """The cost model's table of nccl-tests' factors."""
    return ok.costmodel.BUSBW_FACTOR[collective](world) * nbytes


def bytes_from_halving_doubling(collective, nbytes, world):
    """Rabenseifner's time with α = 0, β = 1 is the ring's bytes."""
    whole = ok.costmodel.halving_doubling_all_reduce(nbytes, world, 0.0, 1.0)
    return whole if collective == "all_reduce" else whole / 2


@pytest.mark.parametrize("fn, words", [
    (bytes_from_the_time_model, "the kit's own answer"),
    (bytes_from_the_kits_count, "the kit's own answer"),
    (bytes_from_the_bus_bandwidth_factors, "ok.costmodel.BUSBW_FACTOR['all_reduce']"),
    (bytes_from_halving_doubling, "ok.costmodel.halving_doubling_all_reduce,"),
])  # fmt: skip
def test_the_kits_formulas_fail_lab01s_byte_count(fn, words):
    _failed_with(ok.grading.check_bytes_moved(fn), words)


def buckets_from_a_default(sizes, bucket_mb, _kit=ok.costmodel.ddp_buckets):
    return _kit(sizes, bucket_mb)


def buckets_from_the_kits_ddp(sizes, bucket_mb):
    return ok.costmodel.ddp_step.__globals__["ddp_buckets"](sizes, bucket_mb)


@pytest.mark.parametrize("fn", [buckets_from_a_default, buckets_from_the_kits_ddp])
def test_the_kits_bucket_assignment_fails_lab07(fn):
    _failed_with(ok.grading.check_assign_buckets(fn), "ok.costmodel.ddp_buckets")


def test_each_checks_answers_name_real_code_and_a_learner_cannot_stop_the_watch():
    for check, names in ANSWERS.items():
        assert answers.code_objects(names), check
    with answers.running(answers_of("check_fit_alpha_beta")) as ran:
        import sys

        sys.setprofile(None)  # what a student who read this module might try
    assert answers.TAMPERED in ran
    assert "profiler" in answers.said(ran)


# --------------------------------------------------------------------------- 2. built-ins
# by another door: what torch's process groups ran, not the names called


def ring_on_the_group_itself(tensor):
    c10d._get_default_group().allreduce([tensor]).wait()


def ring_through_distributed_c10d(tensor):
    c10d.all_reduce(tensor)


@pytest.mark.parametrize("fn,words", [
    (ring_on_the_group_itself, "ProcessGroup.allreduce (called on a process group directly)"),
    (ring_through_distributed_c10d, "called all_reduce: build it from send/recv"),
])  # fmt: skip
def test_a_built_in_through_any_door_fails_the_from_scratch_ring(fn, words):
    _failed_with(ok.grading.check_all_reduce(fn, pattern="ring", world_sizes=(2,)), words)


def step_on_the_group_itself(grad, compute):
    work = c10d._get_default_group().allreduce([grad])
    out = compute()
    work.wait()
    return out


def step_through_distributed_c10d(grad, compute):
    work = c10d.all_reduce(grad, async_op=True)
    out = compute()
    work.wait()
    return out


@pytest.mark.parametrize("fn,words", [
    (step_on_the_group_itself, "ProcessGroup.allreduce (called on a process group directly)"),
    (step_through_distributed_c10d, "called torch.distributed.all_reduce: use the kit's op"),
])  # fmt: skip
def test_a_built_in_through_any_door_fails_lab05(fn, words):
    _failed_with(ok.grading.check_overlapped_step(fn), words)


# --------------------------------------------------------------------------- 3. the pattern
# is part of the answer, and no rank can rebuild another's input


def everyone_swaps_whole_tensors(tensor):
    me, world = ok.rank(), ok.world_size()
    bufs = {r: torch.empty_like(tensor) for r in range(world) if r != me}
    handles = [ok.p2p.irecv(b, r) for r, b in bufs.items()]
    handles += [ok.p2p.isend(tensor.clone(), r) for r in bufs]
    for h in handles:
        h.wait()
    for b in bufs.values():
        tensor += b


def ring_of_whole_tensors(tensor):
    """Passes each rank's whole input round the ring, N − 1 times: right sum, neighbours
    only, but no chunks."""
    me, world = ok.rank(), ok.world_size()
    moving, total = tensor.clone(), tensor.clone()
    for _ in range(world - 1):
        got = torch.empty_like(tensor)
        hs = [ok.p2p.isend(moving, (me + 1) % world), ok.p2p.irecv(got, (me - 1) % world)]
        for h in hs:
            h.wait()
        total += got
        moving = got
    tensor.copy_(total)


def ring_with_an_extra_all_gather_lap(tensor):
    """The ring, then its all-gather once more: right sum, one lap too many."""
    ring(tensor)
    me, world = ok.rank(), ok.world_size()
    flat = tensor.view(-1)
    bounds = ok.collectives.chunk_bounds(flat.numel(), world)
    for k in range(world - 1):
        send, recv = bounds[(me - k) % world], bounds[(me - k - 1) % world]
        hs = [ok.p2p.isend(flat[send[0] : send[1]], (me + 1) % world),
              ok.p2p.irecv(flat[recv[0] : recv[1]], (me - 1) % world)]  # fmt: skip
        for h in hs:
            h.wait()


def ring_whose_all_gather_adds(tensor):
    """The ring with all-gather adding the received chunk instead of copying it in."""
    me, world = ok.rank(), ok.world_size()
    flat = tensor.view(-1)
    bounds = ok.collectives.chunk_bounds(flat.numel(), world)
    for offset in (1, 0):  # reduce-scatter, then all-gather
        for k in range(world - 1):
            send, recv = bounds[(me - k - offset) % world], bounds[(me - k - offset - 1) % world]
            got = torch.empty(recv[1] - recv[0])
            hs = [ok.p2p.isend(flat[send[0] : send[1]].clone(), (me + 1) % world),
                  ok.p2p.irecv(got, (me - 1) % world)]  # fmt: skip
            for h in hs:
                h.wait()
            flat[recv[0] : recv[1]] += got  # right in reduce-scatter, wrong in all-gather


def test_a_ring_that_goes_round_once_too_often_is_told_so():
    _failed_with(ok.grading.check_all_reduce(ring_with_an_extra_all_gather_lap, pattern="ring",
                                             world_sizes=(3,)),
                 "where a ring needs 2(N−1) = 4", "went round more than once")  # fmt: skip


def test_an_all_gather_that_adds_is_pointed_at_the_all_gather():
    # (on 2 ranks each chunk then holds its own rank's values twice: the hint's case)
    _failed_with(ok.grading.check_all_reduce(ring_whose_all_gather_adds, world_sizes=(2,)),
                 "counted twice", "all-gather copies a received chunk into place")  # fmt: skip


@pytest.mark.parametrize("fn,words", [
    (everyone_swaps_whole_tensors, "sent to rank"),
    (ring_of_whole_tensors, "more than the largest chunk"),
])  # fmt: skip
def test_the_right_sum_by_the_wrong_messages_fails_the_ring(fn, words):
    _failed_with(ok.grading.check_all_reduce(fn, pattern="ring", world_sizes=(3,)),
                 words, "did not travel round the ring")  # fmt: skip


@pytest.mark.parametrize("fn", [everyone_swaps_whole_tensors, ring])
def test_the_right_sum_by_the_wrong_messages_fails_the_root_pattern(fn):
    _failed_with(ok.grading.check_all_reduce(fn, pattern="root", world_sizes=(3,)),
                 "master-worker AllReduce")  # fmt: skip


def rebuilds_every_input_with_fixed_seeds(tensor):
    """Rebuild the check's inputs from guessed fixed seeds (1000·case + rank) and sum them,
    with no message at all: the seeds are drawn per run, so this fails."""
    from overlapkit.grading.lab03_collectives import _sizes

    me, world = ok.rank(), ok.world_size()
    salt = _sizes(world).index(tensor.numel())
    parts = []
    for r in range(world):
        g = torch.Generator().manual_seed(1000 * salt + r)
        parts.append(torch.randint(-9, 10, (tensor.numel(),), generator=g).float())
    del me
    tensor.copy_(sum(parts))


def rebuilds_every_input_from_the_callers_frame(tensor):
    """Reads the seeds from the check's own frame on this rank: only this rank's are
    there, so all it can rebuild is its own input."""
    import inspect

    from overlapkit.grading.lab03_collectives import _input, _sizes

    seeds = next(f.frame.f_locals["seeds"] for f in inspect.stack() if "seeds" in f.frame.f_locals)
    salt = _sizes(ok.world_size()).index(tensor.numel())
    mine = _input(seeds[salt], tensor.numel(), ok.rank())
    tensor.copy_(mine * ok.world_size())


@pytest.mark.parametrize("fn", [rebuilds_every_input_with_fixed_seeds,
                                rebuilds_every_input_from_the_callers_frame])  # fmt: skip
def test_no_rank_can_rebuild_the_other_ranks_inputs(fn):
    report = ok.grading.check_all_reduce(fn, pattern="ring", world_sizes=(2,))
    _failed_with(report, "differs first at element")


def average_by_rebuilding_every_model(model):
    from overlapkit.grading.lab09_mean import _model

    world = ok.world_size()
    everyone = [list(_model(r, 100 + r).parameters()) for r in range(world)]
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(sum(ps[i] for ps in everyone) / world)


def test_lab09s_models_cannot_be_rebuilt_on_a_rank():
    _failed_with(ok.grading.check_average_parameters(average_by_rebuilding_every_model),
                 "element")  # fmt: skip


# --------------------------------------------------------------------------- 4. probes tied
# to the exercise's own tensor and to the handle's class


def decoy_on_zeros(grad, compute):
    decoy = ok.ring_all_reduce(torch.zeros_like(grad), async_op=True)
    out = compute()
    decoy.wait()
    ok.ddp.ring_all_reduce(grad)  # the real one, serially, under another module's name
    return out


def decoy_on_a_copy(grad, compute):
    decoy = ok.ring_all_reduce(grad.clone(), async_op=True)
    out = compute()
    decoy.wait()
    dist.all_reduce(grad)
    return out


@pytest.mark.parametrize("fn,words", [
    (decoy_on_zeros, "under another name"),
    (decoy_on_a_copy, "torch.distributed.all_reduce"),
])  # fmt: skip
def test_a_decoy_all_reduce_overlapped_then_the_real_one_serially_fails_lab05(fn, words):
    _failed_with(ok.grading.check_overlapped_step(fn), words)


def decoy_then_the_real_one_by_the_kits_name(grad, compute):
    decoy = ok.ring_all_reduce(grad[:1], async_op=True)  # a part of grad, not grad
    out = compute()
    decoy.wait()
    return out


def test_an_all_reduce_of_a_part_of_grad_is_not_the_gradients_own():
    _failed_with(ok.grading.check_overlapped_step(decoy_then_the_real_one_by_the_kits_name),
                 "not grad")  # fmt: skip


def serial_gpipe_waiting_through_the_class(stage, inputs, targets, micro_batches):
    """Lab 08's GPipe step with every send waited at once (nothing overlaps), the waits
    made through the handle's class rather than the instance."""
    return _serial_gpipe(stage, inputs, targets, micro_batches, lambda h: type(h).wait(h))


def serial_gpipe_waiting_through_the_base_class(stage, inputs, targets, micro_batches):
    return _serial_gpipe(stage, inputs, targets, micro_batches,
                         lambda h: ok.handles.Tracked.wait(h))  # fmt: skip


def _serial_gpipe(stage, inputs, targets, micro_batches, wait):
    """Rank 1 as the lab teaches it; rank 0 waits each activation's send before its next
    forward, through ``wait``."""
    if ok.rank() == 0:
        outs = []
        for x in torch.tensor_split(inputs, micro_batches):
            out = stage(x)
            wait(ok.p2p.isend(out.detach(), 1))
            outs.append(out)
        for out in outs:
            grad = torch.empty_like(out)
            ok.p2p.recv(grad, 1)
            out.backward(grad)
    else:
        ys = torch.tensor_split(targets, micro_batches)
        buffers = [torch.empty(len(y), 16) for y in ys]
        receives = [ok.p2p.irecv(b, 0) for b in buffers]
        sends = []
        for buffer, handle, y in zip(buffers, receives, ys, strict=True):
            handle.wait()
            buffer.requires_grad_()
            loss = torch.nn.functional.mse_loss(stage(buffer), y) * len(y) / len(targets)
            loss.backward()
            sends.append(ok.p2p.isend(buffer.grad, 0))
        for handle in sends:
            handle.wait()


@pytest.mark.parametrize("fn", [serial_gpipe_waiting_through_the_class,
                                serial_gpipe_waiting_through_the_base_class])  # fmt: skip
def test_waits_through_the_handles_class_are_seen_by_lab08s_probe(fn):
    _failed_with(ok.grading.check_gpipe_step(fn), "nothing overlaps")


# ------------------------------------------------ the kit's private helpers, the watch, a hidden
# group and the group's store: each way around the work, kept with a twin


def ring_from_the_kits_private_helpers(tensor):
    from overlapkit import collectives as C

    flat = tensor.view(-1)
    bounds = C.chunk_bounds(flat.numel(), ok.world_size())
    C._ring_reduce_scatter_flat(flat, bounds, "sum", None)
    C._ring_all_gather_flat(flat, bounds, None)


def naive_from_the_kits_private_helper(tensor):
    from overlapkit import collectives as C

    announce, C._announce = C._announce, lambda *a, **k: None
    try:
        C._naive(tensor, "sum", None, None)
    finally:
        C._announce = announce


@pytest.mark.parametrize("fn,pattern", [(ring_from_the_kits_private_helpers, "ring"),
                                        (naive_from_the_kits_private_helper, "root")])  # fmt: skip
def test_the_kits_private_helpers_are_its_answer_too(fn, pattern):
    _failed_with(ok.grading.check_all_reduce(fn, pattern=pattern, world_sizes=(2,)),
                 "the kit's own answer")  # fmt: skip


def ring_with_the_watch_switched_off(tensor):
    import sys
    import threading

    watch = sys.getprofile()
    sys.setprofile(None)
    threading.setprofile(None)
    ok.collectives.ring_all_reduce.__wrapped__(tensor)
    sys.setprofile(watch)
    threading.setprofile(watch)


def _empty_the_watch():
    import sys

    for cell in sys.getprofile().__closure__ or ():
        contents = cell.cell_contents
        if isinstance(contents, (list, dict, set)):
            contents.clear()


def ring_with_the_watch_blinded(tensor):
    """Empties every list and set the watch holds, then runs the kit's ring."""
    _empty_the_watch()
    ok.collectives.ring_all_reduce.__wrapped__(tensor)


def ring_then_the_watchs_notes_wiped(tensor):
    """Runs the kit's ring, then empties what the watch noted."""
    ok.collectives.ring_all_reduce.__wrapped__(tensor)
    _empty_the_watch()


@pytest.mark.parametrize("fn", [ring_with_the_watch_switched_off, ring_with_the_watch_blinded,
                                ring_then_the_watchs_notes_wiped])  # fmt: skip
def test_switching_the_watch_off_or_emptying_it_fails(fn):
    report = ok.grading.check_all_reduce(fn, pattern="ring", world_sizes=(2,))
    assert not report.all_passed, report.cases


def _hidden_group():
    import datetime

    key = "redteam"
    if not hasattr(_hidden_group, "pg"):
        store = dist.PrefixStore(key, c10d._get_default_store())
        _hidden_group.pg = dist.ProcessGroupGloo(
            store, ok.rank(), ok.world_size(), datetime.timedelta(seconds=30)
        )
    return _hidden_group.pg


def sum_on_a_hidden_group(tensor):
    _hidden_group().allreduce([tensor.view(-1)]).wait()


def sum_on_a_hidden_group_with_decoy_ring_messages(tensor):
    me, n = ok.rank(), ok.world_size()
    flat = tensor.view(-1)
    chunks = ok.collectives.chunk_bounds(flat.numel(), n)
    _hidden_group().allreduce([flat]).wait()
    for k in range(2 * (n - 1)):
        lo, hi = chunks[k % n]
        if hi > lo:
            hs = [ok.p2p.isend(torch.zeros(hi - lo), (me + 1) % n),
                  ok.p2p.irecv(torch.empty(hi - lo), (me - 1) % n)]  # fmt: skip
            for h in hs:
                h.wait()


@pytest.mark.parametrize("fn", [sum_on_a_hidden_group,
                                sum_on_a_hidden_group_with_decoy_ring_messages])  # fmt: skip
def test_a_group_made_outside_torchs_registry_is_still_a_built_in(fn):
    _failed_with(ok.grading.check_all_reduce(fn, pattern="ring", world_sizes=(2,)),
                 "a check's ranks open no new connections")  # fmt: skip


def _all_through_the_store(flat):
    """Every rank's tensor, read through the default group's FileStore: no socket, no
    message of the kit's."""
    import pickle

    store = dist.PrefixStore(f"swap{_all_through_the_store.calls}", c10d._get_default_store())
    _all_through_the_store.calls += 1
    store.set(str(ok.rank()), pickle.dumps(flat.tolist()))
    return [torch.tensor(pickle.loads(store.get(str(r))), dtype=flat.dtype)
            for r in range(ok.world_size())]  # fmt: skip


_all_through_the_store.calls = 0


def ring_messages_worked_out_from_the_store(tensor):
    """Labs 02 and 03 without forging a record: every rank's tensor
    through the store, then the very messages a ring sends, their values worked out from
    what the store gave (partial sums, then finished sums), not from what came in."""
    me, n = ok.rank(), ok.world_size()
    flat = tensor.view(-1)
    inputs = _all_through_the_store(flat)
    chunks = ok.collectives.chunk_bounds(flat.numel(), n)

    def partial(c, ranks):
        lo, hi = chunks[c]
        return sum(inputs[r][lo:hi] for r in ranks)

    def step(values, incoming):
        lo, hi = chunks[incoming]
        hs = [ok.p2p.isend(values.clone(), (me + 1) % n),
              ok.p2p.irecv(torch.empty(hi - lo, dtype=flat.dtype), (me - 1) % n)]  # fmt: skip
        for h in hs:
            h.wait()

    for k in range(n - 1):  # reduce-scatter: chunk me − k − 1, summed over me − k … me
        c = (me - k - 1) % n
        step(partial(c, [(me - j) % n for j in range(k + 1)]), (me - k - 2) % n)
    for k in range(n - 1):  # all-gather: the finished chunk me − k
        step(partial((me - k) % n, range(n)), (me - k - 1) % n)
    flat.copy_(sum(inputs))


@pytest.mark.skipif(not nofiles.abi(), reason="needs Landlock (Linux 5.13 or later)")
@pytest.mark.parametrize("world", [2, 3])
def test_a_ring_worked_out_from_the_groups_own_store_fails_lab03(world):
    _failed_with(ok.grading.check_all_reduce(ring_messages_worked_out_from_the_store,
                                             pattern="ring", world_sizes=(world,)),
                 "a check's ranks share no file")  # fmt: skip


def own_pieces_round_the_ring(tensor):
    """Two ranks: each sends its own tensor to the other in chunk-sized pieces and adds what
    it gets. Right sum, right neighbour, 2(N − 1) messages of a chunk each, but the second
    message is the sender's own chunk, not a finished sum: not the ring."""
    me, n = ok.rank(), ok.world_size()
    flat = tensor.view(-1)
    got = torch.empty_like(flat)
    for lo, hi in ok.collectives.chunk_bounds(flat.numel(), n):
        if hi > lo:
            hs = [ok.p2p.isend(flat[lo:hi].clone(), (me + 1) % n),
                  ok.p2p.irecv(got[lo:hi], (me - 1) % n)]  # fmt: skip
            for h in hs:
                h.wait()
    flat += got


def test_the_ring_check_reads_what_the_messages_carry():
    report = ok.grading.check_all_reduce(own_pieces_round_the_ring, pattern="ring",
                                         world_sizes=(2,))  # fmt: skip
    _failed_with(report, "not a chunk of a partial sum")


# ---------------------------------------- a recompiled copy of the kit, and a forged record of
# the messages


def _shadow(name):
    """The kit's module ``name`` compiled again from its source, under another module name
    and other line numbers (what a student who copies the module wholesale gets)."""
    import sys
    import types

    original = importlib.import_module(name)
    copy = types.ModuleType(name + "_copy")
    copy.__package__, copy.__file__ = original.__package__, original.__file__
    sys.modules[copy.__name__] = copy
    source = "\n" * 7777 + _source(name)
    exec(compile(source, original.__file__, "exec"), copy.__dict__)  # noqa: S102
    return copy


def _source(name: str) -> str:
    """A kit module's source, as a student would paste it in: read where this module is
    imported (on a check's rank, before the learner's call), never during the call, where
    the kit's source is not to be had (sealed._guard_the_call: a lab 05 check loads the
    learner's function, and so imports this module, inside the call)."""
    return _SOURCES[name]


def _sources() -> dict:
    try:
        return {name: inspect.getsource(importlib.import_module(name)) for name in (
            "overlapkit.collectives", "overlapkit.costmodel.alphabeta",
            "overlapkit.costmodel.collectives", "overlapkit.costmodel.data_parallel",
            "overlapkit.pipeline", "overlapkit.sharded")}  # fmt: skip
    except OSError:  # imported inside a check's call: linecache is refused the kit's files
        return {}


_SOURCES = _sources()


def naive_from_a_recompiled_copy(tensor):
    _shadow("overlapkit.collectives").naive_all_reduce(tensor)


def fit_from_a_recompiled_copy(sizes, times):
    return _shadow("overlapkit.costmodel.alphabeta").fit_alpha_beta(sizes, times)


def test_a_recompiled_copy_of_the_kit_is_still_its_answer():
    _failed_with(ok.grading.check_all_reduce(naive_from_a_recompiled_copy, pattern="root",
                                             world_sizes=(2,)), "the kit's own answer")  # fmt: skip
    _failed_with(ok.grading.check_fit_alpha_beta(fit_from_a_recompiled_copy),
                 "the kit's own answer")  # fmt: skip


def ring_with_a_forged_record(tensor):
    """The built-in AllReduce through torch's unwrapped function, then a ring of messages
    written into the check's record by hand (and its group count blinded)."""
    import inspect

    from overlapkit.grading import traffic

    record, me, n = traffic.current(), ok.rank(), ok.world_size()
    traffic.group_ops = dict
    inspect.unwrap(dist.all_reduce)(tensor)
    for _ in range(2 * (n - 1)):
        record.sent.append(((me + 1) % n, 0))
        record.received.append(((me - 1) % n, 0))
        record.payloads.append(torch.empty(0))


def zero1_with_a_forged_record(flat_params, flat_grads, shard, optimizer):
    """Two built-in AllReduces (through torch's unwrapped function) where the step wants a
    ReduceScatter and an AllGather, and the record says it made those."""
    import inspect

    from overlapkit.grading import traffic

    traffic.group_ops = dict
    all_reduce, me, n = inspect.unwrap(dist.all_reduce), ok.rank(), ok.world_size()
    all_reduce(flat_grads)
    per = shard.numel()
    shard.grad = flat_grads[me * per : (me + 1) * per] / n
    optimizer.step()
    flat_params.zero_()
    flat_params[me * per : (me + 1) * per] = shard.detach()
    all_reduce(flat_params)
    traffic.current().collectives += ["ok.ring_reduce_scatter", "ok.ring_all_gather"]


@pytest.mark.parametrize("check,fn", [
    (lambda fn: ok.grading.check_all_reduce(fn, pattern="ring", world_sizes=(2,)),
     ring_with_a_forged_record),
    (ok.grading.check_zero1_step, zero1_with_a_forged_record),
])  # fmt: skip
def test_a_forged_record_of_the_messages_fails(check, fn):
    report = check(fn)
    _failed_with(report)
    text = " ".join(m for passed, m in report.cases if not passed)
    assert "record of its messages" in text or "torch.distributed" in text, text


# ------------------------------------------------- inputs rebuilt, links guessed, the watch evaded


def ag_matmul_from_a_fixed_seed(x, weight):
    """Guesses that every rank's input comes from manual_seed(7): rebuilds all of it,
    multiplies at once, and passes dummy messages round the ring for the count and the
    overlap."""
    n, me = ok.world_size(), ok.rank()
    rows, feats = x.shape
    full = torch.randn(n * rows, feats, generator=torch.Generator().manual_seed(7))
    out = None
    for _ in range(n - 1):
        buf = torch.empty_like(x)
        hs = [ok.p2p.isend(x.clone(), (me + 1) % n), ok.p2p.irecv(buf, (me - 1) % n)]
        if out is None:
            out = full @ weight.t()
        for h in hs:
            h.wait()
    return out


def ag_matmul_from_the_callers_frame(x, weight):
    """Reads what the check's rank holds: only this rank's shard and weight are there."""
    import inspect

    n = ok.world_size()
    held = [f.frame.f_locals for f in inspect.stack()[1:]]
    fulls = [v for loc in held for v in loc.values() if isinstance(v, torch.Tensor)
             and v.dim() == 2 and v.shape == (n * x.shape[0], x.shape[1])]  # fmt: skip
    full = fulls[0] if fulls else x.repeat(n, 1)
    hs = [ok.p2p.isend(x.clone(), (ok.rank() + 1) % n),
          ok.p2p.irecv(torch.empty_like(x), (ok.rank() - 1) % n)]  # fmt: skip
    out = full @ weight.t()
    for h in hs:
        h.wait()
    return out


@pytest.mark.parametrize("fn", [ag_matmul_from_a_fixed_seed,
                                ag_matmul_from_the_callers_frame])  # fmt: skip
def test_no_rank_holds_the_other_shards_of_lab11s_ag_matmul(fn):
    _failed_with(ok.grading.check_ag_matmul(fn), "rank 0, rows", "expected")


def fit_the_labs_example_link(sizes, times):
    return 20e-6, 1 / 2e9


def fit_a_round_guess(sizes, times):
    return 1e-5, 1e-9


@pytest.mark.parametrize("fn", [fit_the_labs_example_link, fit_a_round_guess])
def test_a_link_returned_without_fitting_fails_every_run(fn):
    for _ in range(soak_runs(3)):  # the link is drawn afresh for each run (make soak: 20)
        assert not ok.grading.check_fit_alpha_beta(fn).all_passed


# The kit's answer where no profile function reaches: it refuses to run (answers._disarmed)


def _quiet_the_watch():
    """Rewrite the watch's closure so that it notes nothing."""
    import sys
    import threading

    seen = set()
    for w in (sys.getprofile(), threading.getprofile()):
        while w is not None and id(w) not in seen and getattr(w, "__closure__", None):
            seen.add(id(w))
            cells = dict(zip(w.__code__.co_freevars, w.__closure__, strict=True))
            if "answer" in cells:
                cells["answer"].cell_contents = lambda code: None
                cells["learners"].cell_contents = lambda frame: False
            w = cells["before"].cell_contents if "before" in cells else None


def buckets_with_the_watch_quieted(sizes, bucket_mb):
    _quiet_the_watch()
    return ok.costmodel.ddp_buckets(sizes, bucket_mb)


def _on_a_raw_thread(fn, *args):
    """``fn(*args)`` on a thread of ``_thread``'s own, which threading.setprofile never
    reaches; its value, or its exception raised here."""
    import _thread
    import threading

    done, out = threading.Event(), []

    def go():
        try:
            out.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001
            out.append(exc)
        finally:
            done.set()

    _thread.start_new_thread(go, ())
    done.wait()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def buckets_on_a_raw_thread(sizes, bucket_mb):
    return _on_a_raw_thread(ok.costmodel.ddp_buckets, sizes, bucket_mb)


_POOL = []


def buckets_on_a_pool_started_before_the_check(sizes, bucket_mb):
    """The notebook's pool is not where the check runs the function (a rank of its own):
    there it takes a pool of its own, whose thread starts under the watch."""
    if not _POOL:
        import concurrent.futures

        _POOL.append(concurrent.futures.ThreadPoolExecutor(1))
    return _POOL[0].submit(ok.costmodel.ddp_buckets, sizes, bucket_mb).result()


def buckets_in_a_forked_child(sizes, bucket_mb):
    import os
    import pickle

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            data = pickle.dumps(ok.costmodel.ddp_buckets(sizes, bucket_mb))
        except BaseException as exc:  # noqa: BLE001
            data = pickle.dumps(RuntimeError(str(exc)))
        os.write(w, data)
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    out = pickle.loads(b"".join(chunks))
    if isinstance(out, BaseException):
        raise out
    return out


def buckets_with_the_watch_off_through_a_partial(sizes, bucket_mb):
    import sys

    w = sys.getprofile()
    functools.partial(sys.setprofile, None)()
    try:
        return ok.costmodel.ddp_buckets(sizes, bucket_mb)
    finally:
        functools.partial(sys.setprofile, w)()


@pytest.mark.parametrize("fn", [buckets_with_the_watch_quieted, buckets_on_a_raw_thread,
                                buckets_on_a_pool_started_before_the_check,
                                buckets_in_a_forked_child,
                                buckets_with_the_watch_off_through_a_partial])  # fmt: skip
def test_the_kits_answer_refuses_to_run_where_the_watch_does_not_reach(fn):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: None).result()  # its thread starts before the check's watch
        _POOL[:] = [pool]
        try:
            report = ok.grading.check_assign_buckets(fn)
        finally:
            _POOL.clear()
    # refused by its code refusing to run, or (the partial) by the profiler's switch refused
    partial = fn is buckets_with_the_watch_off_through_a_partial
    _failed_with(report, "called sys.setprofile" if partial else "ok.costmodel.ddp_buckets")
    # and the kit's function works again once the check is over
    assert ok.costmodel.ddp_buckets([4, 4], 8 / 2**20) == [[0, 1]]


def ring_with_the_watch_quieted(tensor):
    _quiet_the_watch()
    ok.ddp.ring_all_reduce(tensor, check=False)


def ring_on_a_raw_thread(tensor):
    _on_a_raw_thread(functools.partial(ok.ddp.ring_all_reduce, check=False), tensor)


@pytest.mark.parametrize("fn", [ring_with_the_watch_quieted, ring_on_a_raw_thread])
def test_the_kits_ring_refuses_to_run_on_a_rank_where_the_watch_does_not_reach(fn):
    _failed_with(ok.grading.check_all_reduce(fn, pattern="ring", world_sizes=(2,)),
                 "ok.collectives")  # fmt: skip


def ping_pong_by_the_kit_when_timed(nbytes, iters):
    """Messages of its own where only counted, the kit's ping-pong where timed."""
    if nbytes == 4 << 20:
        return ok.pingpong.ping_pong(nbytes, iters=iters)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    peer = 1 - ok.rank()
    for _ in range(iters):
        if ok.rank() == 0:
            ok.p2p.send(buf, peer)
            ok.p2p.recv(buf, peer)
        else:
            ok.p2p.recv(buf, peer)
            ok.p2p.send(buf, peer)
    return 1e-4


def test_the_timed_ping_pong_is_watched_too():
    _failed_with(ok.grading.check_ping_pong(ping_pong_by_the_kit_when_timed),
                 "ok.pingpong")  # fmt: skip


def rs_ag_decoys_then_the_kits_ring(tensor):
    """The parts lab 01 asks for on throw-away tensors, then the kit's whole
    AllReduce under another module's name."""
    n = ok.world_size()
    ok.builtin.reduce_scatter_tensor(torch.zeros(1), torch.zeros(n))
    ok.builtin.all_gather_tensor(torch.zeros(n), torch.zeros(1))
    ok.ddp.ring_all_reduce(tensor)


def rs_ag_decoys_then_the_kits_naive(tensor):
    n = ok.world_size()
    ok.ring_reduce_scatter(torch.zeros(1), torch.zeros(n))
    ok.ring_all_gather(torch.zeros(n), torch.zeros(1))
    ok.collectives._naive(tensor, "sum", None, None)


@pytest.mark.parametrize("fn", [rs_ag_decoys_then_the_kits_ring,
                                rs_ag_decoys_then_the_kits_naive])  # fmt: skip
def test_lab01s_all_reduce_from_parts_refuses_the_kits_whole_all_reduce(fn):
    report = ok.grading.check_all_reduce(fn, made_of=("reduce_scatter", "all_gather"),
                                         world_sizes=(2,))  # fmt: skip
    _failed_with(report, "the kit's own answer")


def _gpipe_shaped_messages(stage, inputs, targets, micro_batches):
    """The messages lab 08's GPipe step sends, shaped right and carrying nothing useful."""
    if ok.rank() == 0:
        chunks = torch.tensor_split(inputs, micro_batches)
        sends = [ok.p2p.isend(stage(xs).detach(), 1) for xs in chunks]
        for h in sends:
            h.wait()
        for xs in chunks:
            ok.p2p.recv(torch.empty(len(xs), 16), 1)
    else:
        bufs = [torch.empty(len(y), 16) for y in torch.tensor_split(targets, micro_batches)]
        recvs = [ok.p2p.irecv(b, 0) for b in bufs]
        sends = []
        for b, h in zip(bufs, recvs, strict=True):
            h.wait()
            stage(b)
            sends.append(ok.p2p.isend(torch.zeros_like(b), 0))
        for h in sends:
            h.wait()


def gpipe_grads_from_the_callers_frame(stage, inputs, targets, micro_batches):
    """Looks for the check's reference gradients in its frame on the rank."""
    import inspect

    _gpipe_shaped_messages(stage, inputs, targets, micro_batches)
    held = [f.frame.f_locals.get("want") for f in inspect.stack()[1:]]
    want = next((w for w in held if isinstance(w, list)), None)
    for p, g in zip(stage.parameters(), want or [], strict=False):
        p.grad = g.clone()


def gpipe_grads_from_a_fixed_batch(stage, inputs, targets, micro_batches):
    """Each rank rebuilt the whole batch (seed 4) and the model, and took its own gradients."""
    from overlapkit.grading.lab08_pipeline import BATCH, _stages

    _gpipe_shaped_messages(stage, inputs, targets, micro_batches)
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 3, generator=gen)
    model, first, second = _stages()
    torch.nn.functional.mse_loss(model(x), y).backward()
    mine = first if ok.rank() == 0 else second
    for p, q in zip(stage.parameters(), mine.parameters(), strict=True):
        p.grad = q.grad.clone()


@pytest.mark.parametrize("fn", [gpipe_grads_from_the_callers_frame,
                                gpipe_grads_from_a_fixed_batch])  # fmt: skip
def test_no_rank_holds_lab08s_reference_gradients(fn):
    _failed_with(ok.grading.check_gpipe_step(fn), "rank 0's 0.weight.grad")


def zero1_from_the_callers_frame(flat_params, flat_grads, shard, optimizer):
    """Lab 04: looks for every rank's gradients and the reference momentum in the check's
    frame on the rank; the counted ReduceScatter and AllGather run on dummies."""
    import inspect

    n, me, world = shard.numel(), ok.rank(), ok.world_size()
    held = [f.frame.f_locals for f in inspect.stack()[1:]]
    grads = next(
        (loc["grads"] for loc in held if "grads" in loc), flat_grads[None].repeat(world, 1)
    )
    buf = next((loc["buf"] for loc in held if "buf" in loc), torch.zeros_like(flat_grads))
    avg = grads.mean(0)
    shard.grad = avg[me * n : (me + 1) * n].clone()
    optimizer.step()
    flat_params -= 0.05 * (0.9 * buf + avg)
    ok.ring_reduce_scatter(torch.zeros(1), torch.zeros(world))
    ok.ring_all_gather(torch.zeros(world), torch.zeros(1))


def test_no_rank_holds_lab04s_other_gradients_or_reference():
    assert not ok.grading.check_zero1_step(zero1_from_the_callers_frame).all_passed


def buckets_from_the_callers_frame(sizes, bucket_mb):
    """A notebook's single-process check: looks for the check's `want` in its frame while
    the learner's function runs."""
    import inspect

    held = [f.frame.f_locals.get("want") for f in inspect.stack()[1:]]
    return next((w for w in held if isinstance(w, list)), [[i] for i in range(len(sizes))])


def test_lab07s_wanted_buckets_are_not_on_the_stack_while_the_learner_runs():
    assert not ok.grading.check_assign_buckets(buckets_from_the_callers_frame).all_passed


def _average_into(model, flat):
    at = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[at : at + p.numel()].view_as(p) / ok.world_size())
            at += p.numel()


def average_on_a_hidden_group_through_a_partial(model):
    """A C callable calling C shows the watch no event at all."""
    import functools

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    functools.partial(_hidden_group().allreduce, [flat])().wait()
    _average_into(model, flat)


def average_on_a_hidden_group_through_a_methodcaller(model):
    import operator

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    operator.methodcaller("allreduce", [flat])(_hidden_group()).wait()
    _average_into(model, flat)


def average_through_the_store(model):
    """The parameters moved through the default group's store: no socket of its own, no
    message of the kit's."""
    import pickle

    store = dist.PrefixStore("by-the-store", c10d._get_default_store())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    store.set(str(ok.rank()), pickle.dumps(flat.tolist()))
    total = sum(torch.tensor(pickle.loads(store.get(str(r)))) for r in range(ok.world_size()))
    _average_into(model, total)


def average_with_a_ring_of_a_quarter_and_the_rest_through_the_store(model):
    import pickle

    store = dist.PrefixStore("by-the-store", c10d._get_default_store())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    quarter = flat.numel() // 4
    ok.ring_all_reduce(flat[:quarter])
    store.set(str(ok.rank()), pickle.dumps(flat[quarter:].tolist()))
    rest = sum(torch.tensor(pickle.loads(store.get(str(r)))) for r in range(ok.world_size()))
    flat[quarter:] = rest
    _average_into(model, flat)


@pytest.mark.parametrize(
    "fn, words",
    [
        (average_on_a_hidden_group_through_a_partial, "open no new connections"),
        (average_on_a_hidden_group_through_a_methodcaller, "open no new connections"),
        (average_through_the_store, _NO_FILES),
        (average_with_a_ring_of_a_quarter_and_the_rest_through_the_store, _NO_FILES),
    ],
)  # fmt: skip
def test_lab09s_mean_by_a_group_of_its_own_fails_however_it_is_called(fn, words):
    _failed_with(ok.grading.check_average_parameters(fn), words)


def average_with_kit_messages_to_the_root(model):
    """An honest average by the learner's own ok.p2p messages (a root), not the kit's ring."""
    me, n = ok.rank(), ok.world_size()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if me == 0:
        got = torch.empty_like(flat)
        for r in range(1, n):
            ok.p2p.recv(got, r)
            flat += got
        for r in range(1, n):
            ok.p2p.send(flat, r)
    else:
        ok.p2p.send(flat, 0)
        ok.p2p.recv(flat, 0)
    _average_into(model, flat)


def average_with_the_kits_ring_per_parameter(model):
    for p in model.parameters():
        with torch.no_grad():
            ok.ring_all_reduce(p.data, op="avg")


@pytest.mark.parametrize(
    "fn", [average_with_kit_messages_to_the_root, average_with_the_kits_ring_per_parameter]
)
def test_lab09s_mean_through_the_kit_passes_by_ring_or_by_messages(fn):
    report = ok.grading.check_average_parameters(fn)
    assert report.all_passed, report.cases


def chunked_moe_from_what_the_rank_holds(x, expert_of, expert, chunks):
    """Looks for every expert (seed 40) and every token's output on the rank. Counts what
    the check's frames and a guessed torch seed give: the rank's own expert only."""
    import inspect

    held = [f.frame.f_locals for f in inspect.stack()[1:]]
    linears = {id(v): v for loc in held for v in loc.values() if isinstance(v, torch.nn.Linear)}
    lists = [v for loc in held for v in loc.values() if isinstance(v, list)
             and any(isinstance(e, torch.nn.Linear) for e in v)]  # fmt: skip
    outputs = [v for loc in held for v in loc.values() if isinstance(v, torch.Tensor)
               and v.dim() == 3 and v.shape[0] == len(x)]  # fmt: skip
    torch.manual_seed(40)
    rebuilt = torch.nn.Linear(x.shape[1], x.shape[1])
    same = torch.equal(rebuilt.weight, expert.weight)
    raise RuntimeError(
        f"found {len(linears)} expert(s), {len(lists)} list(s) of experts, "
        f"{len(outputs)} outputs of every expert, seed 40 rebuilt mine: {same}"
    )


def test_no_rank_holds_lab11s_other_experts_or_their_outputs():
    _failed_with(ok.grading.check_chunked_moe(chunked_moe_from_what_the_rank_holds),
                 "found 1 expert(s), 0 list(s) of experts, 0 outputs of every expert, seed 40 "
                 "rebuilt mine: False")  # fmt: skip


# ------------------------------------------- single-process exercises run on a rank of their own


def memory_by_patching_the_report(n_params, world_size, optimizer="adam", zero1=True):
    """Reach the check's Report through the frames, turn fail into ok."""
    f = sys._getframe(1)
    while f is not None and not isinstance(f.f_locals.get("report"), ok.grading.Report):
        f = f.f_back
    report = f.f_locals["report"]
    report.fail = report.ok
    return {"params": 0, "grads": 0, "optimizer_state": 0}


def memory_by_patching_every_report(n_params, world_size, optimizer="adam", zero1=True):
    import gc

    for obj in gc.get_objects():
        if isinstance(obj, ok.grading.Report):
            obj.fail = obj.ok
    return {"params": 0, "grads": 0, "optimizer_state": 0}


@pytest.mark.parametrize("fn", [memory_by_patching_the_report, memory_by_patching_every_report])
def test_a_single_process_exercise_cannot_reach_the_checks_report(fn):
    report = ok.grading.check_memory_per_rank(fn)
    assert report.score == 0, report.cases


class _Agreeable(str):
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = str.__hash__


def schedule_of_agreeable_strings(stages, micro_batches):
    """A str whose == always agrees, in the schedule's shape."""
    return [[_Agreeable("F0")] * (2 * micro_batches) for _ in range(stages)]


def schedule_read_from_the_checks_frames(stages, micro_batches):
    """In a notebook: looks for the wanted schedules in the check's frame."""
    f = sys._getframe(1)
    while f is not None:
        for value in f.f_locals.values():
            if isinstance(value, dict) and (stages, micro_batches) in value:
                return [list(map(str, s)) for s in value[(stages, micro_batches)]]
        f = f.f_back
    return []


@pytest.mark.parametrize("fn", [schedule_of_agreeable_strings,
                                schedule_read_from_the_checks_frames])  # fmt: skip
def test_a_schedule_that_is_not_worked_out_fails_lab08_in_a_notebook_too(fn):
    report = ok.grading.check_1f1b_schedule(fn)
    assert report.passed == 0, report.cases


def fit_read_from_the_checks_frames(sizes, times):
    """In a notebook: looks for the link's α and β in the check's frame."""
    f = sys._getframe(1)
    while f is not None:
        if "alpha" in f.f_locals and "beta" in f.f_locals:
            return f.f_locals["alpha"], f.f_locals["beta"]
        f = f.f_back
    return 0.0, 0.0


def test_the_fits_link_is_nowhere_a_learners_function_can_read_it():
    report = ok.grading.check_fit_alpha_beta(fit_read_from_the_checks_frames)
    assert report.passed == 0, report.cases


def fit_with_numpy_floats(sizes, times):
    import numpy as np

    t = np.asarray(times)
    design = np.stack([1 / t, np.asarray(sizes, dtype=float) / t], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, np.ones(len(t)), rcond=None)
    return a, b  # NumPy's float64, not Python's float


def test_a_fit_that_returns_numpy_floats_passes_though_it_runs_on_a_rank():
    report = ok.grading.check_fit_alpha_beta(fit_with_numpy_floats)
    assert report.all_passed, report.cases


def bytes_moved_that_prints(collective, nbytes, world):
    print(f"debugging {collective} {world}")
    return (2 if collective == "all_reduce" else 1) * (world - 1) / world * nbytes


def test_what_a_learners_function_prints_is_shown_in_the_notebook(capfd):
    report = ok.grading.check_bytes_moved(bytes_moved_that_prints)
    assert report.all_passed, report.cases
    assert "debugging all_reduce 4" in capfd.readouterr().out


def test_a_function_that_cannot_be_sent_to_a_rank_is_told_why():
    import threading

    lock = threading.Lock()

    def bytes_moved(collective, nbytes, world):
        with lock:
            return 0

    report = ok.grading.check_bytes_moved(bytes_moved)
    assert not report.all_passed
    assert "cannot be sent to the process the check runs it in" in report.cases[0][1], report.cases


# ------------------------------------------------ no channel between ranks but the kit's


def _group_through_a_partial(op, outputs, inputs):
    """A gloo group of the learner's own, its operation called through a partial of the
    class's method (no profiler event): a channel between ranks outside the kit."""
    pg = _hidden_group()
    return functools.partial(getattr(type(pg), op), pg)(outputs, inputs).wait()


def ring_by_a_hidden_allgather(tensor):
    flat = tensor.view(-1)
    outs = [torch.empty_like(flat) for _ in range(ok.world_size())]
    _group_through_a_partial("allgather", [outs], [flat.clone()])
    flat.copy_(sum(outs))


def ag_matmul_by_a_hidden_allgather(x, weight):
    outs = [torch.empty_like(x) for _ in range(ok.world_size())]
    _group_through_a_partial("allgather", [outs], [x.clone()])
    return torch.cat(outs) @ weight.t()


@pytest.mark.parametrize("check, fn", [
    (lambda fn: ok.grading.check_all_reduce(fn, pattern="ring", world_sizes=(2,)),
     ring_by_a_hidden_allgather),
    (ok.grading.check_ag_matmul, ag_matmul_by_a_hidden_allgather),
])  # fmt: skip
def test_a_process_group_of_the_learners_own_cannot_be_made_on_a_checks_rank(check, fn):
    _failed_with(check(fn), "Operation not permitted", "a check's ranks open no new connections")


def bytes_moved_asked_of_a_server(collective, nbytes, world):
    """A single-process exercise that asks another process (the notebook's, where the
    kit's answer runs unwatched) for its answer."""
    import socket

    with socket.create_connection(("127.0.0.1", 9)) as conn:
        conn.sendall(repr((collective, nbytes, world)).encode())
        return float(conn.recv(64))


def test_a_single_process_exercise_cannot_ask_another_process_for_its_answer():
    _failed_with(ok.grading.check_bytes_moved(bytes_moved_asked_of_a_server),
                 "PermissionError", "a check's ranks open no new connections")  # fmt: skip


def _recompiled_on_a_raw_thread(module, name, *args):
    """The kit's module recompiled from its source (new code objects, another file name)
    and its function run on a thread of _thread's, which threading.setprofile misses."""
    import types

    copy = types.ModuleType(f"copy_of_{module.__name__.rsplit('.', 1)[-1]}")
    copy.__package__ = module.__package__  # its relative imports (the cost model's)
    sys.modules[copy.__name__] = copy  # its dataclasses look themselves up there
    exec(compile("\n" * 3 + _source(module.__name__), "elsewhere.py", "exec"), copy.__dict__)
    return _on_a_raw_thread(getattr(copy, name), *args)


def bytes_by_a_recompiled_copy_on_a_raw_thread(collective, nbytes, world):
    return _recompiled_on_a_raw_thread(ok.costmodel.collectives, "bytes_moved_per_rank",
                                       collective, nbytes, world)  # fmt: skip


def buckets_by_a_recompiled_copy_on_a_raw_thread(sizes, bucket_mb):
    return _recompiled_on_a_raw_thread(ok.costmodel.data_parallel, "ddp_buckets", sizes, bucket_mb)


@pytest.mark.parametrize("check, fn, words", [
    (ok.grading.check_bytes_moved, bytes_by_a_recompiled_copy_on_a_raw_thread,
     "ok.costmodel.bytes_moved_per_rank"),
    (ok.grading.check_assign_buckets, buckets_by_a_recompiled_copy_on_a_raw_thread,
     "ok.costmodel.ddp_buckets"),
])  # fmt: skip
def test_a_recompiled_copy_of_the_kit_on_a_raw_thread_is_still_its_answer(check, fn, words):
    _failed_with(check(fn), words, "the kit's own answer")


def test_a_thread_started_under_the_watch_is_no_tampering_and_stays_watched():
    """A threading.Thread started under the watch is not "tampering" (though its start
    calls sys.setprofile), and threading._profile_hook = None leaves none unwatched."""
    import threading

    from overlapkit.sandbox import answers

    with answers.running(answers_of("check_bytes_moved")) as ran:
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
    assert ran == []
    hook = threading._profile_hook
    with answers.running(answers_of("check_bytes_moved")) as ran:
        threading._profile_hook = None
        try:
            t = threading.Thread(target=ok.costmodel.bytes_moved_per_rank,
                                 args=("all_reduce", 8, 2))  # fmt: skip
            t.start()
            t.join()
        finally:
            threading._profile_hook = hook
    assert ran == ["ok.costmodel.bytes_moved_per_rank"]
