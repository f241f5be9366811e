"""Run a function on N fresh ranks, from a notebook cell or a script.

    ok.launch(fn, *args, world_size=4)        -> [fn's value on rank 0, ..., rank 3]

How, and why this way:

* **Fast.** A forkserver, started once per kernel, imports torch once; each
  launch forks ranks from it (about 0.1 s for 4 ranks instead of ~12 s for
  ``torch.multiprocessing.spawn``, where every rank imports torch again).
* **Notebook functions.** ``fn`` and its arguments travel by value with
  cloudpickle, so a function defined in a cell (or in a script's ``__main__``)
  runs on the ranks. For the same reason the ranks never re-import the
  caller's ``__main__``: a script needs no ``if __name__ == "__main__"`` guard.
* **Loopback only.** Ranks meet through a FileStore in a private temporary
  folder, and gloo/NCCL are told to use the loopback interface, so nothing
  listens on a public address.
* **Visible output.** Each rank writes to its own log; the caller prints the
  logs prefixed by rank, grouped per rank in rank order (deterministic).
* **Nothing hangs, nothing stays.** The caller waits at most ``timeout``
  seconds, then asks the ranks still running where they are (faulthandler),
  kills them and raises :class:`LaunchTimeoutError` naming them. An exception on
  a rank is re-raised here, with its type, the rank and the remote traceback.
  A kernel interrupt kills all ranks too. Ranks die with the kernel.
* **Scales out.** Under ``torchrun`` (RANK and WORLD_SIZE set), ``launch`` runs
  ``fn`` in place on this rank and all-gathers the values, so the same code
  runs on a cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.spawn
import os
import pickle
import re
import shutil
import signal
import tempfile
import threading
import time

import cloudpickle

from . import _rank, machine, plaindata, rankhook, runtime
from .forking import PRELOAD as PRELOAD
from .forking import _forkserver, _landed, _ranks_skip_main, _start_lock
from .forking import _interrupts_after as _interrupts_after
from .forking import dumps_keeping_filenames as dumps_keeping_filenames
from .forking import preload as preload
from .forking import shutdown as shutdown
from .rankoutput import _DUMP_HEADER, _format_frames, _read, _strip_dumps, _where_hung
from .rankoutput import hide_frames_from as hide_frames_from
from .rankoutput import last_words as last_words
from .rankoutput import print_rank_output as print_rank_output
from .torchrun import launch_in_place, under_torchrun

DEFAULT_TIMEOUT_S = 120.0


@plaindata.allow  # each of these is rebuilt by name from a distrusted rank's report
class LaunchError(RuntimeError):
    """A launch failed for a reason that is not the user's exception."""


@plaindata.allow
class RankFailedError(LaunchError):
    """A rank died (crash, signal, os._exit) or raised an exception that cannot be rebuilt here."""

    def __init__(self, message: str, rank: int | None = None, died: bool = False):
        super().__init__(message)
        self.rank = rank
        self.died = died  # the process ended (crash, signal, os._exit), it did not raise


@plaindata.allow
class LaunchTimeoutError(LaunchError, TimeoutError):
    """``timeout`` passed while some ranks were still running; they were killed."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


@plaindata.allow
class RemoteTraceback(Exception):
    """Carries the traceback of the rank where an exception was raised (shown as its cause)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


# --------------------------------------------------------------------------- channel

_last = threading.local()


def heard() -> tuple[dict[int, list[bytes]], set[int]] | None:
    """What the ranks of this thread's last :func:`launch` sent on their channels
    (:func:`overlapkit.rankhook.channel`): by rank, each message's bytes, and the ranks
    whose channel carried something that was not a whole message; None when that launch
    never got its ranks running."""
    return getattr(_last, "heard", None)


def _shm_root() -> str | None:
    """Where the emulated link's bytes go (:func:`overlapkit.machine.shm_root`): None means
    a temporary folder."""
    return machine.shm_root(os.environ)


# --------------------------------------------------------------------------- launch


def _check_launch(fn, world_size, timeout, rank_kwargs) -> None:
    """:func:`launch`'s arguments, checked before anything starts."""
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run on the ranks, got {type(fn).__name__}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive seconds or None, got {timeout!r}")
    if rank_kwargs is not None and len(rank_kwargs) != world_size:
        raise ValueError(f"rank_kwargs: one dict per rank ({world_size}), got {len(rank_kwargs)}")


def _payload(fn, args, kwargs, hook) -> bytes:
    """What every rank runs, pickled (by value where the kit's file names are kept)."""
    try:
        payload = dumps_keeping_filenames((fn, args, kwargs, hook))
    except Exception as exc:
        raise LaunchError(
            f"could not send {getattr(fn, '__name__', fn)!r} and its arguments to the ranks: "
            f"{exc}. Arguments must be picklable (no locks, sockets or live process groups)."
        ) from exc
    return payload


def _private(rank_kwargs) -> list | None:
    """Each rank's own keyword arguments, pickled (None: none)."""
    if rank_kwargs is None:
        return None
    try:
        return [dumps_keeping_filenames(kw) for kw in rank_kwargs]
    except Exception as exc:
        raise LaunchError(f"could not send rank_kwargs to the ranks: {exc}") from exc


def _spec(payload: bytes, world_size: int, backend: str, threads: int, timeout, link):
    """What the ranks are started with, in a directory of their own (their store and logs)."""
    workdir = tempfile.mkdtemp(prefix="overlapkit-")
    # the emulated link's data path: in RAM (tmpfs) where the system has one
    shm_dir = tempfile.mkdtemp(prefix="overlapkit-", dir=_shm_root() or workdir)
    return _rank.RankSpec(
        payload=payload,
        world_size=world_size,
        backend=backend,
        store_path=os.path.join(workdir, "store"),
        log_dir=workdir,
        threads=threads,
        timeout_s=timeout if timeout is not None else 3600.0,
        # gloo and NCCL listen on loopback only, unless the caller chose an interface:
        # worked out here, once a launch, not in each rank (finding it imports psutil:
        # ~25 ms a rank)
        env={**os.environ, **machine.socket_env(os.environ)},
        link=link,
        shm_dir=shm_dir,
        plain=not plaindata.trusting(),
        preload=tuple(PRELOAD),
    )


def _run_ranks(spec, private, timeout, quiet: bool) -> tuple:
    """Start the ranks, wait for them, and clean up after them: (their outcome, what each
    printed). Interrupted, what they printed is shown unless ``quiet``."""
    ranks = _Ranks(spec, private)
    interrupted = False
    try:
        ranks.start()
        outcome = ranks.wait(timeout)
        _last.heard = (dict(outcome.heard), set(outcome.garbled))
    except BaseException:  # KeyboardInterrupt from the kernel, above all
        interrupted = True
        raise
    finally:
        ranks.stop()
        logs = [_read(_rank.log_path(spec.log_dir, r)) for r in range(spec.world_size)]
        shutil.rmtree(spec.log_dir, ignore_errors=True)
        shutil.rmtree(spec.shm_dir, ignore_errors=True)
        if interrupted and not quiet:  # what the ranks printed before the interrupt
            print_rank_output(logs)
    return outcome, logs


def launch(
    fn,
    *args,
    world_size: int,
    backend: str = "auto",
    timeout: float | None = DEFAULT_TIMEOUT_S,
    threads: int | None = None,
    quiet: bool = False,
    link=None,
    rank_kwargs: list[dict] | None = None,
    hook=None,
    **kwargs,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks; return their values by rank.

    The default process group is initialised on each rank before ``fn`` runs
    (``backend="auto"``: where each rank can have a CUDA device of its own, rank r takes
    the r-th GPU ``CUDA_VISIBLE_DEVICES`` allows and the group is ``"cpu:gloo,cuda:nccl"``,
    NCCL for CUDA tensors and gloo for CPU ones; else gloo, the ranks on the CPU).
    ``timeout`` (seconds, None for none) bounds the whole launch.
    ``threads`` sets torch's intra-op threads per rank; by default the cores
    are shared out so that ranks do not oversubscribe them. ``quiet=True``
    discards the ranks' output instead of printing it. ``link`` (an :class:`ok.Link`)
    emulates a network for the kit's point-to-point messages and collectives.
    ``rank_kwargs``: one dict per rank, more keyword arguments for that rank's call only,
    sent to that rank alone (inputs that no other rank may see).
    ``hook`` (an :class:`overlapkit.RankHook`) adds to the ranks: modules they preload, a
    context around ``fn``, and what the caller does with what they sent on their channel.
    """
    _last.heard = None  # this launch's, never an earlier one's
    _check_launch(fn, world_size, timeout, rank_kwargs)
    if under_torchrun():
        mine = rank_kwargs[int(os.environ["RANK"])] if rank_kwargs is not None else {}
        return launch_in_place(fn, args, {**kwargs, **mine}, world_size, backend, link, hook)
    for module in getattr(hook, "preload", ()):
        preload(module)

    backend = runtime.resolve_backend(backend, world_size)
    machine.warn_small_shm(backend)  # NCCL keeps its buffers in /dev/shm: say so before it fails
    if threads is None:
        threads = max(1, runtime.usable_cores() // world_size)
    spec = _spec(_payload(fn, args, kwargs, hook), world_size, backend, threads, timeout, link)
    outcome, logs = _run_ranks(spec, _private(rank_kwargs), timeout, quiet)

    if outcome.timed_out:
        stacks = {r: _where_hung(logs[r]) for r in outcome.running}
        logs = [_strip_dumps(text) for text in logs]
    if not quiet:
        print_rank_output(logs)
    if hook is not None:
        hook.heard(dict(outcome.heard), set(outcome.garbled))
    if outcome.timed_out:
        raise _timeout_error(outcome.running, world_size, timeout, stacks)
    if outcome.failure is not None:
        raise _rebuild_failure(outcome, world_size, logs)
    if spec.plain:
        return [_plain_value(outcome.values[r], r) for r in range(world_size)]
    return [cloudpickle.loads(outcome.values[r]) for r in range(world_size)]


def _plain_value(data, rank: int):
    """A rank's value read as plain data (the caller distrusts its ranks)."""
    try:
        if not isinstance(data, bytes):
            raise plaindata.NotPlainData("the message held no value")
        return plaindata.loads(data)
    except plaindata.NotPlainData as exc:
        raise RankFailedError(
            f"rank {rank} returned a value that cannot be read: {exc}", rank
        ) from None


def _read_message(data: bytes, plain: bool):
    """A rank's message: ("ok", value bytes) or ("error", exc bytes, type name, text, frames,
    chained). From a distrusted rank it is read with no class allowed and its shape checked:
    a message that is anything else becomes an error of the rank's."""
    if not plain:
        return pickle.loads(data)
    try:
        message = plaindata.message(data)
    except Exception as exc:  # noqa: BLE001 - what a rank sends is the rank's affair
        return ("error", None, "MalformedMessage", f"the rank's message could not be read: {exc}",
                [], "")  # fmt: skip
    if isinstance(message, tuple) and len(message) == 2 and message[0] == "ok":
        if isinstance(message[1], bytes):
            return message
    elif isinstance(message, tuple) and len(message) == 6 and message[0] == "error":
        _, _, type_name, text, frames, chained = message
        frames_ok = isinstance(frames, list) and all(
            isinstance(f, tuple) and len(f) == 4 and isinstance(f[1], int)
            and all(isinstance(x, str) for x in (f[0], f[2], f[3])) for f in frames
        )  # fmt: skip
        if isinstance(type_name, str) and isinstance(text, str) and isinstance(chained, str):
            if frames_ok:
                return ("error", None, type_name, text, frames, chained)
    return ("error", None, "MalformedMessage", "the rank sent a message of another shape", [], "")


class _Outcome:
    def __init__(self, world: int):
        self.values: dict[int, bytes] = {}
        self.errors: dict[int, tuple] = {}
        self.running: list[int] = list(range(world))
        self.timed_out = False
        self.plain = False  # the values and errors are read as plain data
        #: per rank, the messages of its channel (``heard()``), and the ranks whose channel
        #: carried something that was not a whole message
        self.heard: dict[int, list[bytes]] = {r: [] for r in range(world)}
        self.garbled: set[int] = set()

    @property
    def failure(self) -> tuple[int, tuple] | None:
        """The failure to report: the root cause, not its echoes on the peers.

        When one rank raises, its peers soon fail too, inside a collective whose
        partner vanished ("Connection reset by peer"). Report the lowest rank
        with an error of its own, else the lowest rank that died, else the
        lowest failed rank: the same answer every run.
        """
        if not self.errors:
            return None
        own = [r for r, m in self.errors.items() if m[0] == "error" and not _is_echo(m)]
        died = [r for r, m in self.errors.items() if m[0] == "died"]
        first = min(own or died or self.errors)
        return first, self.errors[first]


_ECHO = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|remote (process|worker|peer)|"
    r"NCCL communicator was aborted|Socket Timeout|Connection refused"
)


def _is_echo(message: tuple) -> bool:
    """True for a collective that failed because a *peer* rank went away."""
    return bool(_ECHO.search(message[3]))


class _Ranks:
    """The rank processes of one launch, their result pipes, and their cleanup."""

    #: after the first failure, how long to wait for the other ranks' own errors,
    #: so that the lowest failing rank (not the fastest) is reported
    FAILURE_GRACE_S = 0.3
    #: the longest the caller waits for its ranks without looking at its signals
    WAKE_S = 0.5

    def __init__(self, spec: _rank.RankSpec, private: list[bytes] | None = None):
        self.spec, self.private = spec, private
        self.procs: list = []
        self.conns: list = []
        self.channels: list = []
        self._finished = [False] * spec.world_size
        self._counted = False

    def start(self) -> None:
        ctx = _forkserver(starting=True)
        self._counted = True
        with _start_lock, _ranks_skip_main(), _interrupts_after():
            for r in range(self.spec.world_size):
                recv, send = ctx.Pipe(duplex=False)
                # the rank's channel: what it writes there leaves at once, apart from
                # the value it returns at its end
                heard_recv, heard_send = ctx.Pipe(duplex=False)
                # a rank's own keyword arguments go in its spec alone
                spec = self.spec if self.private is None else (
                    dataclasses.replace(self.spec, private=self.private[r]))  # fmt: skip
                proc = ctx.Process(
                    target=_rank.main, args=(spec, r, send, heard_send),
                    name=f"overlapkit-rank{r}",
                )  # fmt: skip
                self.conns.append(recv)
                self.channels.append(heard_recv)
                proc.start()
                send.close()  # our copy: EOF on recv must mean the rank is gone
                heard_send.close()
                self.procs.append(proc)

    def wait(self, timeout: float | None) -> _Outcome:
        out = _Outcome(self.spec.world_size)
        out.plain = self.spec.plain
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = {self.conns[r]: r for r in range(len(self.procs))}
        # read as they come: a rank that sees much must not block on a full pipe
        seeing = {self.channels[r]: r for r in range(len(self.procs))}
        while pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            if out.errors:
                grace_end = self._first_error_at + self.FAILURE_GRACE_S
                remaining = max(0.0, grace_end - time.monotonic())
                if remaining == 0.0:
                    break
            elif remaining is not None and remaining <= 0:
                out.timed_out = True
                break
            # in slices: a Ctrl-C that the OS hands to another thread (a Jupyter kernel
            # has several) wakes no thread blocked here, and Python runs the handler in
            # the main thread only once it is back from the wait
            step = self.WAKE_S if remaining is None else min(remaining, self.WAKE_S)
            ready = mp.connection.wait([*pending, *seeing], timeout=step)
            for conn in ready:
                if conn in seeing:
                    self._hear(conn, seeing, out)
                else:
                    self._receive(conn, pending.pop(conn), out)
        # what a rank saw before it sent its value is in its pipe by now
        for conn in list(seeing):
            while conn in seeing and conn.poll(0):
                self._hear(conn, seeing, out)
        out.running = sorted(pending.values())
        if out.timed_out and out.running:
            # ask for the stacks before the kill; ranks still running after a
            # *failure* are usually waiting for the failed peer, no dump needed
            self.dump_stacks(out.running)
            _await_dumps(self.spec, out.running)
        return out

    @staticmethod
    def _hear(conn, seeing: dict, out: _Outcome) -> None:
        rank = seeing[conn]
        try:
            out.heard[rank].append(conn.recv_bytes(rankhook.CHANNEL_LIMIT))
        except EOFError:  # the rank has ended: nothing more comes
            del seeing[conn]
        except OSError:  # a message cut short or too long
            out.garbled.add(rank)
            del seeing[conn]

    def _receive(self, conn, rank: int, out: _Outcome) -> None:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            data = None
        message = None if data is None else _read_message(data, plain=self.spec.plain)
        if message is not None and message[0] == "ok":
            out.values[rank] = message[1]
            self._finished[rank] = True
            return
        if message is None:  # the pipe closed without a message: the process died
            proc = self.procs[rank]
            proc.join(1.0)
            message = ("died", proc.exitcode)
        if not out.errors:
            self._first_error_at = time.monotonic()
        out.errors[rank] = message

    def stop(self) -> None:
        """Kill whatever still runs, reap every process, close every descriptor."""
        # ranks that sent their value exit on their own within moments; the
        # others (hung, or waiting for a failed peer) never do
        end = time.monotonic() + 2.0
        for r, p in enumerate(self.procs):
            if not self._finished[r]:
                _kill(p)
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.exitcode is None:
                _kill(p)
        for p in self.procs:
            p.join(5.0)
            with contextlib.suppress(ValueError):
                p.close()
        for c in self.conns + self.channels:
            c.close()
        if self._counted:
            self._counted = False
            _landed()

    def dump_stacks(self, ranks: list[int]) -> None:
        """Ask hung ranks to write their Python stacks to their logs (faulthandler)."""
        for r in ranks:
            pid = self.procs[r].pid
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(pid, _rank.DUMP_SIGNAL)


def _kill(proc) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
        os.kill(proc.pid, signal.SIGKILL)


def _await_dumps(spec: _rank.RankSpec, ranks: list[int], limit_s: float = 1.0) -> None:
    end = time.monotonic() + limit_s
    pending = set(ranks)
    while pending and time.monotonic() < end:
        for r in list(pending):
            if _DUMP_HEADER.search(_read(_rank.log_path(spec.log_dir, r))):
                pending.discard(r)
        time.sleep(0.02)
    time.sleep(0.05)  # let the dump finish writing its last frames


def _timeout_error(running, world, timeout, stacks) -> LaunchTimeoutError:
    names = ", ".join(map(str, running))
    done = [r for r in range(world) if r not in running]
    parts = [
        f"rank{'s' if len(running) > 1 else ''} {names} of {world} still running after "
        f"{timeout:g} s; all ranks were stopped"
        + (
            f" (rank{'s' if len(done) > 1 else ''} {', '.join(map(str, done))} had finished)"
            if done
            else ""
        )
        + ". A rank waiting for a message nobody sends (or a collective that not every "
        "rank calls) hangs forever."
    ]
    for r in running:
        parts.append(f"rank {r} was here (innermost call first):\n{stacks[r]}")
    return LaunchTimeoutError("\n".join(parts), running)


def _rebuild_failure(outcome: _Outcome, world: int, logs=()) -> BaseException:
    rank, message = outcome.failure
    others = sorted(r for r in outcome.errors if r != rank)
    header = f"raised on rank {rank} of {world}"
    if others:
        header += (
            f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed after it"
        )
    if message[0] != "died" and _is_echo(message) and outcome.values:
        done = ", ".join(map(str, sorted(outcome.values)))
        header += (
            f"; rank(s) {done} had already returned: rank {rank} was probably waiting for a "
            "message or a collective that they never sent"
        )
    if message[0] == "died":
        code = message[1]
        how = (
            f"was killed by signal {signal.Signals(-code).name}"
            if code and code < 0
            else f"exited with code {code}"
        )
        said = last_words(logs[rank]) if rank < len(logs) else ""
        why = f"; its last words: {said}" if said else ""
        error = RankFailedError(
            f"rank {rank} of {world} {how} before returning{why}", rank, died=True
        )
        error.last_words, error.exitcode = said, code
        return error
    _, exc_bytes, type_name, text, frames, chained = message
    remote = ""
    if chained:
        remote = chained + "\nThe above exception was the direct cause of the following one:\n\n"
    remote += _format_frames(frames) + f"\n{type_name}: {text}"
    exc = None
    if outcome.plain:  # never unpickled: rebuilt from its type's name, built-in or the kit's
        exc = plaindata.rebuild_exception(type_name, text)
    elif exc_bytes is not None:
        try:
            exc = cloudpickle.loads(exc_bytes)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RankFailedError(f"{type_name}: {text} ({header})", rank)
    elif hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(f"({header})")
    exc.__cause__ = RemoteTraceback(f'{header}:\n"""\n{remote}\n"""')
    exc.rank = rank
    return exc


__all__ = [
    "launch",
    "shutdown",
    "LaunchError",
    "LaunchTimeoutError",
    "RankFailedError",
    "RemoteTraceback",
    "print_rank_output",
]
