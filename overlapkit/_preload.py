"""What the forkserver imports before it forks ranks: the rank's module, and torch's lazy
start-up done once (see :mod:`overlapkit.warmup`), so that every rank inherits both."""

from . import _rank, warmup  # noqa: F401

warmup.warm_torch()
