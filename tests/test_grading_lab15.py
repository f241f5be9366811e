"""Lab 15's check: a latency-hiding order passes; each typical mistake is named (waits not
sunk, starts not raised, the newest collective waited for first, the limit on bytes in
flight ignored, one rank's own timings deciding the order, an order that cannot run)."""

import pytest

import overlapkit as ok

from .conftest import failed_with


def scheduler(pick_compute=None, oldest=True, limit=True, starts_first=True, in_order=True,
              fits=lambda held, op, limit: held + op.nbytes <= limit):  # fmt: skip
    """A learner's list scheduler, with the choices a mistake changes."""

    def latency_hiding_order(graph, max_in_flight):
        order, done, flying, todo = [], set(), [], list(graph.ops)

        def ready(op):
            return all(n in done for n in op.needs)

        def issue(op):
            todo.remove(op)
            done.add(op.name)
            order.append(op.name)

        while todo:
            bound = max_in_flight if limit else float("inf")
            held = sum(b for _, b in flying)
            starts = [op for op in todo if op.kind == "start" and (in_order or ready(op))]
            starts = [op for op in starts[:1] if in_order] or starts
            starts = [op for op in starts if ready(op) and (fits(held, op, bound) or not flying)]
            work = [op for op in todo if op.kind == "compute" and ready(op)]
            if starts and (starts_first or not work):
                issue(starts[0])
                flying.append((starts[0].name, starts[0].nbytes))
            elif work:
                issue(pick_compute(work) if pick_compute else work[0])
            else:
                name = flying.pop(0 if oldest else -1)[0]
                issue(next(op for op in todo if op.kind == "wait" and name in op.needs))
        return order

    return latency_hiding_order


def test_a_latency_hiding_order_passes_every_case():
    result = ok.grading.check_latency_hiding_order(scheduler())
    assert result.all_passed, result.cases
    assert len(result.cases) == 8


def test_program_order_is_told_to_sink_its_waits():
    def latency_hiding_order(graph, max_in_flight):
        return [op.name for op in graph.ops]

    failed_with(ok.grading.check_latency_hiding_order(latency_hiding_order),
                "'wait ar fc4' at order[2] stalls the compute stream",
                "which does not need it, could run first: issue compute that does not need a "
                "collective before waiting for it")  # fmt: skip


def test_compute_before_starts_is_told_to_raise_the_starts():
    failed_with(ok.grading.check_latency_hiding_order(scheduler(starts_first=False)),
                "Start each collective as soon as its inputs are issued")  # fmt: skip


def test_waiting_for_the_newest_collective_first_is_named():
    failed_with(ok.grading.check_latency_hiding_order(scheduler(oldest=False)),
                "started before it, is still in flight",
                "so wait for the oldest first")  # fmt: skip


def test_an_ignored_limit_on_bytes_in_flight_is_named_with_what_is_held():
    failed_with(ok.grading.check_latency_hiding_order(scheduler(limit=False)),
                "data-parallel backward, 2 MiB in flight: order[3]: starting 'start ar fc3' puts "
                "4 MiB in flight (start ar fc4, start ar fc3), above the limit 2 MiB")  # fmt: skip


def test_a_later_start_that_jumps_ahead_of_one_that_does_not_fit_yet_is_named():
    failed_with(ok.grading.check_latency_hiding_order(scheduler(in_order=False)),
                "fully sharded forward with a wide layer, 1",
                "which the program starts first: a later collective that jumps ahead",
                "Start the collectives in program order")  # fmt: skip


def test_a_limit_kept_with_less_than_instead_of_at_most_misses_the_step():
    strict = scheduler(fits=lambda held, op, limit: held + op.nbytes < limit)
    failed_with(ok.grading.check_latency_hiding_order(strict),
                "fully sharded forward with a wide layer, 16 MiB in flight: step",
                "It fitted there: 16 MiB in flight is at most the limit",
                "(<=, not <; and only collectives started and not yet waited for")  # fmt: skip


def test_a_collective_larger_than_the_limit_runs_alone_and_a_graph_cannot_be_rewritten():
    def latency_hiding_order(graph, max_in_flight):
        graph.ops = ()  # the graph stays whole for the next call
        return []

    failed_with(ok.grading.check_latency_hiding_order(latency_hiding_order),
                "cannot assign to field 'ops'")  # fmt: skip
    graph = ok.scheduling.fsdp_forward([("a", 0.01, 4 * 2**20), ("b", 0.01, 12 * 2**20)],
                                       ok.Link(100, 0.25))  # fmt: skip
    order = ok.scheduling.latency_hiding_order(graph, 8 * 2**20)
    ok.scheduling.validate(graph, order, 8 * 2**20)  # 12 MiB alone, over the 8 MiB limit


def test_an_order_chosen_by_one_ranks_own_timings_is_told_ranks_must_agree():
    # the shortest ready compute first, each collective started as soon as it is ready
    shortest = scheduler(pick_compute=lambda work: min(work, key=lambda op: op.seconds),
                         in_order=False)  # fmt: skip
    result = ok.grading.check_latency_hiding_order(shortest)
    failed_with(result, "given rank 1's measured times",
                "its collective #0 is 'start ar b' where rank 0's is 'start ar a'",
                "never by one rank's own timings")  # fmt: skip


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("return [op.name for op in graph.ops][:-1]",
         "the order leaves out 1 of 16 operations: 'update fc1'"),
        ("return None", "an order is a list of operation names; got NoneType"),
        ("return list(graph.ops)", "the value holds an object of overlapkit.scheduling.Op"),
        ("raise NotImplementedError", "not implemented yet"),
    ],
)  # fmt: skip
def test_an_order_that_cannot_run_is_named(body, words):
    namespace = {}
    exec(f"def latency_hiding_order(graph, max_in_flight):\n    {body}\n", namespace)
    failed_with(ok.grading.check_latency_hiding_order(namespace["latency_hiding_order"]), words)


def test_two_different_orders_for_one_graph_are_named():
    from overlapkit.grading.lab15_schedule import _judge_repeat

    report = ok.grading.Report("latency_hiding_order")
    first, second = ["a", "b", "c"], ["a", "c", "b"]
    _judge_repeat(report, [("the case", None, None, first)], [(True, second)])
    failed_with(report, "the case: asked twice for the same graph, your function returned two "
                        "orders (order[1] is 'b', then 'c')", "no random pick")  # fmt: skip
    same = ok.grading.Report("latency_hiding_order")
    _judge_repeat(same, [("the case", None, None, first)], [(True, list(first))])
    assert same.cases == []


def test_a_call_that_never_returns_is_told_a_large_collective_runs_alone():
    def latency_hiding_order(graph, max_in_flight):
        # as the check's call limit words it when a scheduler loops for 60 s
        raise TimeoutError("latency_hiding_order() did not return within 60 s")

    failed_with(
        ok.grading.check_latency_hiding_order(latency_hiding_order),
        "did not return within 60 s",
        "a collective larger than the limit runs alone",
    )
