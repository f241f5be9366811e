"""Lab 10's prediction check: the model's step passes; each typical mistake is named (16-bit
not halved, AllReduces started before their gradients are ready, AllReduces overlapping
on the link, weights split into small buckets, seconds); an unfinished function stops
the check."""

import pytest

import overlapkit as ok
from overlapkit.costmodel import ddp_buckets

WEIGHTS = 8


def model(profile, config, halve=True, wait=True, one_link=True, split=False, scale=1.0,
          naive_overlaps=False, forward=True, last_ready=True, shares=True):  # fmt: skip
    """A learner's predict_step; each keyword against its default is one mistake."""
    total = profile["allreduce_ms"]
    if config.get("compress") is not None and halve:
        total = total * 0.5
    per_weight_backward = profile["backward_ms"] / WEIGHTS
    kind = config.get("wrapper", "bucketed")
    if kind == "naive" and not naive_overlaps:
        sizes = [WEIGHTS]
    elif kind in ("overlap", "naive"):
        sizes = [1] * WEIGHTS
    elif split and config.get("bucket_mb") is not None and config["bucket_mb"] < 1:
        sizes = [config["bucket_mb"]] * round(WEIGHTS / config["bucket_mb"])
    else:
        sizes = [len(b) for b in ddp_buckets([2**20] * WEIGHTS, config.get("bucket_mb", 25))]
    filled, free_at, finish = 0.0, 0.0, 0.0
    for size in sizes:
        first = filled + min(1, size)
        filled += size
        ready_at = per_weight_backward * (filled if last_ready else first)
        if not (wait or kind == "naive"):
            ready_at = 0.0
        begin = ready_at if not one_link else max(ready_at, free_at)
        free_at = begin + total * (size / WEIGHTS if shares else 1)
        finish = max(finish, free_at)
    return scale * ((profile["forward_ms"] if forward else 0) + finish)


def _text(report):
    return "\n".join(("✔ " if passed else "✘ ") + line for passed, line in report.cases)


def test_the_model_passes_every_case():
    report = ok.grading.check_predict_step(model)
    assert report.all_passed, _text(report)
    assert report.total == 8


@pytest.mark.parametrize(
    ("mistake", "words"),
    [
        (
            {"halve": False},
            "16-bit gradients send half the bytes: the AllReduce takes half as long",
        ),
        ({"wait": False}, "a bucket's AllReduce cannot start before its last gradient is ready"),
        ({"one_link": False}, "the link carries one AllReduce at a time"),
        ({"split": True}, "a weight is never split: a bucket smaller than a weight still holds"),
        ({"scale": 1e-3}, "That is the step in seconds: return milliseconds"),
        ({"naive_overlaps": True}, "NaiveDDP starts one AllReduce of every gradient after"),
        ({"forward": False}, "the step starts with forward: add forward_ms"),
        ({"last_ready": False}, "a bucket is ready when its last gradient is, not its first"),
        ({"shares": False}, "each bucket's AllReduce carries only its share of the bytes"),
    ],
)
def test_each_mistake_is_named(mistake, words):
    report = ok.grading.check_predict_step(lambda p, c: model(p, c, **mistake))
    text = _text(report)
    assert not report.all_passed and words in text, text


def test_a_wrong_number_of_another_kind_is_given_the_models_value():
    report = ok.grading.check_predict_step(lambda p, c: 1.0)
    text = _text(report)
    assert "the baseline {'wrapper': 'bucketed', 'bucket_mb': 25}, profile" in text
    assert "got 1 ms; the model gives 92.0 ms. No step is shorter than forward plus backward." in (
        text
    )


def test_an_unfinished_function_stops_at_the_first_case():
    def unfinished(profile, config):
        raise NotImplementedError

    report = ok.grading.check_predict_step(unfinished)
    assert report.passed == 0 and report.total == 8
    assert "not implemented yet" in report.cases[0][1]
    assert "not reached" in report.cases[-1][1]


def test_a_non_number_is_refused_with_the_expected_value():
    report = ok.grading.check_predict_step(lambda p, c: "92 ms")
    assert "returned str '92 ms'; return the step in ms as a number (92.0 here)" in _text(report)


def test_calling_the_kits_step_model_is_refused():
    def kit(profile, config):
        return ok.costmodel.ddp_step([(0.0, 1.0)], [1.0], [2**20], 1.0, 1.0, 2, 0.0, 1e-9)

    report = ok.grading.check_predict_step(kit)
    assert not report.all_passed
    assert "your function" in report.cases[0][1], _text(report)
