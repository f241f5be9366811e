"""Lab 10's check: a report that the re-measurement confirms passes; wrong ones are named."""

import pytest

import overlapkit as ok
from overlapkit.grading.lab10 import BASELINE, BATCH, LINK


@pytest.fixture(scope="module")
def measured():
    tuned = {"wrapper": "bucketed", "bucket_mb": 1}
    before, after = (
        ok.launch(ok.ddp.measure_step, **cfg, batch=BATCH, world_size=2, link=LINK)[0]
        for cfg in (BASELINE, tuned)
    )
    report = {side: {"step_ms": m["step_ms"], "hidden": m["hidden"]}
              for side, m in (("before", before), ("after", after))}  # fmt: skip
    return tuned, report


def _text(report):
    return "\n".join(m for _, m in report.cases)


def test_a_measured_tuning_passes(measured):
    tuned, report = measured
    result = ok.grading.check_tuning(report, tuned)
    assert result.all_passed, _text(result)


def test_a_step_reported_in_seconds_is_named(measured):
    tuned, report = measured
    wrong = {**report, "before": {**report["before"], "step_ms": report["before"]["step_ms"] / 1e3}}
    assert "that looks like seconds" in _text(ok.grading.check_tuning(wrong, tuned))


def test_a_configuration_that_hides_nothing_misses_the_target(measured):
    _, report = measured
    text = _text(ok.grading.check_tuning(report, {"wrapper": "naive"}))
    assert "NaiveDDP communicates after backward: nothing can hide" in text
    assert "the re-measurement gives 0.00" in text  # the reported "after" was not naive's


@pytest.mark.parametrize(
    ("tuned", "report", "words"),
    [
        (None, None, "not implemented yet (TUNED and REPORT are still None"),
        (None, {}, "TUNED must be a dict like"),
        ({"wrapper": "buckets"}, None, "'wrapper' one of naive, overlap, bucketed"),
        ({"wrapper": "bucketed", "bucket_mb": 0}, None, "must be a size in MiB > 0"),
        ({"wrapper": "bucketed"}, None, "TUNED has no 'bucket_mb'"),
        (
            {"wrapper": "bucketed", "bucket_mb": 25},
            {"before": {"step_ms": 50.0, "hidden": 0.0}, "after": {"step_ms": 50.0, "hidden": 0.0}},
            "TUNED is the baseline itself",
        ),  # fmt: skip
        (
            {"wrapper": "overlap"},
            {"before": {"step_ms": 1.0}, "after": {}},
            "REPORT['before']['hidden'] must be a number",
        ),  # fmt: skip
    ],
)
def test_malformed_answers_are_refused_without_measuring(tuned, report, words):
    assert words in _text(ok.grading.check_tuning(report, tuned))
