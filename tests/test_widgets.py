"""The bucket explorer redraws its prediction when a slider moves, and measures on request."""

import pytest

import overlapkit as ok

pytest.importorskip("ipywidgets")


class _Profile:
    forward, backward = 2e-3, 8e-3
    ready = [((i + 1) * 1e-3, 2**20) for i in range(8)]


def test_moving_the_bucket_slider_changes_the_predicted_step():
    box = ok.widgets.bucket_explorer(_Profile(), world=2, host=ok.costmodel.HostCost(per_op=2e-4))
    sliders, label = box.children[0].children, box.children[1]
    before = label.value
    sliders[0].value = 8  # bucket MiB: one bucket, launched after backward
    assert label.value != before and "predicted step" in label.value
    assert "best bucket of the sweep" in label.value


def test_the_measure_button_shows_the_measured_step_beside_the_prediction():
    calls = []

    def measure(bucket_mb, link):
        calls.append((bucket_mb, link))
        return 0.0421

    box = ok.widgets.bucket_explorer(_Profile(), measure=measure)
    button, result = box.children[3].children
    button.click()
    assert calls and "42.1 ms" in result.value and "predicted" in result.value


def test_a_failing_measurement_is_shown_not_lost():
    def measure(bucket_mb, link):
        raise RuntimeError("rank 1 died")

    box = ok.widgets.bucket_explorer(_Profile(), measure=measure)
    button, result = box.children[3].children
    button.click()
    assert "rank 1 died" in result.value
