"""The order in which the kit posts point-to-point messages, as NCCL would run them.

Each case runs on gloo ranks on the CPU with every message through the process group
(no shared memory), records what each rank posted (``overlapkit.routes.recording``) with the
communicator NCCL would take for it, and replays the record under NCCL's blocking rule
(``tests/nccl_order.py``): no hang, every send received with its size and dtype. The
same records replayed as if both directions of a pair shared one stream show the hangs
the kit's routes avoid."""

from __future__ import annotations

import pytest
import torch

import overlapkit as ok
from tests.nccl_order import pair_stream, stuck


def _recorded(case, *args):
    """Run ``case(*args)`` on this rank with every message through the process group;
    return this rank's record."""
    from overlapkit import collectives, p2p, routes

    p2p.use_shared_memory(None)  # through the group, as CUDA tensors travel
    collectives.GROUP_PIECE_BYTES = 4096  # several messages per ring step
    torch.manual_seed(ok.rank())
    with routes.recording() as log:
        case(*args)
    return list(log)


def _run(case, world, *args, link=None):
    posts = ok.launch(_recorded, case, *args, world_size=world, timeout=120, link=link)
    return dict(enumerate(posts))


def _ring_all_reduce(numel):
    ok.ring_all_reduce(torch.randn(numel))
    ok.ring_all_reduce(torch.randn(numel), async_op=True).wait()


def _naive(numel):
    ok.naive_all_reduce(torch.randn(numel))


def _all_to_all(numel):
    world = ok.world_size()
    x = torch.randn(world * numel)
    ok.all_to_all(torch.empty_like(x), x)


def _pipeline(schedule, micro, overlap):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    stage = ok.pipeline.PipelineStage(model[:2] if ok.rank() == 0 else model[2:])
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    stage.step(x if ok.rank() == 0 else None, y, torch.nn.functional.mse_loss,
               micro_batches=micro, schedule=schedule, overlap=overlap)  # fmt: skip


def _tensor_parallel(chunks):
    world = ok.world_size()
    x, w = torch.randn(8, 16), torch.randn(12, 16)
    ok.tensor_parallel.all_gather_matmul(x, w, chunks=chunks)
    ok.tensor_parallel.matmul_reduce_scatter(torch.randn(8 * world, 16), w, chunks=chunks)


CASES = [
    pytest.param(_ring_all_reduce, 2, (5000,), None, id="ring-2-ranks"),
    pytest.param(_ring_all_reduce, 3, (5000,), None, id="ring-3-ranks"),
    pytest.param(_ring_all_reduce, 3, (5000,), ok.Link(10, 10), id="ring-3-ranks-link"),
    pytest.param(_naive, 3, (1000,), None, id="naive-3-ranks"),
    pytest.param(_all_to_all, 3, (2000,), None, id="all-to-all-3-ranks"),
    pytest.param(_tensor_parallel, 2, (2,), None, id="tensor-parallel-2-ranks"),
    pytest.param(_tensor_parallel, 3, (2,), None, id="tensor-parallel-3-ranks"),
    *[
        pytest.param(
            _pipeline,
            2,
            (schedule, m, overlap),
            None,
            id=f"pipeline-{schedule}-m{m}-{'overlap' if overlap else 'serial'}",
        )
        for schedule in ("gpipe", "1f1b")
        for m in (1, 4)
        for overlap in (False, True)
    ],  # fmt: skip
    pytest.param(_pipeline, 2, ("1f1b", 4, True), ok.Link(10, 10), id="pipeline-link"),
]


@pytest.mark.parametrize(("case", "world", "args", "link"), CASES)
def test_the_kits_messages_cannot_hang_under_nccls_blocking_rule(case, world, args, link):
    posts = _run(case, world, *args, link=link)
    assert all(posts.values()), "a rank posted nothing through the process group"
    left = stuck(posts)
    assert not left, f"NCCL would hang with these posted but unmatched: {left}"


@pytest.mark.parametrize(
    ("case", "world", "args"),
    [
        pytest.param(_ring_all_reduce, 2, (5000,), id="ring-2-ranks"),
        pytest.param(_tensor_parallel, 2, (2,), id="tensor-parallel-2-ranks"),
        pytest.param(_pipeline, 2, ("1f1b", 4, True), id="pipeline-1f1b-overlap"),
    ],
)
def test_the_same_orders_would_hang_if_both_directions_shared_one_stream(case, world, args):
    assert stuck(_run(case, world, *args), stream_of=pair_stream)


def test_the_simulator_finds_the_pipeline_hang_of_a_shared_stream():
    """Stage 0 posts send a0, recv g0, send a1; stage 1 recv a0, recv a1, send g0."""
    act, grad = ("user", "g", 0, 1), ("user", "g", 1, 0)
    posts = {
        0: [("m", "send", act, 1, 8, "f32"), ("m", "recv", grad, 1, 8, "f32"),
            ("m", "send", act, 1, 8, "f32")],
        1: [("m", "recv", act, 0, 8, "f32"), ("m", "recv", act, 0, 8, "f32"),
            ("m", "send", grad, 0, 8, "f32")],
    }  # fmt: skip
    assert stuck(posts, stream_of=pair_stream)
    assert not stuck(posts)


def test_the_simulator_names_a_send_received_with_another_size():
    route = ("kit", "g", 0, 1)
    posts = {0: [("m", "send", route, 1, 8, "f32")], 1: [("m", "recv", route, 0, 4, "f32")]}
    with pytest.raises(ValueError, match="sent 8 B f32, received into 4 B f32"):
        stuck(posts)
