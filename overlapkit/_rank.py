"""The life of one rank started by :func:`overlapkit.launch` (runs in the child).

This module is preloaded by the forkserver, so importing torch is paid once per
kernel, not once per rank and launch. A rank:

1. dies with its parent (the forkserver, which dies with the kernel), so an
   abandoned rank never outlives the notebook;
2. sends its stdout and stderr (file descriptors 1 and 2, so C++ and CUDA
   messages too) to its own log file, which the caller prints grouped per rank;
3. arms ``faulthandler`` on SIGUSR1, so a caller whose ``timeout`` passed can
   ask a hung rank *where* it hangs before killing it;
4. joins the default process group through a FileStore (no TCP listener);
5. runs the function and sends back ``("ok", value)`` or ``("error", ...)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import importlib
import io
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from . import handles, p2p, plaindata

#: faulthandler marks each dump with this header; the caller looks for it.
DUMP_SIGNAL = signal.SIGUSR1


@dataclass
class RankSpec:
    """Everything a rank needs to start; picklable with the standard pickle."""

    payload: bytes  # cloudpickle of (fn, args, kwargs, hook)
    world_size: int
    backend: str
    store_path: str
    log_dir: str
    threads: int
    timeout_s: float
    env: dict = field(default_factory=dict)
    link: object = None  # an overlapkit.p2p.Link for the kit's messages, or None
    shm_dir: str | None = None  # where emulated messages' bytes go (overlapkit.shm)
    plain: bool = False  # the caller reads the value as plain data (overlapkit.plaindata)
    private: bytes | None = None  # cloudpickle of this rank's own keyword arguments
    preload: tuple = ()  # modules the rank must have imported (launcher.PRELOAD)


#: a store key per rank that has returned (its peers stop waiting for it to read)
RETURNED = "overlapkit/returned/"


def log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank{rank}.log")


def _die_with_parent() -> None:
    # The forkserver (our parent) lives while any process holds the write end of its
    # "alive" pipe: the caller, and every child it forks, which multiprocessing hands
    # that end so that a child could start processes through the same server. Were a
    # rank to keep it, a caller killed outright (kill -9, the OOM killer) would leave
    # the forkserver waiting for the ranks and the ranks running on: close ours.
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    # PR_SET_PDEATHSIG: the kernel sends SIGKILL when our parent dies. Linux only;
    # elsewhere the caller's cleanup is the only guard.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _capture_output(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # One line-buffered text stream per descriptor: print() lands in order with
    # what C++ writes to the same file.
    sys.stdout = io.TextIOWrapper(
        open(1, "wb", closefd=False), encoding="utf-8", errors="replace", line_buffering=True
    )
    sys.stderr = io.TextIOWrapper(
        open(2, "wb", closefd=False), encoding="utf-8", errors="replace", line_buffering=True
    )


def _flush_all() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:  # C stdio buffers (printf from extensions)
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


class _ResultPickler(cloudpickle.Pickler):
    """Pickles return values; CUDA tensors travel as CPU tensors.

    The caller (a notebook kernel) must not initialise CUDA just to receive a
    result, and the rank's device index may not even exist there.
    """

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            return obj.detach().cpu().__reduce_ex__(pickle.DEFAULT_PROTOCOL)
        return super().reducer_override(obj)


def dumps_result(value) -> bytes:
    buf = io.BytesIO()
    _ResultPickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(value)
    return buf.getvalue()


def _user_frames(exc: BaseException) -> list[tuple[str, int, str, str]]:
    """The traceback frames below this module, as plain tuples the caller can format."""
    frames = traceback.extract_tb(exc.__traceback__)
    here = os.path.abspath(__file__)
    kept = [f for f in frames if os.path.abspath(f.filename) != here]
    return [(f.filename, f.lineno or 0, f.name, f.line or "") for f in kept]


def error_message(exc: BaseException, pickled: bool = True) -> tuple:
    """("error", pickled exception or None, type name, str, frames, chained text)."""
    exc_bytes = None
    try:
        if pickled:  # a caller that reads plain data rebuilds it from its name instead
            exc_bytes = cloudpickle.dumps(exc)
            pickle.loads(exc_bytes)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        exc_bytes = None
    chained = ""
    if exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__):
        inner = exc.__cause__ or exc.__context__
        chained = "".join(traceback.format_exception(type(inner), inner, inner.__traceback__))
    return ("error", exc_bytes, type(exc).__qualname__, str(exc), _user_frames(exc), chained)


#: True in a process ok.launch forked for a rank (it ends with its function): not in a
#: torchrun worker that runs the function in place, nor in the caller
launched = False
#: this rank's spec (ok.launch's): where its store and scratch live
spec_of_this_rank: RankSpec | None = None
#: the write end of this rank's channel to the caller (:func:`overlapkit.rankhook.channel`)
channel = None
#: fn(limit_s) run once the rank's value has been sent (:func:`overlapkit.rankhook.at_end`);
#: one that returns True has made the rank's store unreachable: the rank ends at once
at_end: list = []

_keep: list = []  # objects whose destructors must never run


def main(spec: RankSpec, rank: int, conn, heard=None) -> None:
    """Entry point of a rank process (target of the forkserver Process)."""
    global launched, spec_of_this_rank, channel
    launched, spec_of_this_rank, channel = True, spec, heard
    _die_with_parent()
    _capture_output(log_path(spec.log_dir, rank))
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    # The forkserver was started with the caller's environment of that moment; the rank
    # takes the caller's environment of *this* launch, exactly (NCCL_DEBUG set later, a
    # CUDA_VISIBLE_DEVICES unset since: CUDA reads it at the rank's first CUDA call).
    os.environ.clear()
    os.environ.update(spec.env)  # with the interface gloo and NCCL listen on (the launcher's)
    os.environ.update(
        {
            "LOCAL_RANK": str(rank),
            "OVERLAPKIT_RANK": str(rank),
            "OVERLAPKIT_WORLD_SIZE": str(spec.world_size),
        }
    )
    torch.set_num_threads(spec.threads)
    store = None
    try:
        if "nccl" in spec.backend:  # rank r owns the r-th GPU CUDA_VISIBLE_DEVICES allows
            torch.cuda.set_device(rank)
        for module in spec.preload:  # inherited from the forkserver, or (where it was
            importlib.import_module(module)  # started before they were asked for) here
        fn, args, kwargs, hook = cloudpickle.loads(spec.payload)
        if spec.private is not None:
            kwargs = {**kwargs, **cloudpickle.loads(spec.private)}
        store = dist.FileStore(spec.store_path, spec.world_size)
        dist.init_process_group(
            spec.backend,
            store=store,
            rank=rank,
            world_size=spec.world_size,
            # the caller enforces the user's timeout; this only bounds stray waits
            timeout=timedelta(seconds=max(60.0, spec.timeout_s + 30.0)),
        )
        # every rank has finished connecting before any may return and tear its side
        # down (a rank still in gloo's connectFullMesh would fail: "closed by peer")
        dist.barrier()
        p2p.use_shared_memory(spec.shm_dir)
        p2p.set_link(spec.link)
        with contextlib.nullcontext() if hook is None else hook.around():
            value = fn(*args, **kwargs)
        handles.report_unwaited()  # an op started and never waited is named, not hidden
        message = ("ok", plaindata.dumps(value) if spec.plain else dumps_result(value))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
        message = error_message(exc, pickled=not spec.plain)
    data = pickle.dumps(message)  # bytes and strings only: cannot fail
    _flush_all()
    conn.send_bytes(data)
    conn.close()
    out_of_reach = False
    for fn in at_end:
        with contextlib.suppress(Exception):
            out_of_reach = bool(fn(spec.timeout_s)) or out_of_reach
    if out_of_reach:  # the store's files cannot be reached: destroying the group would have
        # the FileStore's destructor fail on them (an abort); the process ends with
        # os._exit, unwinding nothing
        _keep.append(store)
        _flush_all()
        return
    if store is not None:  # what this rank sent must outlive it: wait for its receivers
        with contextlib.suppress(Exception):
            store.set(f"{RETURNED}{rank}", "1")
            p2p.linger(lambda r: store.check([f"{RETURNED}{r}"]), spec.timeout_s)
    if dist.is_initialized():
        try:
            p2p.forget_private_groups()
            dist.destroy_process_group()
        except Exception:  # the group may be broken by a peer's failure
            pass
    _flush_all()
