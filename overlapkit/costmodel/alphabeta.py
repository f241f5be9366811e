"""The α-β model of one message: time = α (latency) + β · bytes (β = 1 / bandwidth).

A point-to-point message of S bytes::

    sender   |──α──|───────── S·β ─────────|
    receiver                               ^ arrives

Here the model of one message, the fit of α and β from measurements, and β read as a
bandwidth; the collectives' formulas (:mod:`.collectives`) build on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def message_time(nbytes: float, alpha: float, beta: float) -> float:
    """Seconds for one message of ``nbytes``: α + β·S."""
    return alpha + beta * nbytes


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Fit t = α + β·S to measurements, minimising *relative* error.

    Sizes span six orders of magnitude, and so do times. A plain least-squares
    fit minimises absolute error, which the largest messages dominate: a
    0.1 ms wobble at 64 MB swamps a 20 µs latency. Weighting each point by
    1/t fits every size equally well, so α comes from small messages and β
    from large ones, as it should.

    Returns (α in seconds, β in seconds per byte).
    """
    s = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if s.shape != t.shape or s.ndim != 1 or len(s) < 2:
        raise ValueError(
            f"need two equal-length 1-D sequences of >= 2 points, got {s.shape} and {t.shape}"
        )
    if np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise ValueError("times must be positive and finite (seconds)")
    design = np.stack([np.ones_like(s), s], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    return float(alpha), float(beta)


def bandwidth_gbps(beta: float) -> float:
    """β (s/byte) as a bandwidth in GB/s (10^9 bytes per second)."""
    return 1.0 / beta / 1e9 if beta > 0 else float("inf")
