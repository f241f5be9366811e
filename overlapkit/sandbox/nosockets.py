"""A check's rank opens no new connection while the learner's code runs.

A learner's code runs on the check's ranks in the same process as the check's records,
so what the check can trust is what the operating system enforces. A process group of
the learner's own — built straight from the default store, outside torch's registry,
its operations called from C (``functools.partial`` shows the profiler no event) — moves
data between ranks that no record of the kit's sees. Every such group (gloo's, or any
other way to talk: TCP or unix sockets) needs a new socket. So before the learner's code
runs, a rank makes the kit's own group for the default group (the one its collectives
use), then installs a seccomp filter on every thread of the process: ``socket()`` and
``socketpair()`` fail with EPERM from then on, and so do System V IPC (``shmget``,
``shmat``, ``msgget``, ``semget``) and POSIX message queues (``mq_open``). A filter
cannot be removed, and the rank process ends after the check.

Linux on x86-64 or arm64, gloo only (NCCL connects lazily, at its first collective), in
a rank ``ok.launch`` forked (a torchrun worker lives on after the check); elsewhere
:func:`forbid_new_sockets` returns False and the check runs as before. What it does not
close: files in folders the ranks share (see ``overlapkit.grade``'s threat model).
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

#: (audit arch, socket, socketpair, seccomp) syscall numbers per machine
_ARCHES = {
    "x86_64": (0xC000003E, 41, 53, 317),
    "aarch64": (0xC00000B7, 198, 199, 277),
}
#: (execve, execveat) per machine: a single-process exercise starts no program
_EXEC = {"x86_64": (59, 322), "aarch64": (221, 281)}
#: (shmget, shmat, msgget, semget, mq_open) per machine: System V shared memory, message
#: queues and semaphores, and POSIX message queues, open no socket and no file path, so
#: they are a channel between ranks (lab 13: whole gradients through shmget)
_IPC = {"x86_64": (29, 30, 68, 64, 240), "aarch64": (194, 196, 186, 190, 180)}
_EPERM = 1
_X32 = 0x40000000  # x86-64's x32 numbers: the same calls by another number


def _program(arch: int, *refused: int) -> bytes:
    """The BPF filter: on this architecture, the ``refused`` calls (socket(), socketpair(),
    …) and every x32 call fail with EPERM, everything else is allowed; a foreign
    architecture's call (i386's int 0x80) ends the process. Jump offsets count from the
    next instruction."""
    ld_w_abs, jeq_k, jge_k, ret_k = 0x20, 0x15, 0x35, 0x06
    allow, refuse, kill = 0x7FFF0000, 0x00050000 | _EPERM, 0x80000000
    n = len(refused)
    ops = [
        (ld_w_abs, 0, 0, 4),  # the architecture
        (jeq_k, 1, 0, arch),  # ours: on past the next
        (ret_k, 0, 0, kill),  # another
        (ld_w_abs, 0, 0, 0),  # the syscall's number
        (jge_k, n + 1, 0, _X32),  # an x32 call: to "refuse"
    ]
    for i, number in enumerate(refused):  # each: to "refuse", n − i instructions on
        ops.append((jeq_k, n - i, 0, number))
    ops += [(ret_k, 0, 0, allow), (ret_k, 0, 0, refuse)]
    return b"".join(struct.pack("HBBI", *op) for op in ops)


def forbid_new_sockets(no_exec: bool = False) -> bool:
    """Make the kit's own group of the default group, then forbid new sockets in this
    process, every thread of it (irrevocably); with ``no_exec`` starting a program too
    (execve: a fresh interpreter is neither watched nor disarmed, as lab 12 shows). True
    when the filter is in place."""
    import torch.distributed as dist  # noqa: PLC0415

    from .. import rankhook  # noqa: PLC0415

    numbers = _ARCHES.get(platform.machine())
    if numbers is None or os.name != "posix" or not dist.is_initialized():
        return False
    # irrevocable: only in a rank process that ends after the check,
    if rankhook.this_rank() is None:
        return False  # never in a torchrun worker running the check in place
    if dist.get_backend() != "gloo":
        return False
    from .. import p2p  # noqa: PLC0415

    p2p.open_groups()  # the kit's collectives' own: made now
    arch, socket, socketpair, seccomp = numbers
    extra = _EXEC[platform.machine()] if no_exec else ()
    code = _program(arch, socket, socketpair, *_IPC[platform.machine()], *extra)
    filters = ctypes.create_string_buffer(code, len(code))

    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = _Prog(len(code) // 8, ctypes.cast(filters, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: needed without root
        return False
    # SECCOMP_SET_MODE_FILTER (1), SECCOMP_FILTER_FLAG_TSYNC (1): on every thread
    return libc.syscall(seccomp, 1, 1, ctypes.byref(prog)) == 0
