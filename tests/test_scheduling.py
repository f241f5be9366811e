"""ok.scheduling: a step's graph, the orders it may be issued in, what an order costs on a
compute stream and a link, and the same orders issued on ranks."""

import pytest

import overlapkit as ok
from overlapkit import scheduling
from overlapkit.p2p import CollectiveMismatchError

LINK = ok.Link(100, 0.25)
MiB = 2**20
LAYERS = [(f"fc{i}", 0.008, 2 * MiB) for i in range(1, 5)]


def ddp():
    return scheduling.ddp_backward(LAYERS, LINK, world=2, update_s=0.001)


def test_program_order_overlaps_nothing_so_its_step_is_compute_plus_link():
    graph = ddp()
    sim = scheduling.simulate(graph, graph.program_order())
    link = sum(op.seconds for op in graph.ops if op.kind == "start")
    assert sim.compute == pytest.approx(4 * 0.008 + 4 * 0.001)
    assert sim.step == pytest.approx(sim.compute + link)
    assert sim.exposed == pytest.approx(link)


def test_the_kits_scheduler_hides_the_link_behind_the_backwards():
    graph = ddp()
    order = scheduling.latency_hiding_order(graph)
    raised = [x for n, _, _ in reversed(LAYERS) for x in (f"backward {n}", f"start ar {n}")]
    assert order[:8] == raised
    sim = scheduling.simulate(graph, order)
    # the last AllReduce starts after the last backward: only it and the updates stay exposed
    last = graph.op("start ar fc1").seconds
    assert sim.step == pytest.approx(max(4 * 0.008 + last, 0.008 + 4 * last) + 0.001)


def test_the_limit_on_bytes_in_flight_is_kept_and_a_collective_alone_may_exceed_it():
    graph = scheduling.fsdp_forward([(f"l{i}", 0.009, 4 * MiB) for i in range(4)], LINK)
    for limit in (4 * MiB, 8 * MiB, 2 * MiB):
        order = scheduling.latency_hiding_order(graph, limit)
        scheduling.validate(graph, order, limit)  # raises where the limit is broken
    too_much = r"order\[1\]: starting 'start ag l1' puts 8 MiB"
    with pytest.raises(scheduling.OrderError, match=too_much):
        scheduling.validate(graph, ["start ag l0", "start ag l1"], 4 * MiB)


NOT_RUNNABLE = [
    (lambda g: g.program_order()[:-1], "the order leaves out 1 of 16 operations: 'update fc1'"),
    (lambda g: [*g.program_order(), "backward fc4"], "order[16]: 'backward fc4' is issued twice"),
    (lambda g: ["start ar fc4", *g.program_order()],
     "order[0]: 'start ar fc4' needs 'backward fc4' (order[1]), not issued before it"),
    (lambda g: [*g.program_order()[:-1], "update fc9"],
     "order[15]: 'update fc9' is not an operation"),
    (lambda g: "backward fc4", "an order is a list of operation names; got str"),
    (lambda g: [*g.program_order()[:-1], 3], "order[15]: 3 is not an operation's name"),
]  # fmt: skip


@pytest.mark.parametrize(("order", "words"), NOT_RUNNABLE)
def test_an_order_that_cannot_run_is_refused_with_where_and_why(order, words):
    graph = ddp()
    with pytest.raises(scheduling.OrderError) as err:
        scheduling.simulate(graph, order(graph))
    assert words in str(err.value)


def _on_ranks(orders, layers=LAYERS):
    graph = scheduling.ddp_backward(layers, LINK, world=2, update_s=0.001)
    order = orders[ok.rank()]
    return scheduling.run(graph, order, repeats=2)["step"]


def test_an_order_runs_on_ranks_with_the_kits_asynchronous_collectives():
    graph = ddp()
    order = scheduling.latency_hiding_order(graph)
    steps = ok.launch(_on_ranks, [order, order], world_size=2, link=LINK, timeout=60)
    assert all(step > scheduling.simulate(graph, order).compute for step in steps)


def test_ranks_that_start_differently_sized_collectives_in_different_orders_are_told():
    # gradients of different sizes: the kit's announcements tell the two calls apart (of one
    # size they would pair silently, each rank reducing another layer's gradient, as NCCL does)
    layers = [(f"fc{i}", 0.008, i * MiB) for i in range(1, 5)]
    graph = scheduling.ddp_backward(layers, LINK, world=2, update_s=0.001)
    mine = scheduling.latency_hiding_order(graph)
    i = mine.index("start ar fc3")
    assert mine[i : i + 3] == ["start ar fc3", "backward fc2", "start ar fc2"]
    # rank 1 runs backward fc2 first and starts fc2's AllReduce before fc3's: a valid order
    theirs = [*mine[:i], "backward fc2", "start ar fc2", "start ar fc3", *mine[i + 3 :]]
    scheduling.validate(graph, theirs)
    with pytest.raises(CollectiveMismatchError) as err:
        ok.launch(_on_ranks, [mine, theirs], layers, world_size=2, link=LINK, timeout=60)
    assert "ring_all_reduce" in str(err.value)


def test_the_torch_names_lab_15_relies_on_are_in_this_torch():
    """Lab 15 turns on inductor's reordering passes by these names and reads its generated
    code with run_and_get_code; its map names the other switches: a release that renames
    one must fail here, not in a learner's notebook."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.comms as comms
    import torch._inductor.config as inductor
    import torch._inductor.utils as inductor_utils
    import torch.distributed._functional_collectives as funcol
    import torch.distributed._symmetric_memory as symm_mem

    for name in ("sink_waits", "raise_comms", "reorder_compute_for_overlap",
                 "align_runtime_estimations_across_all_distributed_ranks"):  # fmt: skip
        assert callable(getattr(comms, name, None)), name
    assert inductor.reorder_for_compute_comm_overlap is False  # off unless a job turns it on
    assert isinstance(inductor.reorder_for_compute_comm_overlap_passes, list)
    assert hasattr(inductor, "_micro_pipeline_tp")
    assert hasattr(dynamo_config, "optimize_ddp")
    assert callable(inductor_utils.run_and_get_code)
    assert callable(funcol.all_reduce) and callable(funcol.wait_tensor)
    assert callable(symm_mem.enable_symm_mem_for_group)
