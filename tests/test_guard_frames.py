"""The guard of a learner's call reads the calling thread's frames from other threads
without the freeze Python 3.11's ``sys._current_frames`` risks (CPython gh-106883)."""

from __future__ import annotations

import gc
import sys

import pytest

from overlapkit.sandbox import sealed

pytestmark = pytest.mark.skipif(
    sys.version_info >= (3, 12), reason="Python 3.12 collects only between instructions"
)


@pytest.fixture
def collector_seen_by_frames(monkeypatch):
    """Whether the collector was on, each time the guard read the threads' frames."""
    seen: list[bool] = []
    monkeypatch.setattr(sys, "_current_frames", lambda: seen.append(gc.isenabled()) or {})
    yield seen
    gc.enable()


def test_the_collector_is_paused_while_the_frames_are_read_and_on_again_after(
    collector_seen_by_frames,
):
    frames = sealed._frames_of_threads()
    assert frames() == {}
    assert collector_seen_by_frames == [False]
    assert gc.isenabled()


def test_a_collector_switched_off_before_stays_off(collector_seen_by_frames):
    frames = sealed._frames_of_threads()
    gc.disable()
    frames()
    assert collector_seen_by_frames == [False]
    assert not gc.isenabled()
