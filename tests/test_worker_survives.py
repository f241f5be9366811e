"""A group's communication worker outlives a profile function Python refuses to put in
place: the op is tried again, or fails with the reason, and the ops after it still run."""

from __future__ import annotations

import sys

import overlapkit as ok


def _with_refusals(refusals: int):
    real, left = sys.setprofile, [refusals]

    def refusing(fn):
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError(
                "Cannot install a profile function while another profile function is being "
                "installed"
            )
        return real(fn)

    sys.setprofile = refusing
    try:
        outcome = []
        try:
            outcome.append(ok.collectives.run_async(lambda: "done").wait() and "waited")
        except RuntimeError as exc:
            outcome.append(f"failed: {exc}")
        sys.setprofile = real
        outcome.append(ok.collectives.run_async(lambda: None).wait() and "next ran")
        return outcome
    finally:
        sys.setprofile = real


def test_a_profile_refused_a_few_times_is_tried_again_and_the_op_runs():
    assert ok.launch(_with_refusals, 3, world_size=1, timeout=60) == [["waited", "next ran"]]


def test_a_profile_refused_every_time_fails_that_op_and_the_next_one_still_runs():
    (outcome,) = ok.launch(_with_refusals, 10_000, world_size=1, timeout=60)
    assert outcome[0].startswith("failed: Cannot install a profile function"), outcome
    assert outcome[1] == "next ran"
