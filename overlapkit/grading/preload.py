"""What the checks' ranks inherit from the forkserver (registered with
:func:`overlapkit.launcher.preload` when the checks are imported): every check, with the
sandbox modules they use, and then what the sandbox works out about the code loaded by
then (:mod:`overlapkit.sandbox.preload`): the kit's own code as loaded, and which of it
may call C (seccomp's and Landlock's set-up do) while a learner's function runs. Code
loaded after that is not the kit's as loaded, so the checks come first."""

from ..sandbox import preload  # noqa: F401
