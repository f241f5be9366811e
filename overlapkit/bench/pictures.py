"""The pictures a benchmark writes with ``--png``: timelines of its median steps."""

from __future__ import annotations

from ..timeline import Timeline


def median_steps(times: dict, pictured: dict, configs, path: str) -> None:
    """For each of ``configs``, the median timed step (``times[c]``: seconds per step;
    ``pictured[c][i]``: every rank's timeline of step i), all ranks, one above the other
    on one time axis, written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # a file, whatever backend the caller's session has
    import matplotlib.pyplot as plt

    rows = [len(Timeline.merge(pictured[c][0]).ranks) for c in configs]
    heights = [0.42 * r * 2.4 + 1.6 for r in rows]
    fig, axes = plt.subplots(len(configs), 1, figsize=(11, sum(heights)),
                             gridspec_kw={"height_ratios": heights})  # fmt: skip
    for ax, c in zip(axes, configs, strict=True):
        order = sorted(range(len(times[c])), key=times[c].__getitem__)
        median = order[len(order) // 2]
        Timeline.merge(pictured[c][median]).plot(
            ax=ax, title=f"{c}: step {times[c][median] * 1e3:.0f} ms", labels=False
        )
    right = max(ax.get_xlim()[1] for ax in axes)
    for ax in axes:
        ax.set_xlim(0, right)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
