"""What the checks' ranks inherit from the forkserver (registered with
:func:`overlapkit.launcher.preload` when the checks are imported): what a check's watch
takes as the libraries' own code, worked out once there (by identity, as loaded) rather
than in every rank of every check."""

from .. import warmup
from . import answers

answers.library()
answers._trusted()  # the same for the ids of the kit's own code (torch's is told by its place)

# every rank is forked from this process: nothing above may initialise CUDA
warmup.assert_no_device_initialised()
