"""Torch's lazy start-up, done once and early.

A torch optimizer's first ``step()`` imports ``torch._dynamo`` (and with it sympy and
parts of inductor: some 900 modules, ~2.5 s of one core). Paid inside every rank of
every launch, that is seconds per launch on a 2-core laptop, and far more under a
profile function that sees every call. So the forkserver that forks the ranks does it
once (its preload, ``overlapkit._preload``, calls :func:`warm_torch`; the ranks inherit
it); a process that will run such a step under a profile function can call it first.

A caller whose ranks build no optimizer sets ``OVERLAPKIT_NO_WARMUP``: its forkserver
and ranks then skip the warm-up (2.5 s of a core saved per forkserver).
"""

from __future__ import annotations

import os

import torch

#: set (to anything) where the warm-up costs more than it saves
SKIP = "OVERLAPKIT_NO_WARMUP"

_done: list = []


def warm_torch() -> None:
    """Run an SGD step on a CPU tensor once in this process (idempotent).

    SGD, not Adam: Adam's step asks ``torch.accelerator`` for the current stream, which
    initialises CUDA (or MPS) where there is one, and a process that initialised CUDA
    cannot fork ranks that use it ("Cannot re-initialize CUDA in forked subprocess").
    SGD's first step imports the same modules; nothing here touches a device.
    """
    if _done or os.environ.get(SKIP):
        return
    _done.append(True)
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    optimizer = torch.optim.SGD([p], lr=0.1, foreach=False)
    optimizer.step()
    optimizer.zero_grad()


def assert_no_device_initialised() -> None:
    """Fail loudly where a process that forks ranks has initialised CUDA: every rank forked
    from it would fail at its first CUDA call, far from the cause."""
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA was initialised in the process that forks the ranks (overlapkit's "
            "forkserver preload); no rank could use a GPU. Something imported there touched "
            "a CUDA device."
        )
