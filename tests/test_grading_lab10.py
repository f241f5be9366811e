"""Lab 10's check: a table measured just before passes (also beside a CPU hog); a table
that was not measured earns nothing (not noted by measure(), or noted but not what the
check re-measures); each mistake is named."""

import copy
import itertools
import statistics

import pytest

import overlapkit as ok
from overlapkit.grading import lab10, lab10_measure
from overlapkit.grading.common import plain_number
from overlapkit.grading.lab10 import BASELINE, BATCH, LINK
from overlapkit.sandbox import records

from .conftest import Agreeable, _soaking, soak_runs

ONE_MIB = {"wrapper": "bucketed", "bucket_mb": 1}
#: the two knobs together: overlap (2 MiB buckets) and 16-bit gradients; meets the goal
TUNED = {"wrapper": "bucketed", "bucket_mb": 2, "compress": "fp16"}
#: an invented table: plausible-looking, guessable lines, never measured
INVENTED = {"before": {"step_ms": 40.0, "hidden": 0.0}, "after": {"step_ms": 30.0, "hidden": 0.8}}
#: a made-up table is re-measured and refused this often (each run ~10-25 s here)
MISTAKE_RUNS = soak_runs(1)  # (20 under `make soak`)
NOT_MEASURED = "the table is not what these configurations measure, so this exercise earns nothing"
measure = lab10.measure  # the lab's own: one fresh launch of measure_step, noted


def measure_unnoted(config, **kwargs):
    """measure_step launched as measure() does, without noting the result."""
    return ok.launch(ok.ddp.measure_step, **config, **kwargs, batch=BATCH, world_size=2,
                     link=LINK)[0]  # fmt: skip


@pytest.fixture(autouse=True)
def _notes_kept_per_test():
    """What a test notes (or clears) stays in that test; the module's measured table too."""
    kept = copy.deepcopy(records.NOTES)
    yield
    records.NOTES.clear()
    records.NOTES.update(kept)


def forge_notes(table, tuned):
    """Note the table's rows as measure() results (what a forger's cell could do)."""
    for side, config in (("before", BASELINE), ("after", tuned)):
        records.note(lab10.NOTED, {"config": config, **table[side]})


def table_of(before, after):
    return {side: {"step_ms": m["step_ms"], "hidden": m["hidden"]}
            for side, m in (("before", before), ("after", after))}  # fmt: skip


def honest_table(tuned):
    """Before and after as the lab measures them: one pair, one right after the other (the
    goal is judged on the check's re-measurement, not on this pair: beside a CPU hog, three
    1 MiB pairs in a row once took 1.17x the baseline's step or more)."""
    return table_of(measure(BASELINE), measure(tuned))


def _text(report, marks=False):
    return "\n".join(("✔ " if ok else "✘ ") * marks + m for ok, m in report.cases)


@pytest.fixture(scope="module")
def measured():
    return honest_table(TUNED)


@pytest.fixture(scope="module")
def floor():
    """Each side's fastest step in 20: this machine steps at least that fast."""
    return {side: min(measure_unnoted(config, steps=20, per_step=True)["per_step"]["step_ms"])
            for side, config in (("before", BASELINE), ("after", TUNED))}  # fmt: skip


#: the step goal the tests that measure on this machine hold TUNED to. `make soak` (one
#: pytest process, a CPU hog beside it) holds the lab's own 0.75x. `make test` runs them
#: beside three other workers (a load of 4-8 on 2 cores), where the overlapped step's
#: communication worker waits for a core: honest 2 MiB fp16 tables re-measured 0.80x and
#: 0.93x there, so there TUNED must only step faster than the baseline. The goal's own
#: arithmetic at 0.75x is tested on given measurements below.
GOAL_HERE = lab10.TARGET_STEP if _soaking() else 1.0


def test_a_table_measured_just_before_passes(measured):
    result = ok.grading.check_tuning(measured, TUNED, target_step=GOAL_HERE)
    assert result.all_passed, _text(result)


def no_launch(monkeypatch):
    """The check must decide without re-measuring: a launch fails the test."""

    def launch(*args, **kwargs):
        raise AssertionError("the check re-measured a table it should have refused first")

    monkeypatch.setattr(lab10, "launch", launch)


def test_an_invented_table_earns_nothing_every_time_without_measuring(monkeypatch):
    no_launch(monkeypatch)
    records.NOTES.clear()  # measure() never ran: the table was typed in
    for _ in range(20):
        result = ok.grading.check_tuning(INVENTED, ONE_MIB)
        text = _text(result)
        assert result.score == 0, text
        assert text.startswith(
            "before: step 40 ms, hidden 0: measure(BASELINE) never ran in this notebook "
            "(BASELINE is {'wrapper': 'bucketed', 'bucket_mb': 25}): measure it with the "
            "notebook's measure(), which notes what it returns (numbers from a launch of your "
            "own, or typed in, do not count)\nafter: step 30 ms, hidden 0.8: measure(TUNED) "
            "never ran"
        ), text
        assert text.endswith(lab10.NOT_NOTED)


#: what a learner's measure() calls returned (noted), for the checks of where rows came from
NOTED_BEFORE = {"step_ms": 412.34, "hidden": 0.01}
NOTED_AFTER = {"step_ms": 350.21, "hidden": 0.72}


def note_measured(*rows):
    records.NOTES.clear()
    for config, row in rows:
        records.note(lab10.NOTED, {"config": config, **row})


def test_a_made_up_800_ms_baseline_beside_a_measured_after_is_named_without_measuring(
    monkeypatch,
):
    no_launch(monkeypatch)
    note_measured((BASELINE, NOTED_BEFORE), (ONE_MIB, NOTED_AFTER), (BASELINE, NOTED_BEFORE))
    table = {"before": {"step_ms": 800.0, "hidden": 0.0}, "after": NOTED_AFTER}
    for _ in range(20):
        result = ok.grading.check_tuning(table, ONE_MIB)
        assert result.score == 0 and result.total == 2, _text(result)
        assert _text(result).startswith(
            "before: step 800 ms, hidden 0 is not what measure(BASELINE) returned here: step "
            "800 against 412.3 ms (rounding may move it 0.5%) and hidden 0 against 0.01 (2 "
            "decimals) (it returned 412.3 ms, hidden 0.01; 412.3 ms, hidden 0.01)\n"
        ), _text(result)


def test_rows_copied_rounded_count_as_measured(monkeypatch):
    note_measured((BASELINE, NOTED_BEFORE), (ONE_MIB, NOTED_AFTER))
    rounded = {
        "before": {"step_ms": 412.0, "hidden": 0.01},
        "after": {"step_ms": 350, "hidden": 0.72},
    }
    assert lab10._unmeasured(rounded, ONE_MIB) == []
    nudged = {"before": rounded["before"], "after": {"step_ms": 350.2, "hidden": 0.75}}
    assert lab10._unmeasured(nudged, ONE_MIB) == [
        (
            "after: step 350.2 ms, hidden 0.75 is not what measure(TUNED) returned here: "
            "hidden 0.75 against 0.72 (2 decimals) (it returned 350.2 ms, hidden 0.72)",
            False,
        )
    ]


def test_where_a_row_came_from_is_named_swapped_other_configuration_units(monkeypatch):
    no_launch(monkeypatch)
    eight = {"wrapper": "bucketed", "bucket_mb": 8}
    eight_row = {"step_ms": 389.7, "hidden": 0.0}
    note_measured((BASELINE, NOTED_BEFORE), (ONE_MIB, NOTED_AFTER), (eight, eight_row))
    cases = [
        ({"before": NOTED_AFTER, "after": NOTED_BEFORE}, ONE_MIB, [
            "before: step 350.2 ms, hidden 0.72 is what measure({'wrapper': 'bucketed', "
            "'bucket_mb': 1}) returned here, not measure(BASELINE) — before and after swapped?",
            "after: step 412.3 ms, hidden 0.01 is what measure({'wrapper': 'bucketed', "
            "'bucket_mb': 25}) returned here, not measure(TUNED) — before and after swapped?",
        ]),
        ({"before": NOTED_BEFORE, "after": eight_row}, {"wrapper": "bucketed", "bucket_mb": 2}, [
            "after: step 389.7 ms, hidden 0 is what measure({'wrapper': 'bucketed', "
            "'bucket_mb': 8}) returned here, not measure(TUNED) ({'wrapper': 'bucketed', "
            "'bucket_mb': 2}): REPORT['after'] is from another configuration",
        ]),
        ({"before": {"step_ms": 0.41234, "hidden": 0.01},
          "after": {"step_ms": 350.21, "hidden": 72.0}}, ONE_MIB, [
            "before: measure(BASELINE) returned this row in other units: step_ms is 0.4123: "
            "that looks like seconds — report milliseconds",
            "after: measure(TUNED) returned this row in other units: hidden is 72, a "
            "percentage: report the share (0–1)",
        ]),
    ]  # fmt: skip
    for table, tuned, lines in cases:  # each row measured: in other units, or misplaced
        result = ok.grading.check_tuning(table, tuned)
        last = lab10.MISPLACED
        if len(lines) == 1:  # the right row is named, and earns nothing alone
            last += " (before is what measure(BASELINE) returned; the other row is not)"
        assert _text(result).split("\n") == [*lines, last]
        assert result.score == 0


def test_a_baseline_that_hid_nothing_reported_in_seconds_is_not_called_a_percentage():
    note_measured((BASELINE, NOTED_BEFORE | {"hidden": 0.0}), (ONE_MIB, NOTED_AFTER))
    table = {"before": {"step_ms": 0.41234, "hidden": 0.0}, "after": NOTED_AFTER}
    assert lab10._unmeasured(table, ONE_MIB) == [
        ("before: measure(BASELINE) returned this row in other units: step_ms is 0.4123: "
         "that looks like seconds — report milliseconds", True)
    ]  # fmt: skip


@pytest.mark.timeout(1800)
def test_forged_notes_of_a_table_four_times_faster_than_any_step_earn_nothing_every_time(floor):
    # a quarter: it would pass only if the check's fastest step were 3x faster than any
    # of these 20 (a halved table passed once: its steps ran in a spell 1.5x busier)
    boasted = {"before": {"step_ms": floor["before"] / 4, "hidden": 0.0},
               "after": {"step_ms": floor["after"] / 4, "hidden": 0.85}}  # fmt: skip
    forge_notes(boasted, TUNED)
    for _ in range(MISTAKE_RUNS):
        result = ok.grading.check_tuning(boasted, TUNED)
        assert result.score == 0, _text(result)
        assert NOT_MEASURED in _text(result)


def test_units_mistakes_are_named_and_earn_nothing(measured):
    wrong = {
        "before": {**measured["before"], "step_ms": measured["before"]["step_ms"] / 1e3},
        "after": {**measured["after"], "hidden": measured["after"]["hidden"] * 100},
    }
    result = ok.grading.check_tuning(wrong, TUNED)
    text = _text(result)
    assert result.score == 0, text
    assert "before: measure(BASELINE) returned this row in other units: step_ms is" in text
    assert "that looks like seconds" in text
    assert "after: measure(TUNED) returned this row in other units: hidden is" in text
    assert "a percentage: report the share (0–1)" in text


def test_the_table_of_another_configuration_earns_nothing(measured):
    result = ok.grading.check_tuning(measured, {"wrapper": "naive"})
    text = _text(result)
    assert result.score == 0, text
    assert (
        "is what measure({'wrapper': 'bucketed', 'bucket_mb': 2, 'compress': 'fp16'}) "
        "returned here, not " in text
    )
    assert "not measure(TUNED) ({'wrapper': 'naive'}): REPORT['after'] is from another" in text


#: each run: the lab's two measure() launches, then the check (~30-60 s here): 20 under
#: `make soak`, 2 in the test suite (its time on 2 cores is bounded)
HOG_RUNS = soak_runs(1)  # ~50 s a run beside the hog and another pytest worker; make soak: 20


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_table_measured_just_before_passes_every_run_with_a_cpu_hog(cpu_hog):
    results = []
    for _ in range(HOG_RUNS):
        table = honest_table(TUNED)
        result = ok.grading.check_tuning(table, TUNED, target_step=GOAL_HERE)
        results.append((result.all_passed, table, _text(result)))
    assert [passed for passed, *_ in results] == [True] * HOG_RUNS, results


AGREEABLE = Agreeable(30.0)


def test_numpys_own_scalars_are_plain_numbers_and_their_subclasses_are_not():
    import numpy as np  # noqa: PLC0415

    class Float64(np.float64):
        pass

    assert plain_number(np.float64(30.0)) and plain_number(np.float32(0.5)) and plain_number(3)
    assert not plain_number(Float64(30.0))
    assert not plain_number(AGREEABLE) and not plain_number(True)


@pytest.mark.parametrize(
    ("tuned", "report", "words"),
    [
        (None, None, "not implemented yet (TUNED and REPORT are still None"),
        (None, {}, "TUNED must be a dict like"),
        ({"wrapper": "buckets"}, None, "'wrapper' must be one of naive, overlap, bucketed"),
        ({"wrapper": "bucketed", "bucket_mb": 0}, None, "must be a size in MiB > 0"),
        ({"wrapper": "bucketed"}, None, "TUNED has no 'bucket_mb'"),
        (
            {"wrapper": "bucketed", "bucket_mb": 2, "compress": "fp8"},
            None,
            "TUNED: 'compress' must be None (32-bit gradients) or one of 'fp16', 'bf16'; got 'fp8'",
        ),
        (
            {"wrapper": "bucketed", "bucket_mb": 2, "compress": True},
            None,
            "'compress' must be None (32-bit gradients) or one of 'fp16', 'bf16'; got True",
        ),
        (
            {"wrapper": "bucketed", "bucket_mb": 2, "dtype": "fp16"},
            None,
            "TUNED has keys ['dtype']: the lab's setup takes only wrapper, bucket_mb and compress",
        ),
        (
            {"wrapper": "bucketed", "bucket_mb": 25.0},
            {"before": {"step_ms": 50.0, "hidden": 0.0}, "after": {"step_ms": 50.0, "hidden": 0.0}},
            "TUNED is the baseline itself",
        ),  # fmt: skip
        (
            {"wrapper": "overlap"},
            {"before": {"step_ms": 1.0, "hidden": None}, "after": {}},
            "REPORT['before']['hidden'] must be a plain int or float (as measure() returns it); "
            "got NoneType None",
        ),  # fmt: skip
        (  # a float whose arithmetic agrees with any re-measurement
            {"wrapper": "overlap"},
            {"before": {"step_ms": AGREEABLE, "hidden": 0.0}, "after": {"step_ms": 1.0}},
            "REPORT['before']['step_ms'] must be a plain int or float (as measure() returns it); "
            "got Agreeable 30.0",
        ),  # fmt: skip
        (
            {"wrapper": "overlap"},
            {"before": {"step_ms": 40.0, "hidden": True}, "after": {"step_ms": 1.0, "hidden": 1.0}},
            "REPORT['before']['hidden'] must be a plain int or float",
        ),  # fmt: skip
        (  # the learner's misspelled key
            {"wrapper": "overlap"},
            {"before": {"step": 299.7, "hidden": 0.0}, "after": {"step_ms": 250.0, "hidden": 0.8}},
            "REPORT['before'] has no key 'step_ms' (it has 'step', 'hidden')",
        ),  # fmt: skip
        (
            {"wrapper": "overlap"},
            {"befor": {}, "after": {}},
            "REPORT has no key 'before' (it has 'befor', 'after')",
        ),  # fmt: skip
        (
            {"wrapper": "overlap"},
            {"before": {"step_ms": 0.0, "hidden": 0.0}, "after": {"step_ms": 1.0, "hidden": 1.0}},
            "REPORT['before']['step_ms'] must be a time > 0 (ms); got 0.0",
        ),  # fmt: skip
    ],
)
def test_malformed_answers_are_refused_without_measuring(tuned, report, words):
    assert words in _text(ok.grading.check_tuning(report, tuned))


# The judgement itself, on made-up re-measurements (no timing involved).

QUIET_BEFORE = [([56, 57, 58, 60, 57], [0.0] * 5)]  # (steps in ms, hidden shares) per call
QUIET_AFTER = [([32, 33, 34, 36, 33], [0.8, 0.85, 0.9, 0.85, 0.82])]  # 0.58× before
QUIET_TABLE = {
    "before": {"step_ms": 58.0, "hidden": 0.0},
    "after": {"step_ms": 33.5, "hidden": 0.84},
}


def fake_measurements(monkeypatch, before, after):
    """Run the check's re-measurement in this process with measure_step replaced: each
    call of a configuration returns the next of its made-up measurements, cyclically;
    every table counts as noted by measure() (what these tests judge is the
    re-measurement). Returns the sides measured, in order (warm-ups left out)."""
    calls, made_up = [], {0: itertools.cycle(before), 1: itertools.cycle(after)}

    def measure_step(wrapper, bucket_mb=25, batch=64, steps=5, per_step=False, **kwargs):
        if steps == 1:  # the launch's warm-up
            return {"step_ms": 0.0, "comm_ms": 0.0, "hidden": 0.0}
        setup = {"wrapper": wrapper, "bucket_mb": bucket_mb}
        side = 0 if setup == BASELINE and kwargs.get("compress") is None else 1
        calls.append(side)
        steps_ms, hidden = next(made_up[side])
        return {"step_ms": statistics.median(steps_ms), "hidden": statistics.median(hidden),
                "comm_ms": 0.0, "per_step": {"step_ms": steps_ms, "hidden": hidden}}  # fmt: skip

    monkeypatch.setattr(ok.ddp, "measure_step", measure_step)
    monkeypatch.setattr(lab10, "launch", lambda fn, *args, **kwargs: [fn(*args)] * 2)
    monkeypatch.setattr(lab10, "_unmeasured", lambda table, tuned: [])
    return calls


def judged_after(monkeypatch, steps, hidden, reported, tuned):
    """The check's text for a quiet baseline and made-up re-measurements of ``tuned``
    (``steps`` in ms, ``hidden`` shares), the table's after row ``reported`` (step, hidden)."""
    fake_measurements(monkeypatch, QUIET_BEFORE, [(steps, hidden)])
    table = {**QUIET_TABLE, "after": {"step_ms": reported[0], "hidden": reported[1]}}
    return _text(ok.grading.check_tuning(table, tuned))


def test_a_table_within_the_measured_spread_passes_after_one_batch(monkeypatch):
    calls = fake_measurements(monkeypatch, QUIET_BEFORE, QUIET_AFTER)
    result = ok.grading.check_tuning(QUIET_TABLE, TUNED)
    assert result.all_passed, _text(result)
    assert calls == [0, 1, 1, 0] * 2  # 4 rounds, before and after in turn (ABBA)


def test_one_number_outside_the_spread_takes_the_guessable_lines_with_it(monkeypatch):
    calls = fake_measurements(monkeypatch, QUIET_BEFORE, QUIET_AFTER)
    table = {**QUIET_TABLE, "after": {"step_ms": 12.0, "hidden": 0.84}}
    result = ok.grading.check_tuning(table, TUNED)
    assert result.score == 0 and result.total == 2, _text(result)
    assert _text(result).startswith(
        "after: step 12 ms reported, but one measurement of this configuration takes "
        "24.0–66.0 ms here (4 medians of 5 steps re-measured took 33.0–33.0 ms)"
    )
    assert len(calls) == 2 * lab10_measure.ROUNDS  # far from the line: no more measuring


def test_a_number_near_the_line_is_measured_again_before_the_verdict(monkeypatch):
    calls = fake_measurements(monkeypatch, QUIET_BEFORE, QUIET_AFTER)
    table = {**QUIET_TABLE, "after": {"step_ms": 20.0, "hidden": 0.84}}
    result = ok.grading.check_tuning(table, TUNED)
    assert result.score == 0, _text(result)
    assert len(calls) == 2 * lab10_measure.ROUNDS * (1 + lab10_measure.MORE)
    assert "(12 medians of 5 steps re-measured took 33.0–33.0 ms)" in _text(result)


def test_a_tuned_step_above_the_target_is_named(monkeypatch):
    fake_measurements(monkeypatch, QUIET_BEFORE, [([70, 72, 75, 71, 73], QUIET_AFTER[0][1])])
    table = {**QUIET_TABLE, "after": {"step_ms": 72.0, "hidden": 0.84}}
    text = _text(ok.grading.check_tuning(table, TUNED))
    assert (
        "after: the step takes 1.26× before's (median of 4 interleaved pairs, ± 0.00), above "
        "the target 0.75×"
    ) in text


def test_pairs_on_both_sides_of_the_target_are_measured_again_and_the_doubt_counts_for_them(
    monkeypatch,
):
    after = [([m] * 5, QUIET_AFTER[0][1]) for m in (35, 51, 38, 54)]  # 0.61–0.95× before
    calls = fake_measurements(monkeypatch, [([57] * 5, [0.0] * 5)], after)
    table = {**QUIET_TABLE, "after": {"step_ms": 40.0, "hidden": 0.84}}
    result = ok.grading.check_tuning(table, TUNED)
    assert len(calls) == 2 * lab10_measure.ROUNDS * (1 + lab10_measure.MORE)
    assert result.all_passed, _text(result)  # median 0.78, but not shown above 0.75
    assert (
        "the step takes 0.78× before's (median of 12 interleaved pairs, ± 0.13; target at "
        "most 0.75×) once the ± is counted"
    ) in _text(result)


def test_a_measured_configuration_that_hides_nothing_misses_the_target(monkeypatch):
    fake_measurements(monkeypatch, QUIET_BEFORE, [([60, 61, 62, 63, 61], [0.0] * 5)])
    table = {**QUIET_TABLE, "after": {"step_ms": 61.0, "hidden": 0.0}}
    result = ok.grading.check_tuning(table, {"wrapper": "naive"})
    assert result.passed == 4, _text(result)  # the table agrees; the goal is missed
    text = _text(result, marks=True)
    assert (
        "✘ after: only 0.00 of its communication hidden (median of 4 re-measurements, ± 0.00), "
        "below the target 0.25: the goal is missed, so this exercise earns nothing (the ✔ "
        "lines above only confirm that the table is what measure() returned). NaiveDDP "
        "communicates after backward: an overlapping wrapper starts it during backward\n"
    ) in text
    assert (
        "above the target 0.75×. NaiveDDP communicates after backward, so the step is backward "
        "plus the whole AllReduce, in 32 bits: twice the bytes of 16-bit gradients. An "
        "overlapping wrapper starts it during backward"
    ) in text


def test_a_configuration_that_tunes_nothing_scores_nothing_though_its_table_agrees(monkeypatch):
    """The lab's REPORT of measure(BASELINE) and measure({"wrapper": "naive"}): five ✔ lines
    that only confirm the table, and the goal missed: 0 points, not 5/6 of them."""
    fake_measurements(monkeypatch, QUIET_BEFORE, [([60, 61, 62, 63, 61], [0.0] * 5)])
    table = {**QUIET_TABLE, "after": {"step_ms": 61.0, "hidden": 0.0}}
    result = ok.grading.check_tuning(table, {"wrapper": "naive"})
    assert (result.passed, result.total) == (4, 6), _text(result)
    assert result.score == 0 and result.to_dict()["score"] == 0, _text(result)
    assert repr(result) == (
        "tuning: 4/6 checks passed; it scores 0: the goal (a step of at most 0.75× the "
        "baseline's, hiding at least 0.25 of its communication) was missed"
    )


def test_a_slow_step_scores_nothing_though_it_hides_enough(monkeypatch):
    fake_measurements(monkeypatch, QUIET_BEFORE, [([70, 72, 75, 71, 73], QUIET_AFTER[0][1])])
    table = {**QUIET_TABLE, "after": {"step_ms": 72.0, "hidden": 0.84}}
    result = ok.grading.check_tuning(table, TUNED)
    assert (result.passed, result.total, result.score) == (5, 6, 0), _text(result)
    assert (
        "above the target 0.75×: the goal is missed, so this exercise earns nothing (the ✔ "
        "lines above only confirm that the table is what measure() returned). It hides 0.85 of "
        "its communication, in 4 AllReduces. What remains is each AllReduce's own cost on the "
        "host, and the machine's load: compare two or three bucket sizes, each measured right "
        "after BASELINE"
    ) in _text(result)


def test_sixteen_bit_gradients_alone_are_told_why_nothing_hides(monkeypatch):
    tuned = {"wrapper": "bucketed", "bucket_mb": 25, "compress": "fp16"}
    text = judged_after(monkeypatch, [45, 46, 47, 45, 46], [0.0] * 5, (46.0, 0.0), tuned)
    assert (
        "after: only 0.00 of its communication hidden (median of 4 re-measurements, ± 0.00), "
        "below the target 0.25: the goal is missed"
    ) in text
    assert "after: the step takes 0.81× before's" in text and "above the target 0.75×" in text
    assert (
        "A bucket as large as the model fills only at the end of backward, so the step is "
        "backward plus the whole AllReduce. Smaller buckets start during it"
    ) in text
    assert "32 bits" not in text


def test_seconds_and_percentages_are_named_even_from_a_quieter_spell(monkeypatch):
    fake_measurements(monkeypatch, [([80, 82, 85, 90, 81], [0.0] * 5)], QUIET_AFTER)
    table = {
        "before": {"step_ms": 0.058, "hidden": 0.0},
        "after": {"step_ms": 50.5, "hidden": 84},
    }
    text = _text(ok.grading.check_tuning(table, TUNED))  # 58 ms: below 0.75 × 80 ms
    assert "before: step_ms is 0.058" in text and "that looks like seconds" in text
    assert "after: hidden is 84, a percentage: report the share (0–1)" in text


# The learner's review, on made-up re-measurements: each mistake named, every time.

#: what the learner's machine measured: a 300 ms baseline, a 2 MiB 16-bit step hiding ~0.8
BUSY_BEFORE = [([290, 300, 310, 320, 300], [0.0] * 5), ([280, 295, 299, 330, 305], [0.0] * 5)]
BUSY_AFTER = [([170, 175, 180, 178, 175], [0.7, 0.8, 0.85, 0.8, 0.75])]
TWO_MIB = TUNED
#: a table from another configuration: the sweep's last result (8 MiB)
EIGHT_MIB_AFTER = {"step_ms": 389.7, "hidden": 0.0}


def test_a_made_up_800_ms_baseline_with_forged_notes_is_refused(monkeypatch):
    fake_measurements(monkeypatch, BUSY_BEFORE, BUSY_AFTER)
    table = {
        "before": {"step_ms": 800.0, "hidden": 0.0},
        "after": {"step_ms": 250.0, "hidden": 0.8},
    }
    text = _text(ok.grading.check_tuning(table, TWO_MIB))
    assert "before: step 800 ms reported, but one measurement of this configuration takes " in text
    assert "210.0–600.0 ms here (12 medians of 5 steps re-measured took 299.0–300.0 ms)" in text
    assert NOT_MEASURED in text


def test_a_hidden_share_above_the_medians_is_refused_though_single_steps_hid_more(monkeypatch):
    # single steps hid 0.05-0.95, their medians 0.50: a share of 0.75 is no measurement's
    after = [([170, 175, 180, 178, 175], [0.05, 0.5, 0.95, 0.4, 0.6])]
    fake_measurements(monkeypatch, BUSY_BEFORE, after)
    table = {
        "before": {"step_ms": 300.0, "hidden": 0.0},
        "after": {"step_ms": 250.0, "hidden": 0.75},
    }
    text = _text(ok.grading.check_tuning(table, TWO_MIB))
    assert (
        "after: hidden 0.75 reported, but one measurement of this configuration hides "
        "0.00–0.60 here (4 medians re-measured hid 0.50–0.50)"
    ) in text


def test_an_honest_share_from_a_much_busier_launch_agrees(monkeypatch):
    # beside a CPU hog on a loaded machine, honest pairs hid 0.43 and 0.36 while the
    # check's medians were 0.74-0.90 and 0.67-0.85: a busier spell hides less
    after = [([170, 175, 180, 178, 175], [h] * 5) for h in (0.67, 0.85, 0.7, 0.8)]
    fake_measurements(monkeypatch, BUSY_BEFORE, after)
    table = {
        "before": {"step_ms": 300.0, "hidden": 0.0},
        "after": {"step_ms": 250.0, "hidden": 0.36},
    }
    result = ok.grading.check_tuning(table, TWO_MIB)
    assert result.all_passed, _text(result)


def test_an_honest_pair_that_met_a_busy_spell_passes_on_the_re_measurement(monkeypatch):
    # the learner's review: 3 honest runs of 7 had a pair 1.12-1.50x slower, while the
    # check's interleaved re-measurement gave 0.90-1.00x: the goal is judged on the latter
    after = [(BUSY_AFTER[0][0], [0.6] * 5)]  # hides 0.60: one busier launch hid 0.45
    fake_measurements(monkeypatch, BUSY_BEFORE, after)
    table = {
        "before": {"step_ms": 210.0, "hidden": 0.0},
        "after": {"step_ms": 250.0, "hidden": 0.45},
    }
    result = ok.grading.check_tuning(table, TWO_MIB)
    assert result.all_passed, _text(result)
    text = _text(result)
    assert (
        "after: the step takes 0.58× before's (median of 4 interleaved pairs, ± 0.00; target "
        "at most 0.75×); your own pair showed 1.19× (one launch on a busy machine varies that "
        "much: the goal is judged on the re-measurement)"
    ) in text


def test_the_target_message_starts_its_hint_with_a_capital(monkeypatch):
    after = [([240, 250, 260, 255, 250], [0.0] * 5)]
    fake_measurements(monkeypatch, BUSY_BEFORE, after)
    table = {
        "before": {"step_ms": 300.0, "hidden": 0.0},
        "after": {"step_ms": 250.0, "hidden": 0.0},
    }
    eight = {"wrapper": "bucketed", "bucket_mb": 8, "compress": "fp16"}
    text = _text(ok.grading.check_tuning(table, eight))
    assert "after: the step takes 0.83× before's" in text and "the goal is missed" in text
    assert "returned). A bucket as large as the model fills only at the end of backward" in text


def test_the_table_of_the_sweeps_last_configuration_earns_nothing_every_time(monkeypatch):
    # a sweep that fills REPORT from its loop's last result (8 MiB: one bucket for
    # the model, which hides nothing) while TUNED names 2 MiB
    table = table_of(measure(BASELINE), measure({"wrapper": "bucketed", "bucket_mb": 8}))
    no_launch(monkeypatch)
    for _ in range(20):
        result = ok.grading.check_tuning(table, TWO_MIB)
        text = _text(result)
        assert result.score == 0, text
        assert (
            "returned here, not measure(TUNED) ({'wrapper': 'bucketed', 'bucket_mb': 2, "
            "'compress': 'fp16'}): REPORT['after'] is from another configuration" in text
        )


def test_a_swapped_table_earns_nothing_and_is_named_every_time(measured, monkeypatch):
    swapped = {"before": measured["after"], "after": measured["before"]}
    no_launch(monkeypatch)
    for _ in range(20):
        result = ok.grading.check_tuning(swapped, TUNED)
        assert result.score == 0, _text(result)
        assert "before and after swapped?" in _text(result)


def test_a_step_far_above_the_medians_is_measured_again_until_the_check_meets_a_busy_spell(
    monkeypatch,
):
    # the learner measured in a busy spell (200 ms), the check's first rounds ran quiet
    before = [([60] * 5, [0.0] * 5)] * 4 + [([150] * 5, [0.0] * 5)]
    calls = fake_measurements(monkeypatch, before, QUIET_AFTER)
    table = {**QUIET_TABLE, "before": {"step_ms": 200.0, "hidden": 0.0}}
    result = ok.grading.check_tuning(table, TUNED)
    assert len(calls) > 2 * lab10_measure.ROUNDS, _text(result)  # 200 > 2 × 60: measured again
    assert result.all_passed, _text(result)  # 200 < 2 × 150


@pytest.mark.parametrize(("load", "busy"), [(9.0, True), (1.5, False)])
def test_a_slower_step_on_a_busy_machine_says_the_machine_was_busy(monkeypatch, load, busy):
    """Seen once under two test workers: an honest 1 MiB configuration re-measured 1.25×
    slower. The verdict stands; the message says the load may be why."""
    fake_measurements(monkeypatch, QUIET_BEFORE, [([70, 72, 75, 71, 73], QUIET_AFTER[0][1])])
    monkeypatch.setattr(lab10.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(lab10.os, "cpu_count", lambda: 2)
    table = {**QUIET_TABLE, "after": {"step_ms": 72.0, "hidden": 0.84}}
    text = _text(ok.grading.check_tuning(table, TUNED))
    assert "above the target 0.75×" in text
    assert ("This machine was busy meanwhile (load 9.0 on 2 cores)" in text) is busy, text


#: a missed goal, each with what its ✘ line must say: (tuned, re-measured steps and hidden
#: shares, the table's after row, the words)
MISSED = {
    "buckets smaller than a weight give one AllReduce per weight": (
        {"wrapper": "bucketed", "bucket_mb": 0.01, "compress": "fp16"},
        [70, 72, 75, 71, 73], QUIET_AFTER[0][1], (72.0, 0.84),
        "in 8 AllReduces (one per weight: a weight of 1 MiB is never split, so buckets of "
        "that size or less all give the same)",
    ),
    "overlap alone: what backward cannot cover, with 32-bit gradients": (
        ONE_MIB, [47, 48, 49, 50, 48], QUIET_AFTER[0][1], (48.0, 0.84),
        "returned). It hides 0.85 of its communication: what backward cannot cover still adds "
        "to the step, and with 32-bit gradients that is most of the AllReduce. Fewer bytes "
        "(compress) make it shorter",
    ),
    "an overlapped step that hides too little is told to send fewer bytes": (
        ONE_MIB, [50, 51, 52, 50, 51], [0.1] * 5, (51.0, 0.1),
        "after: only 0.10 of its communication hidden (median of 4 re-measurements, ± 0.00), "
        "below the target 0.25: the goal is missed, so this exercise earns nothing (the ✔ "
        "lines above only confirm that the table is what measure() returned). Backward is "
        "short beside an AllReduce of 32-bit gradients over this link: fewer bytes (compress) "
        "make the AllReduce shorter",
    ),
    "the learner's own pair that met the goal is quoted": (
        TUNED, [45, 46, 47, 45, 46], QUIET_AFTER[0][1], (35.0, 0.84),
        "after: the step takes 0.81× before's (median of 4 interleaved pairs, ± 0.00), above "
        "the target 0.75×; your own pair showed 0.60× (one launch on a busy machine varies "
        "that much: the goal is judged on the re-measurement): the goal is missed",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", MISSED)
def test_a_missed_goal_says_why(monkeypatch, case):
    tuned, steps, hidden, reported, words = MISSED[case]
    assert words in judged_after(monkeypatch, steps, hidden, reported, tuned)
