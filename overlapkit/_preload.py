"""What the forkserver imports before it forks ranks: the rank's module, and torch's lazy
start-up done once (see :mod:`overlapkit.warmup`), so that every rank inherits both.
Others add theirs with :func:`overlapkit.launcher.preload`."""

from . import _rank, warmup  # noqa: F401

warmup.warm_torch()

# every rank is forked from this process: CUDA initialised here would be unusable in all of
# them ("Cannot re-initialize CUDA in forked subprocess"), so nothing above may touch it
warmup.assert_no_device_initialised()
