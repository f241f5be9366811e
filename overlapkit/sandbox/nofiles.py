"""A check's rank shares no file with the other ranks while the learner's code runs.

:mod:`.nosockets` leaves the ranks no new connection, but ranks on one machine share
files: the default group's own FileStore (``_get_default_store().set(...)`` in one rank,
``.get`` in the other) and any folder both can write. Whole tensors can move that way,
unseen by every record of the kit (labs 02, 03 and 11 would pass). So before the
learner's code runs, a check's rank restricts itself with Landlock (Linux ≥ 5.13, no
privilege needed, irrevocable)::

    read      every path but the launcher's folder (the store, the other ranks' scratch)
              and the other processes' /proc entries (a peer's cmdline is writable)
    write     this rank's own scratch folder (TMPDIR), and the emulated link's
              shared-memory folder where a link is on (its bytes go there)

A restriction holds for the thread that makes it and the threads it starts afterwards, so
it is made where the rank has no other Python thread (checked: none that could run the
learner's code). Where Landlock is missing (another OS, an old kernel, a container that
filters it) :func:`forbid_shared_files` returns False and the check runs as before.
What it does not close: the emulated link's shared-memory folder, which a check over a
link (most checks use one, for its headers) must leave open to both ranks: a learner who
finds it can write files there; whatever passes through the process groups themselves;
and a machine without Landlock.
"""

from __future__ import annotations

import ctypes
import os
import struct
import tempfile
import threading

#: landlock_create_ruleset, landlock_add_rule, landlock_restrict_self: one number on
#: every architecture (the syscall table shared since Linux 5.1)
_CREATE, _ADD_RULE, _RESTRICT = 444, 445, 446
_RULE_PATH_BENEATH = 1
_VERSION = 1  # landlock_create_ruleset's flag: return the ABI version

# access rights (the kernel's LANDLOCK_ACCESS_FS_*), by the ABI that added them
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_ABI1 = (1 << 13) - 1  # execute … make_sym
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_FILE_ONLY = EXECUTE | WRITE_FILE | READ_FILE | _TRUNCATE | _IOCTL_DEV  # valid on a file


def abi() -> int:
    """The kernel's Landlock ABI version; 0 where there is none."""
    if os.uname().sysname != "Linux":
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    version = libc.syscall(_CREATE, None, 0, _VERSION)
    return max(0, version)


def _handled(version: int) -> int:
    return (_ABI1 | (_REFER if version >= 2 else 0) | (_TRUNCATE if version >= 3 else 0)
            | (_IOCTL_DEV if version >= 5 else 0))  # fmt: skip


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _readable(hidden: list[str], me: int):
    """Paths to grant reading beneath: the top of every branch of the tree that holds no
    hidden folder, descending only into the folders that lead to one. /proc: its
    entries but other processes' (numbered folders); ours is granted by number."""

    def hides(path: str) -> bool:
        return any(_within(h, path) for h in hidden)

    def walk(folder: str):
        try:
            names = os.listdir(folder)
        except OSError:
            return
        for name in names:
            path = os.path.join(folder, name)
            if any(_within(path, h) for h in hidden):
                continue
            if folder == "/proc" and name.isdigit() and int(name) != me:
                continue
            if (hides(path) or path == "/proc") and os.path.isdir(path) and not (
                    os.path.islink(path)):  # fmt: skip
                yield from walk(path)
            else:
                yield path

    yield from walk("/")


def forbid_shared_files(hidden: list[str], writable: list[str]) -> bool:
    """Restrict this thread (and every thread it starts from now on): no path beneath
    ``hidden`` can be read or written, and writing is allowed beneath ``writable`` alone.
    True when the restriction is in place. Raises where another Python thread that could
    run the learner's code would escape it."""
    version = abi()
    if version < 1:
        return False
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if others:
        raise RuntimeError(f"forbid_shared_files: other threads would escape it: {others}")
    libc = ctypes.CDLL(None, use_errno=True)
    handled = _handled(version)
    attr = ctypes.create_string_buffer(struct.pack("Q", handled))
    ruleset = libc.syscall(_CREATE, attr, 8, 0)  # handled_access_fs alone (ABI 1's size)
    if ruleset < 0:
        return False
    try:
        reading = EXECUTE | READ_FILE | READ_DIR
        hidden = [os.path.realpath(h) for h in hidden]
        rules = [(p, reading) for p in _readable(hidden, os.getpid())]
        rules += [(os.path.realpath(w), handled) for w in writable]
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:  # gone since it was listed, or unreadable anyway
                continue
            try:
                if not os.path.isdir(path):
                    rights &= _FILE_ONLY
                rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd))
                libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, rule, 0)
            finally:
                os.close(fd)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: needed without root
            return False
        return libc.syscall(_RESTRICT, ruleset, 0) == 0
    finally:
        os.close(ruleset)


def scratch_folder(inside: str, rank: int) -> str:
    """A folder of this rank's own for temporary files, made inside ``inside`` (a hidden
    folder: no other rank can read it), and made Python's and torch's temporary folder."""
    folder = tempfile.mkdtemp(prefix=f"rank{rank}-scratch-", dir=inside)
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = folder
    return folder


def seal_rank_files() -> bool:
    """In a check's rank that ``ok.launch`` forked (it ends after the check), on gloo:
    hide the launcher's folder (the store, the logs, the other ranks' scratch), and allow
    writing only in a scratch folder of this rank's own and, where an emulated link is on,
    in the link's shared-memory folder (its data path). True when in place; then the rank
    ends without its store (:func:`overlapkit.rankhook.at_end`)."""
    import torch.distributed as dist  # noqa: PLC0415

    from .. import p2p, rankhook  # noqa: PLC0415

    spec = rankhook.this_rank()
    if spec is None or not dist.is_initialized():
        return False
    if dist.get_backend() != "gloo" or abi() < 1:
        return False
    workdir = spec.workdir
    scratch = scratch_folder(workdir, dist.get_rank())
    # an emulated link's bytes go through files both ranks write (overlapkit.shm): that
    # folder stays open where a link is on. Through the process group instead, a send and
    # a receive of different sizes abort gloo (SIGABRT) where the checks name the mistake
    writable = [scratch, "/dev/null"]
    hidden = [workdir]
    if spec.shm_dir and p2p.current_link() is not None:
        writable.append(spec.shm_dir)
    elif spec.shm_dir:
        hidden.append(spec.shm_dir)
    if not forbid_shared_files(hidden, writable):
        return False
    rankhook.at_end(lambda limit_s: True)  # the store is out of reach: end without it
    return True
