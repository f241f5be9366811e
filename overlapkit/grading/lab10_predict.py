"""Check for lab 10's prediction: ``predict_step(profile, config)``, the step time (ms) that
a profile of the baseline predicts for a configuration, before anything is measured.

The profile holds one step's ``forward_ms``, ``backward_ms`` and ``allreduce_ms`` (all the
gradients in one 32-bit AllReduce). Its model: ``WEIGHTS`` equal weights whose gradients
become ready one by one through backward; a bucket's AllReduce starts when its last
gradient is ready *and* the link is free (one AllReduce at a time); each takes its share
of the bytes, half of them with 16-bit gradients; the step ends when backward and the last
AllReduce has (the last bucket is ready only when backward ends)::

    compute   | forward | backward ·········································· |
    ready       g7 g6 | g5 g4 | g3 g2 | g1 g0        (2 MiB buckets: 4 of 2 weights)
    link                  [b0 ····][b1 ····][b2 ····][b3 ····]
    step = forward + the end of the last bucket's AllReduce

NaiveDDP starts one AllReduce after backward; OverlapDDP has one bucket per weight; a
weight is never split, so a bucket smaller than one still holds one.
"""

from __future__ import annotations

import math

from ..costmodel import ddp_buckets
from ..sandbox.sealed import seal
from .cases import count_not_reached
from .common import Unfinished, call_or_report, plain_number
from .exercises import answers_of
from .report import Report

WEIGHTS, WEIGHT_MB = 8, 1  # the lab's model: 8 × Linear(512, 512), 1 MiB of fp32 each

#: (what, profile as (forward, backward, allreduce) ms, configuration)
CASES = [
    ("the baseline", (12.0, 22.0, 58.0), {"wrapper": "bucketed", "bucket_mb": 25}),
    ("2 MiB buckets", (12.0, 22.0, 58.0), {"wrapper": "bucketed", "bucket_mb": 2}),
    ("16-bit gradients in one bucket", (12.0, 22.0, 58.0),
     {"wrapper": "bucketed", "bucket_mb": None, "compress": "fp16"}),
    ("4 MiB buckets of 16-bit gradients", (16.0, 52.0, 103.0),
     {"wrapper": "bucketed", "bucket_mb": 4, "compress": "bf16"}),
    ("NaiveDDP", (12.0, 22.0, 58.0), {"wrapper": "naive"}),
    ("OverlapDDP, 16-bit", (4.0, 8.0, 58.0), {"wrapper": "overlap", "compress": "fp16"}),
    ("0.25 MiB buckets of 16-bit gradients", (12.0, 22.0, 58.0),
     {"wrapper": "bucketed", "bucket_mb": 0.25, "compress": "fp16"}),
    ("a short AllReduce: 2 MiB buckets", (10.0, 40.0, 16.0),
     {"wrapper": "bucketed", "bucket_mb": 2}),
]  # fmt: skip


def buckets(config: dict, split=False, naive_overlaps=False, first_ready=False):
    """Each AllReduce of a step of ``config`` as (when it may start, as a share of
    backward; its share of the bytes), in order: when its last gradient is ready. The
    keywords make a mistake's model: ``split`` cuts a weight into pieces of a bucket
    smaller than it, ``naive_overlaps`` gives NaiveDDP one bucket per weight,
    ``first_ready`` starts a bucket when its first gradient is ready."""
    wrapper = config.get("wrapper", "bucketed")
    if wrapper == "naive" and not naive_overlaps:
        return [(1.0, 1.0)]
    mb = 0 if wrapper in ("overlap", "naive") else config.get("bucket_mb", 25)
    if split and mb is not None and 0 < mb < WEIGHT_MB:
        n = round(WEIGHTS * WEIGHT_MB / mb)
        return [((j + 1) / n, 1 / n) for j in range(n)]
    groups = ddp_buckets([WEIGHT_MB * 2**20] * WEIGHTS, mb)
    at = min if first_ready else max
    return [((at(g) + 1) / WEIGHTS, len(g) / WEIGHTS) for g in groups]


def predicted(profile, config, *, halve=True, wait_ready=True, one_at_a_time=True,
              shares=True, with_forward=True, **wrong_buckets) -> float:  # fmt: skip
    """The model's step (ms); each keyword switched (here or in :func:`buckets`) is one
    mistake of the lab's."""
    forward, backward, allreduce = profile
    comm = allreduce / 2 if halve and config.get("compress") else allreduce
    naive = config.get("wrapper") == "naive" and not wrong_buckets.get("naive_overlaps")
    link, end = 0.0, 0.0
    for ready, share in buckets(config, **wrong_buckets):
        start = max(backward * ready if wait_ready or naive else 0.0,
                    link if one_at_a_time else 0.0)  # fmt: skip
        link = start + comm * (share if shares else 1.0)
        end = max(end, link)
    # the last bucket is ready only when backward ends: the step ends with its AllReduce
    return (forward if with_forward else 0.0) + end


#: each mistake: the model's keywords that make it, and what to tell the learner
MISTAKES = [
    ({"halve": False}, "16-bit gradients send half the bytes: the AllReduce takes half as long"),
    ({"wait_ready": False}, "a bucket's AllReduce cannot start before its last gradient is "
     "ready: the k-th of the 8 weights' gradients is ready after k/8 of backward"),
    ({"first_ready": True}, "a bucket is ready when its last gradient is, not its first"),
    ({"one_at_a_time": False}, "the link carries one AllReduce at a time: a bucket starts when "
     "it is ready and the bucket before it has finished"),
    ({"shares": False}, "each bucket's AllReduce carries only its share of the bytes: "
     "allreduce_ms × the bucket's share of the 8 weights"),
    ({"split": True}, "a weight is never split: a bucket smaller than a weight still holds "
     "one whole weight (1 MiB), so its AllReduce waits for that weight"),
    ({"naive_overlaps": True}, "NaiveDDP starts one AllReduce of every gradient after "
     "backward: nothing of it overlaps"),
    ({"with_forward": False}, "the step starts with forward: add forward_ms"),
    ({"halve": False, "one_at_a_time": False}, "two things: 16-bit gradients halve the "
     "AllReduce, and the link carries one AllReduce at a time"),
]  # fmt: skip


def _hint(got: float, profile, config) -> str:
    want = predicted(profile, config)
    if math.isclose(got * 1000, want, rel_tol=1e-3):
        return " That is the step in seconds: return milliseconds, as the profile gives them."
    wrong = [(predicted(profile, config, **switches), text) for switches, text in MISTAKES]
    rules = [text for value, text in wrong
             if not math.isclose(value, want, rel_tol=1e-6)
             and math.isclose(got, value, rel_tol=1e-3)]  # fmt: skip
    if len(rules) == 1:
        return f" That is the model without one of its rules: {rules[0]}."
    if rules:  # two mistakes that give the same number here: the next cases tell them apart
        return " That is the model without one of these rules: " + "; or ".join(rules) + "."
    if got < profile[0] + profile[1] - 1e-6:
        return " No step is shorter than forward plus backward."
    return ""


def check_predict_step(predict_step) -> Report:
    """Check ``predict_step(profile, config) -> float`` (lab 10): ``profile`` a dict of
    ``forward_ms``, ``backward_ms`` and ``allreduce_ms`` (one 32-bit AllReduce of every
    gradient), ``config`` as ``BASELINE``; the step in ms by the lab's model: the 8 weights'
    gradients ready one by one through backward; a bucket's AllReduce starting when its
    last gradient is ready and the link is free, taking ``allreduce_ms`` × its share of
    the bytes (half with 16-bit gradients); the step is forward until the last AllReduce
    ends. Eight fixed cases; a wrong value is told the model's and, where it is the model
    with one rule left out, which rule."""
    report = Report("predict_step")
    predict_step = seal(predict_step)  # called on a rank of its own, out of our reach
    forbid = answers_of("check_predict_step")
    for k, (what, profile, config) in enumerate(CASES):
        given = dict(zip(("forward_ms", "backward_ms", "allreduce_ms"), profile, strict=True))
        label = f"{what} {config}, profile {given}"
        try:  # a crash is its ✘ line, and the next case runs
            ran, got = call_or_report(report, label, predict_step, dict(given), dict(config),
                                      forbid=forbid)  # fmt: skip
        except Unfinished:  # its ✘ line said why; the cases after it count as failed
            count_not_reached(report, [later for later, *_ in CASES[k + 1 :]])
            return report
        if not ran:
            continue
        want = predicted(profile, config)
        if not plain_number(got) or not math.isfinite(got):
            report.fail(f"{label}: returned {type(got).__name__} {got!r}; return the step "
                        f"in ms as a number ({want:.1f} here)")  # fmt: skip
        elif math.isclose(got, want, rel_tol=1e-3, abs_tol=1e-3):
            report.ok(f"{what}: {got:.1f} ms")
        else:
            report.fail(f"{label}: got {got:.4g} ms; the model gives {want:.1f} ms."
                        + _hint(got, profile, config))  # fmt: skip
    return report
