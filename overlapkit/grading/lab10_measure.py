"""Lab 10's re-measurement: before and after measured again in interleaved rounds on 2
ranks, and the bands in which one honest measurement of each may fall.

A reported number is one median of ``STEPS`` steps; the check re-measures ``ROUNDS``
rounds of both configurations, alternating which goes first (ABBA), and ``MORE`` batches
more while a verdict lies near its line. The bands are wide where the machine is busy and
narrow where it is quiet: they come from the re-measured medians and single steps
(:class:`Band`), never from the reported table.
"""

from __future__ import annotations

import gc
import math
import statistics
import time

STEPS = 5  # per measurement, as the lab's measure() takes them
ROUNDS = 4  # interleaved rounds per batch: 20 steps of each configuration
MORE = 2  # at most this many more batches (same launch) while a verdict lies near its line
STEP_FLOOR = 0.25  # below the fastest step re-measured: jitter, and a quieter spell then
BUSIER = 2.0  # × the slowest median re-measured: a learner's launch in a busier spell
NEAR_BUSIER = 4.0  # × it: measure more before calling a step this slow not measured
HIDDEN_FLOOR = 0.1  # a hidden share's tolerance above the medians' range (absolute)


def remeasure(configs, rounds, table, targets, budget, batch):
    """On each rank: warm up, then batches of ``rounds`` rounds of every configuration, the
    order reversed every other round (ABBA) so a drift of the machine hits both alike; one
    more batch while a verdict lies near its line (rank 0 decides), as ``budget`` allows."""
    from ..ddp import measure_step  # noqa: PLC0415

    start = time.monotonic()
    # the launch's first steps fill caches and start the kit's worker thread and gloo's
    # connections; without this the first configuration measured pays for them
    for cfg in configs:
        measure_step(**cfg, batch=batch, steps=1)
    gc.collect()
    gc.freeze()  # what lives now is never garbage: later collections skip it (~0.2 s each)
    try:
        return _rounds(
            lambda cfg: measure_step(**cfg, batch=batch, steps=STEPS, per_step=True),
            configs,
            rounds,
            table,
            targets,
            budget - (time.monotonic() - start),
        )
    finally:
        gc.unfreeze()


def _rounds(measure, configs, rounds, table, targets, budget) -> list:
    """remeasure's batches of rounds, after its warm-up; ``measure(config)``: one."""
    import torch.distributed as dist  # noqa: PLC0415

    start = time.monotonic()
    measured = Measured()
    for batch in range(1 + MORE):
        began = time.monotonic()
        for _ in range(rounds):
            order = [0, 1] if len(measured.rounds) % 2 == 0 else [1, 0]
            row = [None, None]
            for i in order:
                gc.collect()  # the last wrapper's hooks hold cycles: not collected mid-step
                m = measure(configs[i])
                row[i] = {"step_ms": m["step_ms"], "hidden": m["hidden"],
                          "steps_ms": m["per_step"]["step_ms"]}  # fmt: skip
            measured.rounds.append(row)
        now = time.monotonic()
        more = [batch < MORE and budget - (now - start) > 1.5 * (now - began)
                and measured.undecided(table, targets)]  # fmt: skip
        if dist.is_initialized():
            dist.broadcast_object_list(more, src=0)  # rank 0's hidden shares decide for all
        if not more[0]:
            break
    return measured.rounds


class Band:
    """Where one measurement (a median of 5 steps) of a quantity may fall here, from the
    medians re-measured (``lo``–``hi``, ``n`` of them): between ``low`` and ``high``; a
    value outside but within ``near_low``–``near_high`` is near the line (measure more)."""

    def __init__(self, medians: list[float], low: float, high: float, near: tuple):
        self.n, self.lo, self.hi = len(medians), min(medians), max(medians)
        self.low, self.high, (self.near_low, self.near_high) = low, high, near

    @classmethod
    def of_steps(cls, medians: list[float], steps: list[float]) -> Band:
        """A busy machine only slows a step: no median is much faster than the fastest
        single step re-measured (``STEP_FLOOR`` for that step's own jitter and a quieter
        spell: honest medians down to 0.77× it were seen, in a check that had not yet met
        a quiet spell), while a slow one may come from a busier spell: up to ``BUSIER`` ×
        the slowest median. Honest medians up to 2.7× the slowest of a check's first four
        were seen (a learner's launch in a busy spell, the check in a quiet one), so a
        value up to ``NEAR_BUSIER`` × is measured more, until the check meets such a
        spell too. Not the medians' spread: one honest median was 2.7× the slowest of
        four that agreed within 5%."""
        lo, hi, fastest = min(medians), max(medians), min(steps) * (1 - STEP_FLOOR)
        return cls(medians, fastest, BUSIER * hi, (fastest - STEP_FLOOR * lo, NEAR_BUSIER * hi))

    @classmethod
    def of_hidden(cls, medians: list[float]) -> Band:
        """From 0 up to ``HIDDEN_FLOOR`` above the medians' range: a busier spell hides less,
        down to nothing (one launch of 1 MiB buckets hid 0.05-0.98 on a loaded machine, and
        beside a CPU hog an honest 0.36 met medians of 0.67-0.85), while nothing makes an
        AllReduce hide more. The rows are measure()'s own results (notes): only a share
        above what this machine hides can be made up."""
        high = max(medians) + HIDDEN_FLOOR
        return cls(medians, 0.0, high, (0.0, high + HIDDEN_FLOOR))

    def holds(self, x: float) -> bool:
        return self.low <= x <= self.high

    def near(self, x: float) -> bool:
        return not self.holds(x) and self.near_low <= x <= self.near_high

    def window(self, digits: int) -> str:
        low, high = (max(0.0, self.low), min(1.0, self.high)) if digits == 2 else (
            self.low, self.high)  # fmt: skip
        return f"{low:.{digits}f}–{high:.{digits}f}"


class Measured:
    """The re-measurement so far: every round of before (0) and after (1)."""

    def __init__(self):
        self.rounds: list[list[dict]] = []

    def steps(self, side: int) -> Band:
        medians = [row[side]["step_ms"] for row in self.rounds]
        return Band.of_steps(medians, [s for row in self.rounds for s in row[side]["steps_ms"]])

    def hidden(self, side: int) -> Band:
        return Band.of_hidden([row[side]["hidden"] for row in self.rounds])

    def hidden_after(self) -> tuple[float, float]:
        """The tuned configuration's hidden share: median of the rounds, and its doubt."""
        return _median_and_doubt([row[1]["hidden"] for row in self.rounds])

    def ratio(self) -> tuple[float, float]:
        """after/before step time, each round's own pair: median, and its doubt."""
        return _median_and_doubt([row[1]["step_ms"] / row[0]["step_ms"] for row in self.rounds])

    def undecided(self, table: dict, targets: tuple) -> bool:
        """Whether a verdict lies near its line: a reported number near its band, or the
        step ratio or the hidden share within its doubt of the goal's (``targets``: the
        step ratio's, the hidden share's)."""
        target, target_hidden = targets
        bands = [(self.steps(i), self.hidden(i)) for i in (0, 1)]
        rows = (table["before"], table["after"])
        return (
            any(
                b.near(row["step_ms"]) or h.near(row["hidden"])
                for (b, h), row in zip(bands, rows, strict=True)
            )
            or _open(*self.ratio(), target)
            or _open(*self.hidden_after(), target_hidden)
        )


def _median_and_doubt(values: list[float]) -> tuple[float, float]:
    """The median of ``values`` and how far off it may be: 1.82 × the interquartile range
    / √n, its 95% interval were the values normal (robust to the busy spells that are not)."""
    median = statistics.median(values)
    if len(values) < 2:
        return median, math.inf
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return median, 1.82 * (q3 - q1) / math.sqrt(len(values))


def _open(median: float, doubt: float, line: float) -> bool:
    """Whether a verdict of ``median`` against ``line`` is still open (measure more)."""
    return abs(median - line) <= doubt
