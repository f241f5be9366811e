"""Where am I? Rank, world size, device and backend of the calling process.

Every helper works inside a rank started by :func:`overlapkit.launch` (or by
``torchrun``) and also outside one, where it describes a world of one process
on the CPU, so library code can call them unconditionally.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when a default process group is initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default group (0 outside a distributed run)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of ranks in the default group (1 outside a distributed run)."""
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    """Rank among the processes on this machine (LOCAL_RANK under torchrun)."""
    return int(os.environ.get("LOCAL_RANK", rank()))


def backend() -> str | None:
    """Name of the default group's backend ("gloo", "nccl", ...), None outside a run."""
    return str(dist.get_backend()) if is_distributed() else None


def device() -> torch.device:
    """The device this rank computes on: its own CUDA device under NCCL, else the CPU."""
    if backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_main() -> bool:
    """True on rank 0, the rank that prints summaries and writes files."""
    return rank() == 0


def usable_cores() -> int:
    """CPU cores this process may run on (respects taskset/cgroup affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cuda_devices_for(world: int) -> bool:
    """True when each of ``world`` ranks on this machine can have a CUDA device of its own."""
    return (
        dist.is_available()
        and dist.is_nccl_available()
        and torch.cuda.is_available()
        and torch.cuda.device_count() >= world
    )


def resolve_backend(name: str, world: int) -> str:
    """Turn ``"auto"`` into a concrete backend and reject impossible requests early.

    ``"auto"`` means NCCL when every rank can own a CUDA device, gloo otherwise.
    """
    if name == "auto":
        return "nccl" if cuda_devices_for(world) else "gloo"
    if name == "nccl" and not cuda_devices_for(world):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise RuntimeError(
            f"backend='nccl' needs one CUDA device per rank: world_size={world} "
            f"but this machine has {have} usable CUDA device(s). Use backend='gloo' "
            "(CPU) or backend='auto'."
        )
    if name not in ("gloo", "nccl", "mpi") and ":" not in name:
        raise ValueError(f"unknown backend {name!r}: expected 'auto', 'gloo' or 'nccl'")
    return name


def synchronize(on: torch.device | None = None) -> None:
    """Wait for the work queued on device ``on`` (default: this rank's) — what a host-side
    timer must do on a GPU before reading the clock; nothing on a CPU."""
    on = device() if on is None else on
    if on.type == "cuda":
        torch.cuda.synchronize(on)
