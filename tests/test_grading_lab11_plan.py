"""Lab 11's dispatch plan check: right plans pass, each typical mistake is named."""

import pytest
import torch

import overlapkit as ok


def moe_plan(expert_of, chunks):
    world = ok.world_size()
    orders, counts = [], []
    for lo, hi in ok.collectives.chunk_bounds(len(expert_of), chunks):
        orders.append(torch.argsort(expert_of[lo:hi], stable=True) + lo)
        counts.append(torch.bincount(expert_of[lo:hi], minlength=world))
    send = torch.stack(counts)
    return orders, send, ok.moe.exchange_counts(send)


def plan_by_loops(expert_of, chunks):
    """Lists, a loop per expert, an unstable order within an expert: all fine."""
    world = ok.world_size()
    orders, rows = [], []
    for lo, hi in ok.collectives.chunk_bounds(len(expert_of), chunks):
        tokens = list(range(lo, hi))
        orders.append(torch.tensor([t for e in range(world) for t in tokens[::-1]
                                    if int(expert_of[t]) == e]))  # fmt: skip
        rows.append([sum(int(expert_of[t]) == e for t in tokens) for e in range(world)])
    send = torch.tensor(rows)
    return orders, send, ok.moe.exchange_counts(send)


def without_minlength(expert_of, chunks):
    orders, counts = [], []
    for lo, hi in ok.collectives.chunk_bounds(len(expert_of), chunks):
        orders.append(torch.argsort(expert_of[lo:hi]) + lo)
        counts.append(torch.bincount(expert_of[lo:hi]))
    send = torch.stack(counts)
    return orders, send, ok.moe.exchange_counts(send)


def without_offset(expert_of, chunks):
    world = ok.world_size()
    orders, counts = [], []
    for lo, hi in ok.collectives.chunk_bounds(len(expert_of), chunks):
        orders.append(torch.argsort(expert_of[lo:hi]))
        counts.append(torch.bincount(expert_of[lo:hi], minlength=world))
    send = torch.stack(counts)
    return orders, send, ok.moe.exchange_counts(send)


def tokens_in_their_own_order(expert_of, chunks):
    world = ok.world_size()
    bounds = ok.collectives.chunk_bounds(len(expert_of), chunks)
    orders = [torch.arange(lo, hi) for lo, hi in bounds]
    send = torch.stack([torch.bincount(expert_of[lo:hi], minlength=world) for lo, hi in bounds])
    return orders, send, ok.moe.exchange_counts(send)


def recv_is_send(expert_of, chunks):
    orders, send, _ = moe_plan(expert_of, chunks)
    return orders, send, send.clone()


def recv_transposed(expert_of, chunks):
    orders, send, recv = moe_plan(expert_of, chunks)
    return orders, send, recv.t()


def counts_of_the_whole_batch(expert_of, chunks):
    world = ok.world_size()
    orders, _, _ = moe_plan(expert_of, chunks)
    send = torch.bincount(expert_of, minlength=world).repeat(chunks, 1)
    return orders, send, ok.moe.exchange_counts(send)


def even_chunks(expert_of, chunks):
    """len // chunks tokens per chunk: the remainder never leaves."""
    world = ok.world_size()
    size = len(expert_of) // chunks
    orders, counts = [], []
    for c in range(chunks):
        lo, hi = c * size, (c + 1) * size
        orders.append(torch.argsort(expert_of[lo:hi], stable=True) + lo)
        counts.append(torch.bincount(expert_of[lo:hi], minlength=world))
    send = torch.stack(counts)
    return orders, send, ok.moe.exchange_counts(send)


def only_the_orders(expert_of, chunks):
    return moe_plan(expert_of, chunks)[0]


def hard_coded_two(expert_of, chunks):
    orders, counts = [], []
    for lo, hi in ok.collectives.chunk_bounds(len(expert_of), chunks):
        orders.append(torch.argsort(expert_of[lo:hi], stable=True) + lo)
        counts.append(torch.bincount(expert_of[lo:hi], minlength=2))
    send = torch.stack(counts)
    return orders, send, ok.moe.exchange_counts(send)


def builtin_exchange(expert_of, chunks):
    import torch.distributed as dist

    orders, send, _ = moe_plan(expert_of, chunks)
    recv = torch.empty_like(send.t().contiguous())
    dist.all_to_all_single(recv, send.t().contiguous())
    return orders, send, recv.t()


@pytest.mark.parametrize("fn", [moe_plan, plan_by_loops], ids=lambda f: f.__name__)
def test_the_moe_plan_solutions_pass(fn):
    report = ok.grading.check_moe_plan(fn)
    assert report.all_passed, report.cases


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        (without_minlength, "bincount(…, minlength=N) gives every rank a count"),
        (without_offset, "numbers the chunk's tokens from 0. Add the chunk's offset"),
        (tokens_in_their_own_order, "a chunk's tokens leave grouped by expert, expert 0's first"),
        (recv_is_send, "recv is this rank's own send: what comes here is what the other ranks"),
        (recv_transposed, "recv is the counts transposed"),
        (counts_of_the_whole_batch, "the counts of all the rank's tokens: send[c] counts chunk"),
        (even_chunks, "ok.collectives.chunk_bounds(len(expert_of), chunks) gives each chunk"),
        (only_the_orders, "returned a list of 1: a torch.int64 tensor of shape [11]; return ("),
        (hard_coded_two, "did you write 2 (or minlength=2) where ok.world_size() belongs?"),
        (builtin_exchange, "use ok.moe.exchange_counts"),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_moe_plan_mistakes_are_named(fn, words):
    report = ok.grading.check_moe_plan(fn)
    assert not report.all_passed
    assert words in "\n".join(m for _, m in report.cases), report.cases


def test_the_plan_check_stops_at_its_first_failure_and_counts_every_case():
    report = ok.grading.check_moe_plan(without_offset)
    assert len(report.cases) == 3 and sum(passed for passed, _ in report.cases) == 1
