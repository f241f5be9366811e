"""What the kit has sent and issued, as public counts: ``ok.p2p.stats()`` and
``ok.ordering.issued()``, read before and after a piece of code."""

from __future__ import annotations

import pytest
import torch

import overlapkit as ok

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")


def _sends_and_counts():
    before = ok.p2p.stats()
    t = torch.arange(1000, dtype=torch.float32)
    if ok.rank() == 0:
        ok.p2p.send(t, 1)
    else:
        ok.p2p.recv(t, 0)
    after = ok.p2p.stats()
    return (
        after.bytes_sent - before.bytes_sent,
        after.user_group_messages - before.user_group_messages,
    )


def test_stats_count_the_bytes_a_rank_sent_and_its_messages_on_torchs_groups():
    # without a link, on the CPU, a kit message travels on torch's own group: one message
    # in its sequence on each side, the payload's bytes on the sender's
    assert ok.launch(_sends_and_counts, world_size=2, quiet=True) == [(4000, 1), (0, 1)]


def test_stats_count_the_bytes_sent_over_a_link_and_no_message_on_torchs_groups():
    values = ok.launch(_sends_and_counts, world_size=2, link=ok.Link(0, 10), quiet=True)
    assert values == [(4000, 0), (0, 0)]


def _issues_and_counts():
    before = ok.ordering.issued()
    t = torch.ones(8)
    ok.ring_all_reduce(t)
    ok.ordering.run_async(lambda: None).wait()
    after = ok.ordering.issued()
    ok.p2p.open_groups()  # made already by the ring: nothing more to do, and no error
    return after.ops - before.ops, after.collectives - before.collectives, t[0].item()


def test_issued_counts_each_kit_operation_and_of_them_the_collectives():
    assert ok.launch(_issues_and_counts, world_size=2, quiet=True) == [(2, 1, 2.0)] * 2


def test_the_worker_code_is_the_loop_that_runs_async_operations():
    code = ok.ordering.worker_code()
    assert code.co_name == "_loop" and code.co_filename == ok.ordering.__file__
