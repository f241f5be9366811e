"""The forkserver that ranks are forked from, and how a function travels to them.

Started once per process (a notebook's kernel), it imports torch and :data:`PRELOAD`
before it forks, so every rank inherits them (about 0.1 s to start 4 ranks instead of
seconds each). Functions and arguments travel by value with cloudpickle, keeping their
code's file names (a notebook cell's), so that tracebacks and hang reports point at the
learner's line.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import multiprocessing.spawn
import pickle
import signal
import threading
import types

import cloudpickle

_context_lock = threading.Lock()
_context = None
_served: list[str] = []  # what the running forkserver was started with
#: what the forkserver imports before it forks a rank (:func:`preload` adds to it)
PRELOAD = ["overlapkit._preload"]
_in_flight = 0  # launches whose ranks are being started or are running


def preload(module: str) -> None:
    """Have every rank forked from now on inherit ``module`` imported: the forkserver
    imports it before it forks. A forkserver already running without it is replaced at
    the next launch that finds no other launch in flight (that launch is cold); until
    then each rank imports it itself."""
    with _context_lock:
        if module not in PRELOAD:
            PRELOAD.append(module)


def _forkserver(starting: bool = False):
    """The multiprocessing context whose server has torch (and :data:`PRELOAD`) loaded.
    ``starting``: a launch starts its ranks from it (counted until :func:`_landed`)."""
    global _context, _in_flight
    with _context_lock:
        if _context is not None and _served != PRELOAD and _in_flight == 0:
            shutdown()  # it lacks a module registered since it started
            _context = None
        if _context is None:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(list(PRELOAD))
            _served[:] = PRELOAD
            _context = ctx
        _in_flight += starting
        return _context


def _landed() -> None:
    """A launch counted by ``_forkserver(starting=True)`` has stopped its ranks."""
    global _in_flight
    with _context_lock:
        _in_flight -= 1


def shutdown() -> None:
    """Stop the forkserver (the next launch starts a new one: a *cold* launch)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    stop = getattr(server, "_stop", None)
    if stop is not None:
        stop()


@contextlib.contextmanager
def _interrupts_after():
    """Ctrl-C (SIGINT) waits until the block is done: a rank whose start it cut short
    was forked, but its Process never learnt its pid, so nothing could stop it (its
    caller then waited on it at exit: a hang). Python runs signal handlers in the main
    thread only, so only there is the handler swapped; a Ctrl-C that came meanwhile is
    then handed to the handler that was there before."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came = []
    try:
        before = signal.signal(signal.SIGINT, lambda signum, frame: came.append(frame))
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
    if came:
        if callable(before):
            before(signal.SIGINT, came[0])
        elif before == signal.SIG_DFL:
            raise KeyboardInterrupt


@contextlib.contextmanager
def _ranks_skip_main():
    # multiprocessing re-runs the caller's __main__ in every child so that
    # functions pickled by reference can be found. Ours travel by value, and
    # re-running a script's top level in each rank would launch ranks again.
    original = mp.spawn.get_preparation_data

    def without_main(name):
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    mp.spawn.get_preparation_data = without_main
    try:
        yield
    finally:
        mp.spawn.get_preparation_data = original


_start_lock = threading.Lock()


class _FilenamePickler(cloudpickle.Pickler):
    """cloudpickle, but code objects keep their file name.

    cloudpickle 3 renames the file of by-value code to ``<dynamic-code>``; the
    real name (a notebook cell's) lets tracebacks and hang reports point at the
    learner's line.
    """

    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType) and _code_reduce is not None:
            rebuild, args = _code_reduce(obj)
            args = tuple(obj.co_filename if a == "<dynamic-code>" else a for a in args)
            return rebuild, args
        return super().reducer_override(obj)


_code_reduce = getattr(getattr(cloudpickle, "cloudpickle", None), "_code_reduce", None)


def dumps_keeping_filenames(obj) -> bytes:
    buf = io.BytesIO()
    _FilenamePickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()
