"""Explorers for JupyterLab: sliders that redraw a model's prediction at once.

``bucket_explorer(profile)`` draws the predicted data-parallel step — backward,
and each bucket's AllReduce on the link — for a bucket size, a link bandwidth
and a latency chosen with sliders; a button measures the chosen point on real
ranks (through a function the notebook gives), so prediction and measurement
sit side by side.
"""

from __future__ import annotations

from . import costmodel


def draw_step(ax, prediction: dict, title: str = "") -> None:
    """One predicted step: a backward bar and the buckets' AllReduces on the link."""
    backward = prediction["backward"]
    ax.clear()
    ax.barh(1, backward * 1e3, left=0, height=0.5, color="#4C72B0", label="backward")
    for k, (start, end, _) in enumerate(prediction["spans"]):
        ax.barh(0, (end - start) * 1e3, left=start * 1e3, height=0.5,
                color="#DD8452" if k % 2 else "#C44E52", edgecolor="white")  # fmt: skip
    end = max(backward, prediction["spans"][-1][1]) if prediction["spans"] else backward
    ax.axvline(backward * 1e3, color="gray", lw=0.8, ls="--")
    ax.set_yticks([0, 1], ["comm", "compute"])
    ax.set_xlim(0, end * 1e3 * 1.05)
    ax.set_xlabel("ms after backward starts")
    ax.set_title(title, fontsize=9)


def bucket_explorer(profile, world: int = 2, host=None, measure=None, bucket_mb: float = 1.0,
                    bandwidth_gbps: float = 0.25, latency_us: float = 100.0):  # fmt: skip
    """An ipywidgets explorer of ``ok.costmodel.ddp_step`` for a measured
    ``ok.profile_backward`` result and host cost (``ok.costmodel.HostCost``, e.g. from
    ``ok.measure_host_cost``). ``measure(bucket_mb, link) -> seconds`` (optional) runs
    the chosen point for real when the button is pressed."""
    import ipywidgets as w  # noqa: PLC0415 - only needed in a notebook
    from IPython.display import display  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415 - not pyplot: no stray display

    from .p2p import Link  # noqa: PLC0415

    bucket = w.FloatLogSlider(value=bucket_mb, base=10, min=-1.3, max=2, step=0.05,
                              description="bucket MiB", continuous_update=True)  # fmt: skip
    bandwidth = w.FloatLogSlider(value=bandwidth_gbps, base=10, min=-1.3, max=1, step=0.05,
                                 description="GB/s")  # fmt: skip
    latency = w.FloatLogSlider(value=latency_us, base=10, min=0, max=3, step=0.05,
                               description="latency µs")  # fmt: skip
    label = w.HTML()
    measured = w.HTML()
    button = w.Button(description="measure this point", disabled=measure is None)
    out = w.Output()
    fig = Figure(figsize=(8, 2.4), layout="tight")
    ax = fig.subplots()

    def predict():
        alpha, beta = latency.value * 1e-6, 1 / (bandwidth.value * 1e9)
        args = (profile.ready, profile.forward, profile.backward, world, alpha, beta)
        bucketed = costmodel.ddp_step(*args, "bucketed", bucket.value, host=host)
        naive = costmodel.ddp_step(*args, "naive", None, host=host)
        best = costmodel.best_bucket_mb(*args, host=host)
        return bucketed, naive, best

    def redraw(_=None):
        bucketed, naive, best = predict()
        draw_step(ax, bucketed, f"{bucketed['buckets']} bucket(s) of ≤ {bucket.value:.3g} MiB")
        out.clear_output(wait=True)
        with out:
            display(fig)
        label.value = (
            f"predicted step <b>{bucketed['step'] * 1e3:.1f} ms</b> "
            f"(naive {naive['step'] * 1e3:.1f} ms), exposed communication "
            f"{bucketed['exposed'] * 1e3:.1f} ms, hidden {bucketed['hidden_fraction']:.2f}; "
            f"best bucket of the sweep: {best:g} MiB"
        )

    def run(_):
        button.disabled = True
        measured.value = "measuring…"
        try:
            link = Link(latency.value, bandwidth.value)
            seconds = measure(bucket.value, link)
            predicted = predict()[0]["step"]
            measured.value = (
                f"measured at {bucket.value:.3g} MiB over {link}: <b>{seconds * 1e3:.1f} ms</b> "
                f"(predicted {predicted * 1e3:.1f} ms)"
            )
        except Exception as exc:  # noqa: BLE001 - shown in the widget, not lost
            measured.value = f"measurement failed: {type(exc).__name__}: {exc}"
        finally:
            button.disabled = False

    for s in (bucket, bandwidth, latency):
        s.observe(redraw, names="value")
    button.on_click(run)
    redraw()
    return w.VBox([w.HBox([bucket, bandwidth, latency]), label, out, w.HBox([button, measured])])
