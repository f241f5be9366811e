"""Lab 01's checks: the AllReduce must be made of ReduceScatter + AllGather (a plain
AllReduce is refused, whatever its spelling), a size that does not divide by N is told
to pad (not shown gloo's fatal check), and bytes_moved's typical mistakes are named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed import all_reduce as all_reduce_imported_by_name

import overlapkit as ok

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

#: the lab's check cell passes this
MADE_OF = ("reduce_scatter", "all_gather")


def check(fn, world_sizes=(3,)):
    return ok.grading.check_all_reduce(
        fn, from_scratch=False, made_of=MADE_OF, world_sizes=world_sizes
    )


def the_only_message(report):
    ((passed, message),) = report.cases
    assert not passed, message
    assert "[F" not in message and "Check failed" not in message, message  # no gloo abort text
    return message


# ------------------------------------------------------------------ honest variants


def padded(tensor):
    """The solution: pad to a multiple of N, ReduceScatter, AllGather, drop the padding."""
    world = dist.get_world_size()
    n = tensor.numel()
    chunk = -(-n // world)
    buf = torch.zeros(chunk * world, dtype=tensor.dtype)
    buf[:n] = tensor.reshape(-1)
    mine = torch.empty(chunk, dtype=tensor.dtype)
    ok.builtin.reduce_scatter_tensor(mine, buf)
    ok.builtin.all_gather_tensor(buf, mine)
    tensor.copy_(buf[:n].view_as(tensor))


def padded_old_spellings_async(tensor):
    """torch's pre-2.13 names through distributed_c10d, asynchronous, waited."""
    world = dist.get_world_size()
    n = tensor.numel()
    chunk = -(-n // world)
    buf = torch.nn.functional.pad(tensor.reshape(-1), (0, chunk * world - n))
    mine = torch.empty(chunk)
    c10d.reduce_scatter_tensor(mine, buf, async_op=True).wait()
    c10d.all_gather_into_tensor(buf, mine, async_op=True).wait()
    tensor.copy_(buf[:n])


def padded_lists(tensor):
    """The list forms, dist.reduce_scatter and dist.all_gather, on padded parts."""
    world = dist.get_world_size()
    n = tensor.numel()
    chunk = -(-n // world)
    buf = torch.zeros(chunk * world)
    buf[:n] = tensor.reshape(-1)
    parts = list(buf.split(chunk))
    mine = torch.empty(chunk)
    dist.reduce_scatter(mine, parts)
    dist.all_gather(parts, mine)
    tensor.copy_(torch.cat(parts)[:n])


def kit_rings(tensor):
    """The kit's ring ReduceScatter and AllGather are a ReduceScatter and an AllGather."""
    world = dist.get_world_size()
    n = tensor.numel()
    chunk = -(-n // world)
    buf = torch.zeros(chunk * world)
    buf[:n] = tensor.reshape(-1)
    mine = torch.empty(chunk)
    ok.ring_reduce_scatter(mine, buf)
    ok.ring_all_gather(buf, mine)
    tensor.copy_(buf[:n])


@pytest.mark.parametrize("fn", [padded, padded_old_spellings_async, padded_lists, kit_rings])
def test_an_all_reduce_made_of_reduce_scatter_and_all_gather_passes_on_2_3_and_4_ranks(fn):
    report = check(fn, world_sizes=(2, 3, 4))
    assert report.all_passed and report.total == 3, report.cases


# ------------------------------------------------------------------ an AllReduce inside


def plain_all_reduce(tensor):
    dist.all_reduce(tensor)


def all_reduce_through_c10d(tensor):
    c10d.all_reduce(tensor)


def all_reduce_imported_by_name_(tensor):
    all_reduce_imported_by_name(tensor)


def the_kit_ring(tensor):
    ok.ring_all_reduce(tensor)


def padded_then_all_reduce_too(tensor):
    """Does the exercise, then 'makes sure' with an AllReduce of the result."""
    padded(tensor)
    dist.all_reduce(tensor)
    tensor /= dist.get_world_size()


@pytest.mark.parametrize(
    "fn, called",
    [
        (plain_all_reduce, "dist.all_reduce"),
        (all_reduce_through_c10d, "dist.all_reduce"),
        (all_reduce_imported_by_name_, "dist.all_reduce"),
        (padded_then_all_reduce_too, "dist.all_reduce"),
    ],
)  # fmt: skip
def test_calling_an_all_reduce_inside_fails_with_the_call_named(fn, called):
    message = the_only_message(check(fn))
    assert message == (
        f"3 ranks, a tensor of 12 elements: rank 0 calls {called}: the exercise builds "
        "AllReduce from ReduceScatter + AllGather: call ok.builtin.reduce_scatter_tensor "
        "(rank r keeps the sum of chunk r), then ok.builtin.all_gather_tensor (every rank "
        "gets every summed chunk), and no AllReduce."
    )


def test_the_kits_all_reduce_inside_refuses_to_run_and_the_parts_are_named():
    message = the_only_message(check(the_kit_ring))
    assert " ranks: rank " in message  # whichever rank ran it first
    assert " ran ok.collectives.ring_all_reduce, the kit's own answer" in message
    assert message.endswith(
        "Here the exercise builds AllReduce from ReduceScatter + AllGather: call "
        "ok.builtin.reduce_scatter_tensor (rank r keeps the sum of chunk r), then "
        "ok.builtin.all_gather_tensor (every rank gets every summed chunk), and no AllReduce."
    )


def test_a_notebook_function_that_imported_all_reduce_by_name_is_caught_too():
    def all_reduce_via_rs_ag(tensor):  # pickled by value, as a notebook's function is
        all_reduce_imported_by_name(tensor)

    message = the_only_message(check(all_reduce_via_rs_ag, world_sizes=(2,)))
    assert "rank 0 calls dist.all_reduce: the exercise builds AllReduce from" in message


def reduce_scatter_then_broadcasts(tensor):
    """Gathers the summed chunks with one broadcast per rank instead of an AllGather."""
    world = dist.get_world_size()
    n = tensor.numel()
    chunk = -(-n // world)
    buf = torch.zeros(chunk * world)
    buf[:n] = tensor.reshape(-1)
    mine = torch.empty(chunk)
    ok.builtin.reduce_scatter_tensor(mine, buf)
    for r, part in enumerate(buf.split(chunk)):
        if r == dist.get_rank():
            part.copy_(mine)
        dist.broadcast(part, src=r)
    tensor.copy_(buf[:n])


def test_a_part_left_out_is_named():
    message = the_only_message(check(reduce_scatter_then_broadcasts))
    assert message.startswith(
        "3 ranks, a tensor of 12 elements: rank 0 calls ok.builtin.reduce_scatter_tensor, "
        "dist.broadcast, no AllGather: the exercise builds AllReduce from ReduceScatter + "
        "AllGather"
    ), message


# ------------------------------------------------------------------ padding left out


def no_padding_floor(tensor):
    world = dist.get_world_size()
    flat = tensor.view(-1)
    mine = torch.empty(flat.numel() // world)
    ok.builtin.reduce_scatter_tensor(mine, flat)
    ok.builtin.all_gather_tensor(flat, mine)


def no_padding_ceil(tensor):
    world = dist.get_world_size()
    flat = tensor.view(-1)
    mine = torch.empty(-(-flat.numel() // world))
    ok.builtin.reduce_scatter_tensor(mine, flat)
    ok.builtin.all_gather_tensor(flat, mine)


def no_padding_lists(tensor):
    """tensor_split makes uneven parts: gloo's list ReduceScatter takes them, its
    AllGather cannot."""
    world = dist.get_world_size()
    parts = list(tensor.view(-1).tensor_split(world))
    mine = parts[dist.get_rank()].clone()
    dist.reduce_scatter(mine, parts)
    dist.all_gather(parts, mine)
    tensor.copy_(torch.cat(parts))


def no_padding_lists_floor(tensor):
    """The list ReduceScatter with an output of numel // N: on rank 0 it is one element
    shorter than rank 0's part, which gloo stops the process for."""
    world = dist.get_world_size()
    parts = list(tensor.view(-1).tensor_split(world))
    mine = torch.empty(tensor.numel() // world)
    dist.reduce_scatter(mine, parts)
    dist.all_gather(parts, mine)
    tensor.copy_(torch.cat(parts))


def padding_never_dropped(tensor):
    world = dist.get_world_size()
    n = tensor.numel()
    chunk = -(-n // world)
    buf = torch.zeros(chunk * world)
    buf[:n] = tensor.reshape(-1)
    mine = torch.empty(chunk)
    ok.builtin.reduce_scatter_tensor(mine, buf)
    ok.builtin.all_gather_tensor(buf, mine)
    tensor.copy_(buf)


def gathered_into_the_unpadded_tensor(tensor):
    world = dist.get_world_size()
    n = tensor.numel()
    chunk = -(-n // world)
    buf = torch.zeros(chunk * world)
    buf[:n] = tensor.reshape(-1)
    mine = torch.empty(chunk)
    ok.builtin.reduce_scatter_tensor(mine, buf)
    ok.builtin.all_gather_tensor(tensor, mine)


def _padding_words(world):
    padded_to = -(-1031 // world) * world
    return (
        f"The tensor of 1031 elements on {world} ranks is not divisible by N: pad it with "
        f"zeros to a multiple of N ({padded_to} elements) before reduce_scatter_tensor, and "
        "drop the padding after the AllGather (copy the first 1031 back into `tensor`)."
    )


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(
    "fn, said",
    [
        (no_padding_floor, "ok.builtin.reduce_scatter_tensor: the input has 1031 elements, "
                           "not N × the output's"),
        (no_padding_ceil, "ok.builtin.reduce_scatter_tensor: the input has 1031 elements, "
                          "not N × the output's"),
        (no_padding_lists, "dist.all_gather: the list holds parts of"),
        (no_padding_lists_floor, "dist.reduce_scatter: the output has"),
        (padding_never_dropped, "RuntimeError: The size of tensor a (1031) must match"),
        (gathered_into_the_unpadded_tensor, "ok.builtin.all_gather_tensor: the output has "
                                            "1031 elements, not N × the input's"),
    ],
)  # fmt: skip
def test_leaving_out_or_keeping_the_padding_is_told_to_pad_on_every_world_size(fn, said, world):
    message = the_only_message(check(fn, world_sizes=(world,)))
    assert message.startswith(
        f"{fn.__name__} on {world} ranks: a tensor of 1031 elements: rank 0 raised "
    ), message
    assert said in message and message.endswith(_padding_words(world)), message


def test_a_rank_gloo_stopped_on_sizes_is_told_which_sizes_want_padding():
    """Where gloo's fatal size check still stops a process (a torch whose gloo aborts,
    or a call around the size guard), the crash's text is explained by padding."""
    from overlapkit.grading.lab03_collectives import _explain_made_of  # noqa: PLC0415

    crash = (
        "rank 0 died: [rank0]:[F1130 10:00:00.0 ProcessGroupGloo.cpp:1583] Check failed: "
        "outputShape[0] * worldSize == inputShape[0] (1029 vs. 1031)."
    )
    assert _explain_made_of(3)(crash) == (
        " gloo stopped the rank: a collective got tensors whose sizes do not fit together. "
        "Sizes 1031, 7, 2, 1 are not divisible by N = 3: pad the tensor with zeros to a "
        "multiple of N before reduce_scatter_tensor, and drop the padding after the AllGather."
    )


def test_the_refused_call_is_shown_at_the_learners_line():
    message = the_only_message(check(no_padding_floor, world_sizes=(2,)))
    assert "(at test_grading_lab01.py:" in message, message
    assert "in no_padding_floor: ok.builtin.reduce_scatter_tensor(mine, flat))" in message


def test_the_size_guard_is_the_checks_alone_and_is_taken_away_after_it():
    before = (dist.all_reduce, c10d.reduce_scatter_tensor, ok.builtin.all_gather_tensor)
    assert check(padded, world_sizes=(2,)).all_passed
    assert (dist.all_reduce, c10d.reduce_scatter_tensor, ok.builtin.all_gather_tensor) == before
    # without made_of (labs 02-03 and the reduce-scatter pattern in general) nothing changes
    assert ok.grading.check_all_reduce(plain_all_reduce, from_scratch=False,
                                       world_sizes=(2,)).all_passed  # fmt: skip


def test_an_unknown_part_is_refused_at_once():
    with pytest.raises(ValueError, match="unknown part"):
        ok.grading.check_all_reduce(padded, from_scratch=False, made_of=("reduce_scatterr",))


# ------------------------------------------------------------------ wrong values, as before


def averaged(tensor):
    padded(tensor)
    tensor /= dist.get_world_size()


def returned_not_in_place(tensor):
    out = tensor.clone()
    padded(out)
    return out


def result_bound_to_a_new_name(tensor):
    """``tensor = ...`` rebinds the name: the caller's tensor never changes."""
    world = dist.get_world_size()
    n = tensor.numel()
    chunk = -(-n // world)
    buf = torch.zeros(chunk * world)
    buf[:n] = tensor.reshape(-1)
    mine = torch.empty(chunk)
    ok.builtin.reduce_scatter_tensor(mine, buf)
    ok.builtin.all_gather_tensor(buf, mine)
    tensor = buf[:n]  # noqa: F841


@pytest.mark.parametrize(
    "fn, said",
    [
        (averaged, "That is the sum divided by 3: you averaged"),
        (returned_not_in_place, "You returned the right values: the operation must be in place"),
        (result_bound_to_a_new_name, "The whole tensor is exactly this rank's input: nothing "
                                     "was ever written into `tensor`"),
    ],
)  # fmt: skip
def test_wrong_values_keep_their_messages(fn, said):
    message = the_only_message(check(fn))
    assert message.startswith("3 ranks, a tensor of 12 elements: rank 0, chunk 0")
    assert said in message, message


# ------------------------------------------------------------------ bytes_moved


def _per_rank(collective, nbytes, world):
    # a learner's own count (the kit's bytes_moved_per_rank would be refused as its answer)
    one_pass = (world - 1) / world * nbytes
    return 2 * one_pass if collective == "all_reduce" else one_pass


def _failures(fn):
    return [m for passed, m in ok.grading.check_bytes_moved(fn).cases if not passed]


@pytest.mark.parametrize(
    "mistake, said",
    [
        (lambda c, s, w: _per_rank(c, s, w) * w,
         "That is the total over all ranks; the question is per rank."),
        (lambda c, s, w: s * (w - 1), "Each step moves one chunk of S/N bytes, not the whole"),
        (lambda c, s, w: (w - 1) / w * s,
         "That is one phase: an AllReduce is a ReduceScatter and then an AllGather"),
        (lambda c, s, w: _per_rank(c, s, w) * 8, "That is in bits: the question is in bytes."),
        (lambda c, s, w: 2 * (w - 1) / w * s,  # every collective as if it were an AllReduce
         "That is an AllReduce's figure: a reduce_scatter is one phase"),
        (lambda c, s, w: (2 if c == "all_reduce" else 1) * (w - 1) / w,
         "That is the share of S each rank sends: multiply it by nbytes."),
        (lambda c, s, w: (2 if c == "all_reduce" else 1) * ((w - 1) // w) * s,
         "(N - 1) // N is 0: use /."),
        (lambda c, s, w: None, "The function returned None: return the number of bytes."),
    ],
)  # fmt: skip
def test_each_typical_bytes_moved_mistake_is_named(mistake, said):
    failures = _failures(mistake)
    assert failures and said in failures[0], failures


def test_the_right_bytes_moved_passes_every_case():
    report = ok.grading.check_bytes_moved(_per_rank)
    assert report.all_passed and report.total == 7, report.cases


# ------------------------------------------------------------------ the lab, graded


def test_grading_lab01_with_a_plain_all_reduce_gives_that_exercise_nothing(tmp_path):
    """The lab's own check cell carries made_of, so the grader refuses dist.all_reduce."""
    import nbformat  # noqa: PLC0415

    from overlapkit.grade import grade_notebook  # noqa: PLC0415

    labs = Path(__file__).resolve().parent.parent / "labs"
    nb = nbformat.read(labs / "01_collective_patterns.ipynb", as_version=4)
    answers = {
        "def all_reduce_via_rs_ag(tensor):": "    dist.all_reduce(tensor)",
        "def bytes_moved(collective, nbytes, world):": (
            "    return (2 if collective == 'all_reduce' else 1) * (world - 1) / world * nbytes"
        ),
    }
    for cell in nb.cells:
        for head, body in answers.items():
            if cell.cell_type == "code" and cell.source.startswith(head):
                cell.source = f"{head}\n{body}"
    (tmp_path / "student").mkdir()
    path = tmp_path / "student" / "01_collective_patterns.ipynb"
    nbformat.write(nb, path)
    result = grade_notebook(path, labs)
    by_name = {e["name"]: e for e in result["exercises"]}
    assert by_name["bytes_moved"]["points"] == by_name["bytes_moved"]["max_points"] > 0
    assert by_name["all_reduce"]["points"] == 0, by_name["all_reduce"]
    assert "rank 0 calls dist.all_reduce: the exercise builds AllReduce from ReduceScatter + " \
        "AllGather" in by_name["all_reduce"]["feedback"]  # fmt: skip
