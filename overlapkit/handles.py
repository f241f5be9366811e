"""Honest handles: an operation you started and never waited is reported, not forgotten.

``ok.p2p.isend`` and ``ok.ring_all_reduce(..., async_op=True)`` return handles.
Forgetting ``wait()`` is the classic overlap bug: the tensor may still be
changing, an un-waited send may never be delivered, a failure goes unseen. So
every handle the learner receives is tracked until it is waited, and when the
launched function returns (``ok.launch`` or torchrun), :func:`report_unwaited`
names each one and where it was issued — and re-raises a failure nobody saw.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import warnings
import weakref

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_unwaited: dict = {}
_lock = threading.Lock()


# decorators' and context managers' frames between a kit call and its caller
# (torch.no_grad() on a kit method, a ``with`` exiting into kit code)
_WRAPPERS = (os.sep + "contextlib.py", os.sep + "_contextlib.py")


def _caller() -> tuple[str, int] | None:
    """(file, line) of the first caller outside overlapkit (the learner's line)."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE)
                                 or frame.f_code.co_filename.endswith(_WRAPPERS)):  # fmt: skip
        frame = frame.f_back
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno)


def _format_site(site) -> str:
    return "?" if site is None else f"{os.path.basename(site[0])}:{site[1]}"


class Done:
    """The handle of an operation that has already ended: what a synchronous call (which
    returns ``None``) stands for where a handle is expected."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class UnwaitedOperationWarning(UserWarning):
    """An operation was started and never waited before the launched function returned."""


class Tracked:
    """Base of the handles given to the learner: ``wait(timeout=None)``, ``is_completed()``.

    ``kit=True`` for handles the kit makes for itself inside its collectives
    (those wait their own); they are not tracked. ``what`` may be a function
    that returns the text: it is only needed for errors and reports.
    """

    def __init__(self, what, kit: bool = False):
        self._what = what
        self._site = None
        self.waited = kit
        if not kit:
            self._site = _caller()  # formatted only for a report
            with _lock:
                _unwaited[id(self)] = self

    @property
    def site(self) -> str:
        return _format_site(self._site)

    @property
    def what(self) -> str:
        return self._what() if callable(self._what) else self._what

    def _wait(self, timeout_at: float | None) -> None:
        raise NotImplementedError

    def is_completed(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done; raise its failure; TimeoutError after ``timeout`` seconds."""
        call = self._plain_wait
        # the observers' wrappers (wrap_wait), outermost last: here, in the class, a wait is seen
        # however it was called (handle.wait(), type(handle).wait(handle), wait_all)
        for wrapper in _wrappers.get(self, ()):
            call = functools.partial(wrapper, call)
        return call(timeout)

    def _plain_wait(self, timeout: float | None = None) -> bool:
        timeout_at = None if timeout is None else time.perf_counter() + float(timeout)
        try:
            self._wait(timeout_at)
        except TimeoutError:
            raise  # still in flight: a later wait() may finish it
        except BaseException:
            self._mark_waited()
            raise
        self._mark_waited()
        return True

    def _mark_waited(self) -> None:
        if not self.waited:
            self.waited = True
            with _lock:
                _unwaited.pop(id(self), None)


#: each handle's wait wrappers (wrap_wait), kept beside the handle, not on it
_wrappers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wrap_wait(handle: Tracked, wrapper) -> Tracked:
    """Run ``wrapper(wait, timeout)`` for every wait of ``handle`` instead of ``wait(timeout)``
    itself, however the wait is called (``handle.wait()``, ``type(handle).wait(handle)``,
    ``ok.p2p.wait_all``): how a tool or a test observes when, and how long, a handle is
    waited. Returns ``handle``."""
    if not isinstance(handle, Tracked):
        raise TypeError(f"wrap_wait: not a kit handle: {type(handle).__name__}")
    _wrappers.setdefault(handle, []).append(wrapper)
    return handle


def report_unwaited(grace_s: float = 5.0) -> None:
    """Warn about each handle never waited; raise the first failure among them.

    Each is given up to ``grace_s`` seconds (in all) to finish, so that the
    report says whether it finished, failed, or was still running.
    """
    with _lock:
        left = list(_unwaited.values())
        _unwaited.clear()
    failure = None
    deadline = time.perf_counter() + grace_s
    for handle in left:
        try:
            handle._wait(deadline)
            state = "it finished, but nothing made this rank wait for it"
        except TimeoutError:
            state = "it was still running"
        except BaseException as exc:  # noqa: BLE001 - reported below
            state = f"it FAILED: {type(exc).__name__}: {exc}"
            failure = failure or (handle, exc)
        warnings.warn(
            f"{handle.what} started at {handle.site} was never waited: {state}. "
            "Call .wait() on every handle before using its tensor (or returning).",
            UnwaitedOperationWarning,
            stacklevel=2,
        )
    if failure is not None:
        handle, exc = failure
        raise RuntimeError(
            f"{handle.what} started at {handle.site} failed and nobody waited for it: {exc}"
        ) from exc


def pending() -> int:
    """How many handles of this process are issued and not yet waited."""
    return len(_unwaited)  # one read of a dict's size: no lock to take from any thread


def take_unwaited() -> list[str]:
    """Describe and stop tracking the handles not waited so far, for a caller that reports
    them itself (instead of the warnings at the rank's end, :func:`report_unwaited`)."""
    with _lock:
        left = list(_unwaited.values())
        _unwaited.clear()
    for handle in left:
        handle.waited = True
    return [f"{h.what} (started at {h.site})" for h in left]


class Polled:
    """A gloo send's or receive's work whose ``is_completed()`` can be polled.

    Gloo marks its point-to-point works complete inside ``wait()`` alone: polled without
    one, ``is_completed()`` stays False after the message has long arrived, and a loop of
    ``wait(timeout=…)`` built on polling never ends. So the first poll starts a thread of
    the work's own that waits for it; ``wait()`` then waits for that thread (a gloo work
    waited twice waits for a second message), else waits as before."""

    def __init__(self, work):
        self._work = work
        self._done: threading.Event | None = None
        self._error: BaseException | None = None

    def is_completed(self) -> bool:
        if self._done is None:
            self._done = threading.Event()
            threading.Thread(target=self._wait_then_mark, daemon=True,
                             name="overlapkit-gloo-waiter").start()  # fmt: skip
        return self._done.is_set()

    def _wait_then_mark(self) -> None:
        try:
            self._work.wait()
        except Exception as exc:  # noqa: BLE001 - raised by wait(), in the caller's thread
            self._error = exc
        self._done.set()

    def wait(self, *args, **kwargs):
        if self._done is None:
            return self._work.wait(*args, **kwargs)
        self._done.wait()  # the waiter thread's wait() is the one wait gloo allows
        if self._error is not None:
            raise self._error
        return True

    def __getattr__(self, name):
        return getattr(self._work, name)
