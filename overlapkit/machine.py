"""What this machine offers the ranks: the platform choices of the kit, made in one place.

Each function takes the facts it decides from as arguments (the platform, the
environment, the network interfaces, the file system's sizes), and reads the real
machine by default, so that every platform's choice can be tested on any one of them.
This module imports nothing POSIX-only: it must load on native Windows to refuse it.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings

#: the variables that choose the interface gloo and NCCL listen and connect on
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
LOOPBACK_ADDRESS = "127.0.0.1"
DEV_SHM = "/dev/shm"
#: a /dev/shm smaller than this is reported before NCCL runs in it. NCCL keeps the buffers
#: of every pair of GPUs that talk through shared memory there, several MiB per channel
#: and pair, so a node with a few GPUs can need a few hundred MiB; Docker's default
#: (64 MiB) is far below. A conservative bound, not NCCL's exact need.
NCCL_SHM_MIN_BYTES = 512 << 20
#: a /dev/shm smaller than this is not used for the emulated link (a temporary folder
#: is): the link reserves 1 MiB steps per busy direction, so a handful of ranks in less
#: would be refused room all the time. Docker's 64 MiB is enough for it (it gives idle
#: pages back).
LINK_SHM_MIN_BYTES = 16 << 20


class SmallSharedMemoryWarning(UserWarning):
    """/dev/shm is too small for NCCL's intra-node buffers (see :func:`shm_report`)."""


def refuse_native_windows(system: str = sys.platform) -> None:
    """Raise ImportError on native Windows, saying to use WSL2. The kit starts ranks with a
    forkserver (fork), takes POSIX file locks (fcntl) and keeps the emulated link's bytes
    in /dev/shm-style shared memory: none of these exist there, and failing later, at
    ``import fcntl``, would not say what to do instead."""
    if system == "win32":
        raise ImportError(
            "overlapkit does not run on native Windows: it needs fork-based process start "
            "(a forkserver), POSIX file locks (fcntl) and /dev/shm-style shared memory. "
            "Use WSL2 (Windows Subsystem for Linux): run `wsl --install` in an "
            "administrator PowerShell, restart, then run the README's commands inside "
            "the Ubuntu it installs."
        )


def _usual_loopback(system: str) -> str:
    """Linux names its loopback interface "lo"; macOS and the BSDs name it "lo0"."""
    return "lo0" if system == "darwin" or "bsd" in system else "lo"


def loopback_interface(addresses: dict | None = None, system: str = sys.platform) -> str:
    """The name of the interface that carries 127.0.0.1: found in ``addresses`` (name ->
    psutil-style addresses with ``.family`` and ``.address``; default psutil's
    ``net_if_addrs()``), not assumed, since the name differs by platform ("lo" on Linux,
    "lo0" on macOS) and a renamed one would make gloo fail to start; the platform's usual
    name when no interface carries it (or the interfaces cannot be read)."""
    if addresses is None:
        try:
            import psutil

            addresses = psutil.net_if_addrs()
        except Exception:  # noqa: BLE001 - no facts: the platform's usual name
            addresses = {}
    for name, addrs in addresses.items():
        for a in addrs:
            if getattr(a, "family", None) == socket.AF_INET and a.address == LOOPBACK_ADDRESS:
                return name
    return _usual_loopback(system)


def socket_env(environ, interfaces: dict | None = None, system: str = sys.platform) -> dict:
    """The GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME values a rank should set: the loopback
    interface (so nothing listens on a public address) for each one that ``environ`` (the
    user's environment) leaves unset or empty; a user's own setting is kept, since they set
    it for a reason (a machine whose loopback is not usable, say)."""
    unset = [name for name in SOCKET_IFNAME_VARIABLES if not environ.get(name)]
    if not unset:
        return {}
    loopback = loopback_interface(interfaces, system)
    return {name: loopback for name in unset}


def _large_enough(path: str, least: int, statvfs) -> bool:
    try:
        st = statvfs(path)
    except OSError:
        return False
    return st.f_frsize * st.f_blocks >= least


def shm_root(
    environ=os.environ,
    system: str = sys.platform,
    dev_shm: str = DEV_SHM,
    statvfs=os.statvfs,
) -> str | None:
    """Where the emulated link's bytes go: $OVERLAPKIT_SHM_DIR when set (and a writable
    folder); on Linux, /dev/shm when it is a writable folder of at least
    :data:`LINK_SHM_MIN_BYTES` (RAM: memcpy speed); else None, a temporary folder. macOS
    has no /dev/shm (its POSIX shared memory has no folder), so it gets None."""

    def usable(path: str) -> bool:
        return os.path.isdir(path) and os.access(path, os.W_OK)

    chosen = environ.get("OVERLAPKIT_SHM_DIR")
    if chosen:
        return chosen if usable(chosen) else None
    if system.startswith("linux") and usable(dev_shm):
        return dev_shm if _large_enough(dev_shm, LINK_SHM_MIN_BYTES, statvfs) else None
    return None


def shm_report(path: str = DEV_SHM, statvfs=os.statvfs) -> str | None:
    """None when ``path`` (/dev/shm) is large enough for NCCL (:data:`NCCL_SHM_MIN_BYTES`)
    or cannot be measured (no report rather than a guess); else a paragraph that says what
    was found and how to fix it, since NCCL's own failure in a small /dev/shm (a bus error,
    or "unhandled system error") does not name the cause."""
    try:
        st = statvfs(path)
    except OSError:
        return None
    size = st.f_frsize * st.f_blocks
    if size >= NCCL_SHM_MIN_BYTES:
        return None
    free = st.f_frsize * st.f_bavail
    return (
        f"{path} holds only {size / 2**20:.0f} MiB ({free / 2**20:.0f} MiB free). NCCL keeps "
        f"its intra-node buffers in {path}, and fails in a container with Docker's default "
        "of 64 MiB (a bus error, or 'unhandled system error'). Fix: start the container with "
        "`docker run --ipc=host` or `docker run --shm-size=1g`; or set NCCL_SHM_DISABLE=1 "
        f"(NCCL then goes through other transports: slower). At least "
        f"{NCCL_SHM_MIN_BYTES >> 20} MiB is a conservative size."
    )


_warned_small_shm = False


def warn_small_shm(backend: str, path: str = DEV_SHM, statvfs=os.statvfs) -> None:
    """Warn once per process (:class:`SmallSharedMemoryWarning`) when ``backend`` uses NCCL
    and :func:`shm_report` finds ``path`` too small: before NCCL fails in it, and not on
    every launch of a notebook. ``stacklevel`` points at the caller of ``ok.launch``."""
    global _warned_small_shm
    if _warned_small_shm or "nccl" not in str(backend).lower():
        return
    report = shm_report(path, statvfs)
    if report is not None:
        _warned_small_shm = True
        warnings.warn(report, SmallSharedMemoryWarning, stacklevel=3)


def visible_devices(environ=os.environ) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of its entries (indices or GPU-UUIDs): None when it is
    unset (every device is visible), [] when it is set but empty (no device is: CUDA
    treats an empty value as "hide them all", unlike an unset one)."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [entry.strip() for entry in value.split(",") if entry.strip()]
