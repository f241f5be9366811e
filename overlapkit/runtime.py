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


#: the default group ``ok.launch`` makes where every rank has a GPU of its own: NCCL moves
#: CUDA tensors, gloo CPU tensors (a lab's CPU tensors and a GPU model's both work)
MIXED = "cpu:gloo,cuda:nccl"


def parse_backends(config: str) -> dict[str, str]:
    """``{"cpu": "gloo", "cuda": "nccl"}`` from a backend string as ``init_process_group``
    takes it (``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``)."""
    if ":" not in config:  # one backend: gloo moves both kinds, NCCL CUDA tensors only
        return {"cuda": "nccl"} if config == "nccl" else {"cpu": config, "cuda": config}
    return dict(part.split(":", 1) for part in config.split(","))


def backends(group=None) -> dict[str, str]:
    """Which backend moves the tensors of each device type in ``group`` (default: the
    default group); ``{}`` outside a run."""
    if not is_distributed():
        return {}
    return parse_backends(str(dist.get_backend_config(group)))


def device() -> torch.device:
    """The device this rank computes on: its own CUDA device where the default group moves
    CUDA tensors with NCCL (each rank has a GPU), else the CPU."""
    if backends().get("cuda") == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str | None:
    """The backend that moves this rank's tensors (those on :func:`device`): "nccl" for a
    rank with a GPU of its own, "gloo" on the CPU; None outside a run. CPU tensors always
    go through gloo (:func:`backends` tells each device type's)."""
    return backends().get(device().type) if is_distributed() else None


def is_main() -> bool:
    """True on rank 0, the rank that prints summaries and writes files."""
    return rank() == 0


def usable_cores() -> int:
    """CPU cores this process may run on (respects taskset/cgroup affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def usable_gpus() -> int:
    """CUDA devices this process may use: those ``CUDA_VISIBLE_DEVICES`` lets it see (0
    without CUDA or NCCL)."""
    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    return torch.cuda.device_count()


def cuda_devices_for(world: int) -> bool:
    """True when each of ``world`` ranks on this machine can have a CUDA device of its own."""
    return usable_gpus() >= world


def choose_backend(name: str, ranks: int, gpus: int) -> str:
    """The default group's backend for ``ranks`` ranks on a machine with ``gpus`` usable
    GPUs (the ranks of one machine: ``ok.launch``'s, or torchrun's LOCAL_WORLD_SIZE).

    ``"auto"``: :data:`MIXED` (NCCL for CUDA tensors, gloo for CPU ones) when every rank
    can own a GPU, else gloo — on a one-GPU box, the ranks compute on the CPU and the GPU
    serves the single-process parts. ``"nccl"`` is the same mixed group, and an error
    where the GPUs are too few (never a silent fallback). ``"gloo"``: gloo alone.
    """
    if name not in ("auto", "gloo", "nccl", "mpi") and ":" not in name:
        raise ValueError(f"unknown backend {name!r}: expected 'auto', 'gloo' or 'nccl'")
    if name == "auto":
        return MIXED if gpus >= ranks else "gloo"
    if name == "nccl":
        if gpus < ranks:
            raise RuntimeError(
                f"backend='nccl' needs one CUDA device per rank: {ranks} ranks on this "
                f"machine but {gpus} usable CUDA device(s) (CUDA_VISIBLE_DEVICES limits "
                "them). Use backend='gloo' (CPU) or backend='auto'."
            )
        return MIXED
    return name


def resolve_backend(name: str, world: int) -> str:
    """:func:`choose_backend` for ``world`` ranks on this machine."""
    return choose_backend(name, world, usable_gpus() if name != "gloo" else 0)


def torchrun_backend(name: str, environ, gpus: int) -> str:
    """:func:`choose_backend` for a torchrun worker: from the count of workers on its
    machine (LOCAL_WORLD_SIZE), not its own index, so that every worker of a machine makes
    the same choice (workers past the GPUs choosing gloo beside NCCL ones cannot form a
    group)."""
    ranks_here = int(environ.get("LOCAL_WORLD_SIZE", environ.get("WORLD_SIZE", 1)))
    return choose_backend(name, ranks_here, gpus)


def synchronize(on: torch.device | None = None) -> None:
    """Wait for the work queued on device ``on`` (default: this rank's) — what a host-side
    timer must do on a GPU before reading the clock; nothing on a CPU."""
    on = device() if on is None else on
    if on.type == "cuda":
        torch.cuda.synchronize(on)
