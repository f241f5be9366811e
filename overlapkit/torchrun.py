"""``ok.launch`` under torchrun: this process *is* a rank, so the function runs here, in
place, and the ranks' values are gathered (the same script runs with ``python`` and with
``torchrun --nproc-per-node N``)."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import warnings

import torch.distributed as dist

from . import handles, p2p, runtime


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _destroy_group() -> None:
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            p2p.forget_private_groups()
            dist.destroy_process_group()


def launch_in_place(fn, args, kwargs, world_size, backend, link=None, hook=None):
    """Under torchrun this process *is* a rank: run here, all-gather the values."""
    world = int(os.environ["WORLD_SIZE"])
    if world != world_size:
        warnings.warn(
            f"launch(world_size={world_size}) runs under torchrun with WORLD_SIZE={world}: "
            f"using torchrun's {world} ranks",
            stacklevel=3,
        )
    if not dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", 0))
        chosen = runtime.torchrun_backend(backend, os.environ, runtime.usable_gpus())
        if "nccl" in chosen:
            import torch

            torch.cuda.set_device(local)
        dist.init_process_group(chosen)
        # torchrun's ranks are ordinary scripts: tear the group down before the
        # interpreter does, or a still-running gloo thread can abort the exit
        atexit.register(_destroy_group)
    p2p.set_link(link)
    for module in getattr(hook, "preload", ()):
        importlib.import_module(module)
    with contextlib.nullcontext() if hook is None else hook.around():
        value = fn(*args, **kwargs)
    handles.report_unwaited()
    if hook is not None:  # no channel here: this process is the rank
        hook.heard({}, set())
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
