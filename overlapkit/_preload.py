"""What the forkserver imports before it forks ranks: the rank's module, and torch's lazy
start-up done once (see :mod:`overlapkit.warmup`), so that every rank inherits both."""

from . import _rank, warmup  # noqa: F401

warmup.warm_torch()

# what a check's watch takes as the libraries' own code, worked out once here (by identity,
# as loaded) rather than in every rank of every check
from .grading import answers  # noqa: E402

answers.library()
answers._trusted()  # the same for the ids of the kit's and torch.distributed's code

# every rank is forked from this process: CUDA initialised here would be unusable in all of
# them ("Cannot re-initialize CUDA in forked subprocess"), so nothing above may touch it
warmup.assert_no_device_initialised()
