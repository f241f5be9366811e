"""ok.launch's one extension point (overlapkit.rankhook): a context around the function on
every rank, a channel from each rank to the caller, preloaded modules, and what runs
once a rank's value has gone."""

from __future__ import annotations

import contextlib
import json
import os

import pytest

import overlapkit as ok
from overlapkit import launcher, rankhook

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")


class Tally(ok.RankHook):
    """Around fn: says on the channel that it entered and left, with the rank."""

    def __init__(self):
        self.by_rank = None

    @contextlib.contextmanager
    def _around(self):
        conn = rankhook.channel()
        conn.send_bytes(f"in {ok.rank()}".encode())
        try:
            yield
        finally:
            conn.send_bytes(f"out {ok.rank()}".encode())

    def around(self):
        return self._around()

    def heard(self, by_rank, garbled):
        self.by_rank = ({r: [m.decode() for m in ms] for r, ms in by_rank.items()}, garbled)


def _says_where_it_runs():
    rankhook.channel().send_bytes(f"fn {ok.rank()}".encode())
    return ok.rank()


def test_the_hooks_context_wraps_the_function_and_the_caller_hears_each_rank_in_order():
    hook = Tally()
    assert ok.launch(_says_where_it_runs, world_size=2, hook=hook, quiet=True) == [0, 1]
    assert hook.by_rank == ({0: ["in 0", "fn 0", "out 0"], 1: ["in 1", "fn 1", "out 1"]}, set())
    assert launcher.heard() == (
        {r: [f"{w} {r}".encode() for w in ("in", "fn", "out")] for r in (0, 1)},
        set(),
    )


def _raises():
    rankhook.channel().send_bytes(b"before")
    raise ValueError("on purpose")


def test_what_a_rank_sent_before_it_failed_is_heard():
    hook = Tally()
    with pytest.raises(ValueError, match="on purpose"):
        ok.launch(_raises, world_size=2, hook=hook, quiet=True)
    heard, garbled = hook.by_rank
    assert garbled == set()
    for r in (0, 1):
        assert heard[r][:2] == [f"in {r}", "before"]


def _too_long():
    rankhook.channel().send_bytes(b"x" * (rankhook.CHANNEL_LIMIT + 1))
    return 0


def test_a_message_longer_than_the_channel_carries_marks_its_rank_garbled():
    # the caller closes a channel that carried too much: the rank's write fails there
    with pytest.raises(BrokenPipeError):
        ok.launch(_too_long, world_size=2, quiet=True)
    heard, garbled = launcher.heard()
    assert garbled == {0, 1}


def _ends_then_writes(folder):
    me = rankhook.this_rank()

    def later(limit_s):
        with open(os.path.join(folder, f"end{me.rank}"), "w") as f:
            f.write(json.dumps([me.world_size, limit_s]))

    rankhook.at_end(later)
    return me.rank


def test_at_end_runs_after_the_value_is_sent_with_the_launchs_timeout(tmp_path):
    assert ok.launch(_ends_then_writes, str(tmp_path), world_size=2, timeout=77, quiet=True) == [
        0,
        1,
    ]
    for r in (0, 1):
        assert json.loads((tmp_path / f"end{r}").read_text()) == [2, 77]


def test_this_rank_is_none_in_the_caller():
    assert rankhook.this_rank() is None
    assert rankhook.channel() is None


class PreloadsJson(ok.RankHook):
    preload = ("json.tool",)


def _has_json_tool():
    import sys

    return "json.tool" in sys.modules


def test_a_hooks_preload_is_imported_on_its_ranks_and_stays_for_later_launches():
    assert ok.launch(_has_json_tool, world_size=1, hook=PreloadsJson(), quiet=True) == [True]
    assert "json.tool" in launcher.PRELOAD
    assert ok.launch(_has_json_tool, world_size=1, quiet=True) == [True]


def _matmuls_and_all_reduces():
    import torch
    import torch.distributed as dist

    x = torch.randn(128, 128)
    for _ in range(3):
        y = x @ x
        dist.all_reduce(y)
    return ok.rank()


def test_profile_ranks_brings_back_each_ranks_trace_with_its_compute_and_communication(tmp_path):
    traces = ok.profiling.ProfileRanks(tmp_path / "traces", cuda=False)
    assert ok.launch(_matmuls_and_all_reduces, world_size=2, hook=traces, quiet=True) == [0, 1]
    assert traces.paths == {r: str(tmp_path / "traces" / f"rank{r}.json") for r in (0, 1)}
    for timeline in traces.timelines().values():
        lanes = {span.lane for span in timeline.spans}
        assert {"compute", "comm"} <= lanes
