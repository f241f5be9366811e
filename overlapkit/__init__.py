"""overlapkit: learn to hide communication behind computation, by building and measuring it.

Conventional import: ``import overlapkit as ok``.
"""

from . import costmodel, grading, pingpong
from .launcher import (
    LaunchError,
    LaunchTimeoutError,
    RankFailedError,
    RemoteTraceback,
    launch,
)
from .runtime import backend, device, is_main, local_rank, rank, world_size
from .timeline import Span, Timeline

__version__ = "0.1.0"

__all__ = [
    "costmodel",
    "grading",
    "pingpong",
    "launch",
    "Timeline",
    "Span",
    "LaunchError",
    "LaunchTimeoutError",
    "RankFailedError",
    "RemoteTraceback",
    "rank",
    "world_size",
    "local_rank",
    "device",
    "backend",
    "is_main",
]
