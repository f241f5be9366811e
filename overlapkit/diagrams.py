"""Data-movement pictures: what each rank holds before and after a collective.

One row per rank, one box per chunk, colour = the rank the data came from,
a "+" label where contributions were reduced together.
"""

from __future__ import annotations

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
_NAMES = "abcdefgh"


def holdings(collective: str, world: int) -> tuple[list[list[str]], list[list[str]]]:
    """Chunk labels per rank, before and after: 'a1' is chunk a of rank 1, 'a+' the Σ of chunk a."""
    chunks = _NAMES[:world]
    if collective == "all_reduce":
        before = [[f"{c}{r}" for c in chunks] for r in range(world)]
        after = [[f"{c}+" for c in chunks] for _ in range(world)]
    elif collective == "reduce_scatter":
        before = [[f"{c}{r}" for c in chunks] for r in range(world)]
        after = [[f"{chunks[r]}+"] for r in range(world)]
    elif collective == "all_gather":
        before = [[f"{chunks[r]}{r}"] for r in range(world)]
        after = [[f"{chunks[q]}{q}" for q in range(world)] for _ in range(world)]
    elif collective == "broadcast":
        before = [[f"{c}0" for c in chunks] if r == 0 else [] for r in range(world)]
        after = [[f"{c}0" for c in chunks] for _ in range(world)]
    else:
        raise ValueError(
            f"unknown collective {collective!r}: expected one of {', '.join(COLLECTIVES)}"
        )
    return before, after


def plot_collectives(collectives=COLLECTIVES, world: int = 4):
    """A before → after panel per collective; returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab10")
    fig, axes = plt.subplots(
        1, len(collectives), figsize=(3.6 * len(collectives), 0.55 * world + 1.2)
    )
    axes = [axes] if len(collectives) == 1 else list(axes)
    for ax, name in zip(axes, collectives, strict=True):
        before, after = holdings(name, world)
        for col, state in ((0, before), (world + 1.5, after)):
            for r, row in enumerate(state):
                for j, label in enumerate(row):
                    owner = label[1]
                    face = "#bbbbbb" if owner == "+" else colours(int(owner))
                    ax.add_patch(plt.Rectangle((col + j, -r - 0.9), 0.95, 0.8, color=face))
                    text = label.replace("+", "Σ")
                    ink = "black" if owner == "+" else "white"
                    ax.text(
                        col + j + 0.47,
                        -r - 0.5,
                        text,
                        ha="center",
                        va="center",
                        fontsize=8,
                        color=ink,
                    )
        for r in range(world):
            ax.text(-0.3, -r - 0.5, f"rank {r}", ha="right", va="center", fontsize=8)
        ax.annotate("", xy=(world + 1.3, -world / 2), xytext=(world + 0.2, -world / 2),
                    arrowprops={"arrowstyle": "->"})  # fmt: skip
        ax.set_xlim(-1.6, 2 * world + 1.6)
        ax.set_ylim(-world - 0.2, 0.4)
        ax.set_title(name.replace("_", " ").title().replace(" ", ""), fontsize=10)
        ax.axis("off")
    fig.tight_layout()
    return fig
