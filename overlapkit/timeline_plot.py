"""A :class:`~overlapkit.timeline.Timeline` drawn with matplotlib: one row per (rank, lane),
communication hidden under compute hatched, the overlap measures in the title
(:meth:`Timeline.plot <overlapkit.timeline.Timeline.plot>` draws with :func:`plot`)."""

from __future__ import annotations

from .spans import COMM, COMPUTE, intersect, is_comm, union

_LANE_COLORS = {COMPUTE: "#4C72B0", COMM: "#DD8452"}
_OTHER_COLORS = ["#55A868", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974"]


def plot(timeline, ax=None, title=None, labels=True, t0=None, legend=True, metrics=True):
    """What :meth:`Timeline.plot <overlapkit.timeline.Timeline.plot>` draws (its arguments,
    its documentation); returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    spans = timeline._all()
    rows = [(r, lane) for r in timeline.ranks for lane in timeline.lanes
            if timeline.select(r, lane)]  # fmt: skip
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.45 * max(len(rows), 2) + 1.3))
    else:
        fig = ax.figure
    if not spans:
        ax.set_title(title or "empty timeline")
        return fig
    t0 = min(s.start for s in spans) if t0 is None else t0
    span_ms = (max(s.end for s in spans) - t0) * 1e3 or 1.0
    # the width of one label character, in ms on this axis (8-point text)
    axis_px = ax.get_window_extent().width or 1.0
    char_ms = 0.6 * 8 * fig.dpi / 72 / axis_px * span_ms * 1.01
    colors = _colors(timeline.lanes)
    for y, (r, lane) in enumerate(rows):
        _draw_row(ax, timeline, (r, lane), y, t0, colors[lane], char_ms if labels else None)
    _dress(ax, timeline, rows, span_ms, title, metrics)
    if legend:
        _legend(ax, timeline, rows, colors)
    fig.tight_layout()
    return fig


def _colors(lanes) -> dict:
    """A color per lane: compute's and comm's own, the others' in turn."""
    colors = dict(_LANE_COLORS)
    for i, lane in enumerate(lane for lane in lanes if lane not in colors):
        colors[lane] = _OTHER_COLORS[i % len(_OTHER_COLORS)]
    return colors


def _draw_row(ax, timeline, row: tuple, y: int, t0: float, color, char_ms) -> None:
    """The bars of one (rank, lane) at height ``y``; a communication lane's parts hidden
    under the rank's compute hatched; named where a name fits (``char_ms``: the width of
    one character, None for no names)."""
    r, lane = row
    mine = timeline.select(r, lane)
    bars = [((s.start - t0) * 1e3, s.duration * 1e3) for s in mine]
    ax.broken_barh(bars, (y - 0.38, 0.76), facecolors=color, edgecolor="white", lw=0.5)
    if is_comm(lane):  # hatch the parts that were hidden under compute
        comm = union((s.start, s.end) for s in mine)
        comp = union((s.start, s.end) for s in timeline.select(r, COMPUTE))
        hidden = [((a - t0) * 1e3, (b - a) * 1e3) for a, b in intersect(comm, comp)]
        if hidden:
            ax.broken_barh(hidden, (y - 0.38, 0.76), facecolors="none", edgecolor="#333333",
                           hatch="////", lw=0)  # fmt: skip
    if char_ms is not None:
        _label_bars(ax, [s.name for s in mine], bars, y, char_ms)


def _dress(ax, timeline, rows: list, span_ms: float, title, metrics: bool) -> None:
    """The axes' ticks, limits and title: ``title`` and, with ``metrics``, the overlap
    measures."""
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} · {lane}" for r, lane in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", alpha=0.3)
    ratio, hidden = timeline.overlap_ratio(), timeline.hidden_fraction()
    summary = (
        f"overlap ratio {ratio:.2f} · comm hidden {hidden:.0%}"
        if ratio is not None
        else "no communication recorded"
    )
    if not metrics:  # e.g. a collective's own timeline, where overlap is not the point
        summary = ""
    ax.set_title(" — ".join(t for t in (title, summary) if t), fontsize=10)


def _legend(ax, timeline, rows: list, colors: dict) -> None:
    """A color per lane, and the hatch when a communication lane is drawn."""
    from matplotlib.patches import Patch

    handles = [Patch(color=colors[lane], label=lane) for lane in timeline.lanes]
    if any(is_comm(lane) for _, lane in rows):
        handles.append(Patch(facecolor="none", edgecolor="#333333", hatch="////",
                             label="comm hidden under compute"))  # fmt: skip
    ax.legend(  # below the axis label, at a distance in points whatever the height
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        borderaxespad=4.4,
        ncol=len(handles),
        frameon=False,
        fontsize=8,
    )


def _label_bars(ax, names, bars, y: float, char_ms: float) -> None:
    """Write each bar's name on it where the text fits inside the bar and clears the
    label before it (a lane's spans may overlap, as queued operations do)."""
    free_from = float("-inf")
    for name, (x, w) in sorted(zip(names, bars, strict=True), key=lambda item: item[1][0]):
        width = (len(name) + 1) * char_ms
        left = x + w / 2 - width / 2
        if w < width or left < free_from:
            continue
        ax.text(x + w / 2, y, name, ha="center", va="center", fontsize=8, color="white",
                clip_on=True)  # fmt: skip
        free_from = left + width
