"""Lab 13's check: honest top-k with error feedback passes (sync or async gathers, other
spellings), every typical mistake fails with a message that names it, and the kit's own
TopK under another name is refused."""

from __future__ import annotations

import functools
import inspect
import sys
import types

import pytest
import torch
import torch.distributed as dist

import overlapkit as ok

# ------------------------------------------------------------------ honest


def topk_right(flat, residual, fraction):
    corrected = flat + residual
    k = max(1, round(fraction * flat.numel()))
    index = corrected.abs().topk(k).indices
    values = corrected[index]
    world = ok.world_size()
    all_values = torch.empty(world * k)
    all_index = torch.empty(world * k, dtype=torch.int64)
    ok.ring_all_gather(all_values, values)
    ok.ring_all_gather(all_index, index)
    new_residual = corrected.clone()
    new_residual[index] = 0
    flat.zero_()
    flat.index_add_(0, all_index, all_values)
    flat /= world
    return new_residual


def topk_async_in_place(flat, residual, fraction):
    """In place on the residual, async gathers waited, k from the kit's cost model."""
    residual += flat
    k = ok.costmodel.top_k_count(flat.numel(), fraction)
    _, index = torch.topk(residual.abs(), k, sorted=False)
    values = residual[index].clone()
    residual[index] = 0.0
    n = ok.world_size()
    vals, idx = torch.zeros(n * k), torch.zeros(n * k, dtype=torch.long)
    h1 = ok.ring_all_gather(vals, values, async_op=True)
    h2 = ok.ring_all_gather(idx, index, async_op=True)
    h1.wait()
    h2.wait()
    flat.fill_(0).scatter_add_(0, idx, vals / n)
    return residual


@pytest.mark.parametrize("fn", [topk_right, topk_async_in_place])
def test_the_check_passes_honest_top_k_with_feedback(fn):
    report = ok.grading.check_topk_with_feedback(fn)
    assert report.all_passed, report.cases
    assert report.total == 2


# ------------------------------------------------------------------ mistakes


def _gather(values, index):
    world = ok.world_size()
    k = values.numel()
    all_values = torch.empty(world * k, dtype=values.dtype)
    all_index = torch.empty(world * k, dtype=torch.int64)
    ok.ring_all_gather(all_values, values)
    ok.ring_all_gather(all_index, index)
    return all_values, all_index


def _variant(
    name,
    k="round",
    select="magnitude",
    send="corrected",
    feedback=True,
    zero_flat=True,
    place="add",
    divide="ranks",
    residual="right",
):
    """The right answer but for the choices named: how k is counted, how the positions
    are chosen, which values travel, whether the residual is added, how the values land
    in flat and are divided, and which residual is returned."""

    def fn(flat, residual_in, fraction):
        given = flat.clone()
        corrected = flat + residual_in if feedback else flat.clone()
        count = {"round": max(1, round(fraction * flat.numel())),
                 "floor": int(fraction * flat.numel()),
                 "ceil": -int(-fraction * flat.numel() // 1), "fraction": fraction}[k]  # fmt: skip
        by = {"magnitude": corrected.abs(), "value": corrected, "smallest": -corrected.abs()}
        index = by[select].topk(count).indices
        values = {"corrected": corrected, "magnitudes": corrected.abs(), "gradient": given}
        values = values[send][index].clone()
        world = ok.world_size()
        if place == "own":  # the values only: each rank's added at this rank's positions
            all_values = torch.empty(world * count)
            ok.ring_all_gather(all_values, values)
        else:
            all_values, all_index = _gather(values, index)
        if zero_flat:
            flat.zero_()
        if place == "own":
            for chunk in all_values.view(world, count):
                flat[index] += chunk
        elif place == "assign":
            flat[all_index] = all_values
        else:
            flat.index_add_(0, all_index, all_values)
        flat /= {"ranks": world, "k": count, None: 1}[divide]
        kept = corrected.clone()
        kept[index] = 0
        return {"right": kept, "zeros": torch.zeros_like(flat), "negated": -kept,
                "unzeroed": corrected, "of_average": corrected - flat}[residual]  # fmt: skip

    fn.__name__ = name
    return fn


no_feedback = _variant("no_feedback", feedback=False, residual="zeros")
residual_ignored_but_updated = _variant("residual_ignored_but_updated", feedback=False)
residual_wrong_sign = _variant("residual_wrong_sign", residual="negated")
residual_not_updated = _variant("residual_not_updated", residual="unzeroed")
residual_of_the_average = _variant("residual_of_the_average", residual="of_average")
k_rounded_down = _variant("k_rounded_down", k="floor")
k_rounded_up = _variant("k_rounded_up", k="ceil")
k_as_the_fraction = _variant("k_as_the_fraction", k="fraction")
top_by_value = _variant("top_by_value", select="value")
smallest_chosen = _variant("smallest_chosen", select="smallest")
magnitudes_sent = _variant("magnitudes_sent", send="magnitudes")
gradient_values_sent = _variant("gradient_values_sent", send="gradient")
summed = _variant("summed", divide=None)
divided_by_k = _variant("divided_by_k", divide="k")
flat_not_zeroed = _variant("flat_not_zeroed", zero_flat=False)
own_indices_for_everyone = _variant("own_indices_for_everyone", place="own")
collisions_overwritten = _variant("collisions_overwritten", place="assign")


def dense_all_reduce(flat, residual, fraction):
    corrected = flat + residual
    k = max(1, round(fraction * flat.numel()))
    index = corrected.abs().topk(k).indices
    sparse = torch.zeros_like(corrected)
    sparse[index] = corrected[index]
    new = corrected - sparse
    ok.ring_all_reduce(sparse, op="avg")
    flat.copy_(sparse)
    return new


def gather_everything_then_choose(flat, residual, fraction):
    corrected = flat + residual
    k = max(1, round(fraction * flat.numel()))
    world = ok.world_size()
    everyone = torch.empty(world * flat.numel())
    ok.ring_all_gather(everyone, corrected)
    flat.zero_()
    for c in everyone.view(world, -1):
        index = c.abs().topk(k).indices
        flat[index] += c[index] / world
    index = corrected.abs().topk(k).indices
    new = corrected.clone()
    new[index] = 0
    return new


def builtin_gather(flat, residual, fraction):
    corrected = flat + residual
    k = max(1, round(fraction * flat.numel()))
    index = corrected.abs().topk(k).indices
    world = dist.get_world_size()
    values = [torch.empty(k) for _ in range(world)]
    indices = [torch.empty(k, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(values, corrected[index].clone())
    dist.all_gather(indices, index)
    flat.zero_().index_add_(0, torch.cat(indices), torch.cat(values)).div_(world)
    new = corrected.clone()
    new[index] = 0
    return new


def gather_not_waited(flat, residual, fraction):
    corrected = flat + residual
    k = max(1, round(fraction * flat.numel()))
    index = corrected.abs().topk(k).indices
    world = ok.world_size()
    all_values = torch.empty(world * k)
    all_index = torch.empty(world * k, dtype=torch.int64)
    ok.ring_all_gather(all_values, corrected[index].clone(), async_op=True)
    ok.ring_all_gather(all_index, index)
    flat.zero_().index_add_(0, all_index, all_values).div_(world)
    new = corrected.clone()
    new[index] = 0
    return new


def returns_nothing(flat, residual, fraction):
    topk_right(flat, residual, fraction)


def kit_top_k_renamed(flat, residual, fraction):
    squeeze = ok.compression.TopK(fraction)
    squeeze.residuals[0] = [((flat.numel(),),), residual.clone()]
    squeeze(flat, async_op=False)
    return squeeze.residuals[0][1]


def corrected_is_flat(flat, residual, fraction):
    corrected = flat.add_(residual)  # corrected and flat: one tensor
    k = max(1, round(fraction * flat.numel()))
    index = corrected.abs().topk(k).indices
    all_values, all_index = _gather(corrected[index].clone(), index)
    flat.zero_().index_add_(0, all_index, all_values).div_(ok.world_size())
    corrected[index] = 0
    return corrected


def neither_gather_waited(flat, residual, fraction):
    corrected = flat + residual
    k = max(1, round(fraction * flat.numel()))
    index = corrected.abs().topk(k).indices
    world = ok.world_size()
    all_values = torch.empty(world * k)
    all_index = torch.empty(world * k, dtype=torch.int64)
    ok.ring_all_gather(all_values, corrected[index].clone(), async_op=True)
    ok.ring_all_gather(all_index, index, async_op=True)
    flat.zero_().index_add_(0, all_index, all_values).div_(world)
    corrected[index] = 0
    return corrected


def only_rank_0_gathers_indices(flat, residual, fraction):
    corrected = flat + residual
    k = max(1, round(fraction * flat.numel()))
    index = corrected.abs().topk(k).indices
    world = ok.world_size()
    all_values = torch.empty(world * k)
    ok.ring_all_gather(all_values, corrected[index].clone())
    if ok.rank() == 0:
        ok.ring_all_gather(torch.empty(world * k, dtype=torch.int64), index)
    flat.zero_()
    corrected[index] = 0
    return corrected


def flat_zeroed_first(flat, residual, fraction):
    flat.zero_()
    corrected = flat + residual
    k = max(1, round(fraction * flat.numel()))
    index = corrected.abs().topk(k).indices
    all_values, all_index = _gather(corrected[index].clone(), index)
    flat.index_add_(0, all_index, all_values).div_(ok.world_size())
    corrected[index] = 0
    return corrected


MISTAKES = {
    no_feedback: "all zeros: no error feedback",
    residual_ignored_but_updated: "the residual passed in (what this rank did not send last "
    "step) was never added",
    residual_wrong_sign: "wrong sign",
    residual_not_updated: "still in it: set them to zero",
    residual_of_the_average: "the other ranks' entries leaked into this rank's residual",
    k_rounded_down: "top 10 (⌊f·n⌋, rounded down)",
    k_as_the_fraction: "topk() takes a count",
    top_by_value: "largest entries by *value*",
    summed: "the sum over the 2 ranks, not the average",
    own_indices_for_everyone: "the other ranks' values were put at this rank's indices",
    dense_all_reduce: "an AllReduce of a dense vector sends",
    gather_everything_then_choose: "sent 4280 bytes in a step",
    builtin_gather: "called torch.distributed.all_gather",
    gather_not_waited: "never waited for 3 operation(s)",
    returns_nothing: "returned None: return the new residual",
    kit_top_k_renamed: "TopK",
    k_rounded_up: "top 17 (⌈f·n⌉, rounded up)",
    magnitudes_sent: "the magnitudes of the chosen entries, their signs lost",
    flat_not_zeroed: "flat was not zeroed",
    gradient_values_sent: "the values are the gradient's alone",
    corrected_is_flat: "returned residual is flat itself",
    neither_gather_waited: "never waited for 2 operation(s)",
    only_rank_0_gathers_indices: "rank 0 and rank 1 disagree on kit operation #2",
    divided_by_k: "the sum divided by k = 11",
    smallest_chosen: "the k *smallest* entries",
    collisions_overwritten: "one value was kept",
    flat_zeroed_first: "flat is all zeros",
}


@pytest.mark.parametrize("fn", list(MISTAKES), ids=[f.__name__ for f in MISTAKES])
def test_each_typical_top_k_mistake_is_named_by_the_check(fn):
    report = ok.grading.check_topk_with_feedback(fn)
    assert not report.all_passed
    said = " ".join(text for passed, text in report.cases if not passed)
    assert MISTAKES[fn] in said, said


def test_the_mismatch_message_is_not_followed_by_an_unrelated_hint():
    report = ok.grading.check_topk_with_feedback(only_rank_0_gathers_indices)
    said = " ".join(text for passed, text in report.cases if not passed)
    assert "needs output to hold" not in said, said


# ------------------------------------------------------------- ways around the work (lab 13)
# Each of these exchanges more than top-k sends, or runs the kit's own TopK with the watch
# switched off or its disarmed code put back; so the check counts bytes where every kit
# message leaves a rank and guards its ranks' watch.


def _tiny():  # a gather, so that "never called ok.ring_all_gather" does not speak first
    ok.ring_all_gather(torch.empty(ok.world_size()), torch.zeros(1))


def _finish(corrected, k):
    index = corrected.abs().topk(k).indices
    new = corrected.clone()
    new[index] = 0
    return new


def dense_over_p2p(flat, residual, fraction):
    corrected = flat + residual
    k = max(1, round(fraction * flat.numel()))
    me, world = ok.rank(), ok.world_size()
    every = [corrected if p == me else torch.empty_like(corrected) for p in range(world)]
    handles = [h for p in range(world) if p != me
               for h in (ok.p2p.isend(corrected, p), ok.p2p.irecv(every[p], p))]  # fmt: skip
    for h in handles:
        h.wait()
    _tiny()
    flat.zero_()
    for e in every:
        index = e.abs().topk(k).indices
        flat[index] += e[index] / world
    return _finish(corrected, k)


def dense_all_reduce_by_another_module(flat, residual, fraction):
    corrected = flat + residual
    k = max(1, round(fraction * flat.numel()))
    index = corrected.abs().topk(k).indices
    sparse = torch.zeros_like(corrected)
    sparse[index] = corrected[index]
    ok.ddp.ring_all_reduce(sparse, op="avg")
    _tiny()
    flat.copy_(sparse)
    return _finish(corrected, k)


def everything_gathered_by_another_module(flat, residual, fraction):
    corrected = flat + residual
    k = max(1, round(fraction * flat.numel()))
    world = ok.world_size()
    every = torch.empty(world * flat.numel())
    ok.sharded.ring_all_gather(every, corrected)
    _tiny()
    flat.zero_()
    for c in every.view(world, -1):
        index = c.abs().topk(k).indices
        flat[index] += c[index] / world
    return _finish(corrected, k)


class _SaysItIsSmall(torch.Tensor):
    """Tells whoever counts bytes (the recorder's _nbytes, the transport's _isend) that it
    holds one element."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.numel and sys._getframe(1).f_code.co_name in ("_nbytes", "_isend"):
            return 1
        return super().__torch_function__(func, types, args, kwargs or {})


def everything_gathered_as_a_small_tensor(flat, residual, fraction):
    corrected = flat + residual
    k = max(1, round(fraction * flat.numel()))
    world = ok.world_size()
    every = torch.empty(world * flat.numel())
    ok.ring_all_gather(every, corrected.as_subclass(_SaysItIsSmall))
    flat.zero_()
    for c in every.as_subclass(torch.Tensor).view(world, -1):
        index = c.abs().topk(k).indices
        flat[index] += c[index] / world
    return _finish(corrected, k)


def kit_top_k_with_the_watch_off(flat, residual, fraction):
    watch = sys.getprofile()
    functools.partial(sys.setprofile, None)()
    try:
        module = types.ModuleType("overlapkit._compression_again")
        module.__package__ = "overlapkit"
        with open(ok.compression.__file__) as f:
            exec(compile(f.read(), ok.compression.__file__, "exec"), module.__dict__)
        squeeze = module.TopK(fraction)
        squeeze.residuals[0] = [((flat.numel(),),), residual.clone()]
        squeeze(flat, async_op=False)
        return squeeze.residuals[0][1]
    finally:
        functools.partial(sys.setprofile, watch)()


def _codes_of(fn, seen):
    """The watch's {code: label} of the answers, found through its closures."""
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:
            continue
        if isinstance(v, dict) and v and all(isinstance(c, types.CodeType) for c in list(v)):
            return v
        if callable(v) and id(v) not in seen:
            seen.add(id(v))
            found = _codes_of(v, seen)
            if found:
                return found
    return None


def kit_top_k_rearmed_through_code(flat, residual, fraction):
    # looks for the answers' original code in the watch's closure, then its token cache
    codes = _codes_of(sys.getprofile(), set()) or {
        entry[0]: None for entry in list(ok.sandbox.answers._tokens_of.values())
    }
    originals = {c.co_qualname: c for c in codes if c.co_filename == ok.compression.__file__}
    for cls in (ok.compression.Compressor, ok.compression.TopK):
        for value in vars(cls).values():
            f = getattr(value, "__func__", value)
            if inspect.isfunction(f) and f.__qualname__ in originals:
                f.__code__ = originals[f.__qualname__]
    squeeze = ok.compression.TopK(fraction)
    squeeze.residuals[0] = [((flat.numel(),),), residual.clone()]
    squeeze(flat, async_op=False)
    return squeeze.residuals[0][1]


AROUND_THE_WORK = {
    dense_over_p2p: "compresses nothing",
    dense_all_reduce_by_another_module: "compresses nothing",
    everything_gathered_by_another_module: "compresses nothing",
    everything_gathered_as_a_small_tensor: "compresses nothing",
    kit_top_k_with_the_watch_off: "your function called sys.setprofile",
    # neither the watch nor its token cache hands the originals out, so nothing is
    # re-armed and the kit's TopK refuses to run
    kit_top_k_rearmed_through_code: "ran ok.compression.TopK",
}


@pytest.mark.parametrize("fn", list(AROUND_THE_WORK), ids=[f.__name__ for f in AROUND_THE_WORK])
def test_no_way_around_the_work_passes(fn):
    report = ok.grading.check_topk_with_feedback(fn)
    assert not report.all_passed, report.cases
    said = " ".join(text for passed, text in report.cases if not passed)
    assert AROUND_THE_WORK[fn] in said, said


# A channel outside the kit (System V shared memory), and the kit's TopK loaded afresh
# from its file and run on a thread started from C (which no profiler watches): the ranks'
# seccomp filter refuses IPC, and the guard refuses opening the file of a kit module
# already imported.


def through_system_v_shared_memory(flat, residual, fraction):
    import ctypes  # noqa: PLC0415
    import os  # noqa: PLC0415

    libc = ctypes.CDLL(None, use_errno=True)
    corrected = flat + residual
    k = max(1, round(fraction * flat.numel()))
    sid = libc.shmget(0x0C13 << 16 | (os.getppid() + flat.numel()) & 0xFFFF,
                      4 * flat.numel() * ok.world_size(), 0o1600)  # fmt: skip
    if sid < 0:
        raise OSError(ctypes.get_errno(), "shmget refused")
    libc.shmctl(sid, 0, None)  # IPC_RMID: nothing left behind should it ever work
    _tiny()
    flat.zero_()
    return _finish(corrected, k)


def fresh_kit_top_k_on_a_thread_started_from_c(flat, residual, fraction):
    import ctypes  # noqa: PLC0415
    import importlib.util  # noqa: PLC0415
    import os  # noqa: PLC0415
    import threading  # noqa: PLC0415

    path = os.path.join(os.path.dirname(ok.__file__), "compression.py")
    spec = importlib.util.spec_from_file_location("overlapkit._compression_again", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "overlapkit"
    spec.loader.exec_module(module)
    corrected, box, done = flat + residual, {}, threading.Event()

    def work(_):
        threading.current_thread().name = "raw"
        try:
            box["dropped"] = module.TopK(fraction)._compressed_average(
                corrected, None, ok.world_size(), 0, None)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc
        done.set()

    callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(work)
    start = ctypes.pythonapi.PyThread_start_new_thread
    start.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    start(ctypes.cast(callback, ctypes.c_void_p), None)
    done.wait()
    if "error" in box:
        raise box["error"]
    flat.copy_(corrected)
    return box["dropped"]


OUTSIDE_THE_KIT = {
    # refused before any shmget: C through ctypes while the call runs
    through_system_v_shared_memory: "called C code through ctypes",
    fresh_kit_top_k_on_a_thread_started_from_c: "opened the kit's own file",
}


@pytest.mark.parametrize("fn", list(OUTSIDE_THE_KIT), ids=[f.__name__ for f in OUTSIDE_THE_KIT])
def test_no_channel_outside_the_kit_and_no_fresh_copy_of_an_answer_passes(fn):
    report = ok.grading.check_topk_with_feedback(fn)
    assert not report.all_passed, report.cases
    said = " ".join(text for passed, text in report.cases if not passed)
    assert OUTSIDE_THE_KIT[fn] in said, said


def only_rank_0_gathers(flat, residual, fraction):
    corrected = flat + residual
    k = max(1, round(fraction * flat.numel()))
    index = corrected.abs().topk(k).indices
    world = ok.world_size()
    all_values, all_index = torch.zeros(world * k), torch.zeros(world * k, dtype=torch.int64)
    if ok.rank() == 0:  # rank 1 never joins: rank 0 waits for it
        ok.ring_all_gather(all_values, corrected[index].clone())
        ok.ring_all_gather(all_index, index)
    flat.zero_().index_add_(0, all_index, all_values).div_(world)
    corrected[index] = 0
    return corrected


def test_a_gather_one_rank_never_joins_is_a_named_hang_not_a_minute_long_wait():
    report = ok.grading.check_topk_with_feedback(only_rank_0_gathers, timeout=5)
    said = " ".join(text for passed, text in report.cases if not passed)
    assert "did not finish within 5 s" in said and "rank 1 had finished" in said, said
