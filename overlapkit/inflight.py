"""In-flight tensors are guarded: touching one before ``wait()`` is caught, every time.

An asynchronous collective reads and writes its tensor in the background until
``wait()`` returns. Changing the tensor in between (dividing a gradient right
after starting its AllReduce) or reading it (copying a bucket back before its
wait) is a data race: on a quiet machine the AllReduce may happen to win, so a
race that "works" nine runs in ten is still wrong. The kit makes both show::

    issue ──────────── in flight ──────────────── wait()
      │  version v recorded                          │ version still v?  else RaceError
      │  (debug) caller's tensor := NaN, the op      │ (debug) result copied back
      │  works on its own copy                       │

* **Writes**, always: a tensor's version counter (``t._version``, bumped by
  every in-place op) is recorded when the op is issued and when it ends; a
  change by anyone but the kit before ``wait()`` raises :class:`RaceError`
  at ``wait()``, naming the tensor, the op and the line that started it.
* **Reads**, under :func:`debug_races` (the checks turn it on): the op works
  on a private copy and the caller's tensor holds a poison value (NaN; the
  smallest integer for integer tensors) until ``wait()`` (or an
  ``is_completed()`` that returns True) writes the result back. A premature
  read then sees NaN every time, not one run in ten. Writes are caught even
  while the op runs, since the op no longer touches the caller's tensor.

On GPUs the same bugs have other names: NCCL reads and writes on its own
stream, so a kernel on the compute stream that touches the buffer before
``work.wait()`` races with it; ``tensor.record_stream(stream)`` keeps the
caching allocator from reusing a buffer still in use there, and NVIDIA's
``compute-sanitizer --tool racecheck`` (with ``TORCH_NCCL_...`` debug flags)
finds such races. The version counter works the same on CUDA tensors.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref

import torch

_state = {"debug": os.environ.get("OVERLAPKIT_DEBUG_RACES", "") not in ("", "0")}
_lock = threading.Lock()
#: storage key -> [version the kit last saw, guards in flight on that storage, a weak
#: reference to a tensor on it (a dead one means the storage was freed and its address reused)]
_owned: dict = {}


class RaceError(RuntimeError):
    """A tensor was changed while a kit operation on it was in flight."""


def debug_races(enabled: bool = True):
    """Turn the read guard on (or off) in this process; also a context manager.

    ::

        ok.debug_races()                # from here on
        with ok.debug_races():          # only inside the block
            ...
    """
    before = _state["debug"]
    _state["debug"] = bool(enabled)

    @contextlib.contextmanager
    def restore():
        try:
            yield
        finally:
            _state["debug"] = before

    return _Switch(restore())


class _Switch:
    """What :func:`debug_races` returns: already applied; as a context, undone on exit."""

    def __init__(self, context):
        self._context = context

    def __enter__(self):
        return self._context.__enter__()

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)


def debugging() -> bool:
    return _state["debug"]


def describe(tensor: torch.Tensor) -> str:
    shape = "×".join(map(str, tensor.shape)) or "scalar"
    return f"the tensor of shape {shape} ({str(tensor.dtype).removeprefix('torch.')})"


def _key(tensor: torch.Tensor):
    return (tensor.device, tensor.untyped_storage().data_ptr())


def _entry(tensor: torch.Tensor, create: bool = False):
    """The registry entry of ``tensor``'s storage (call with ``_lock`` held)."""
    key = _key(tensor)
    entry = _owned.get(key)
    if entry is not None and entry[2]() is None:
        del _owned[key]
        entry = None
    if entry is None and create:
        entry = _owned[key] = [tensor._version, 0, weakref.ref(tensor)]
    return entry


def _release(tensor: torch.Tensor) -> None:
    entry = _entry(tensor)
    if entry is not None:
        entry[1] -= 1
        if entry[1] <= 0:
            del _owned[_key(tensor)]


def poison(tensor: torch.Tensor) -> None:
    """Fill ``tensor`` with a value no honest result holds."""
    if tensor.dtype == torch.bool or tensor.numel() == 0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    else:
        tensor.fill_(torch.iinfo(tensor.dtype).min)


class Guard:
    """The guard of one asynchronous operation over ``tensors`` (``writes[i]``: the op
    writes ``tensors[i]``; otherwise it only reads it).

    The op runs on :attr:`working` (the caller's tensors, or private copies under
    :func:`debug_races`), calls :meth:`started` and :meth:`ended` on its worker,
    and the caller's ``wait()`` calls :meth:`settle`, which raises :class:`RaceError`.
    """

    def __init__(self, what: str, site: str, tensors, writes):
        self.what, self.site = what, site
        self.tensors, self.writes = list(tensors), list(writes)
        # an empty tensor holds nothing to race on (and shares its address with others)
        self._watched = [t for t in self.tensors if t.numel()]
        self.private = debugging()
        self.error: str | None = None
        self._settled = False
        self._settling = threading.Lock()
        #: seconds the private copies took to make and write back (a timing check allows
        #: for them: they are the guard's, not the operation's)
        self.copy_s = self.copy_back_s = 0.0
        with _lock:
            for t in self._watched:
                entry = _entry(t)
                if self.private and entry is not None and entry[1]:
                    raise RaceError(
                        f"{describe(t)} is already in flight in an earlier operation that "
                        f"was not waited yet: wait() for it before starting {what} at {site}"
                    )
        if self.private:
            began = time.perf_counter()
            with torch.no_grad():
                self.working = [t.detach().clone() for t in self.tensors]
                for t, written in zip(self.tensors, self.writes, strict=True):
                    if written:
                        poison(t)
            self.copy_s = time.perf_counter() - began
        else:
            self.working = self.tensors
        with _lock:
            for t in self._watched:
                entry = _entry(t, create=True)
                entry[0] = t._version
                entry[1] += 1
        self._issued = [t._version for t in self._watched]

    def _changed(self, t: torch.Tensor, expected: int) -> None:
        if self.error is None and t._version != expected:
            self.error = (
                f"{describe(t)} was changed while {self.what} (started at {self.site}) was "
                "still in flight, before its wait(): the operation reads and writes it in the "
                "background until wait() returns, so the change is lost or mixed into its "
                "result. Touch the tensor only after wait() — e.g. divide a gradient after its "
                "handle's wait()"
            )

    def started(self) -> None:
        """On the worker, as the op begins: nobody wrote the tensors since their issue."""
        if self.private:
            return  # the caller's tensors are checked at wait(); the op has its copies
        with _lock:
            for t in self._watched:
                entry = _entry(t)
                if entry is not None:
                    self._changed(t, entry[0])

    def ended(self) -> None:
        """On the worker, as the op ends: the kit's own writes are the last ones seen."""
        if self.private:
            return
        with _lock:
            for t in self._watched:
                entry = _entry(t)
                if entry is not None:
                    entry[0] = t._version

    def settle(self) -> None:
        """On the caller (``wait()``, or ``is_completed()`` once True; idempotent): check
        that nobody else changed the tensors, write a private result back, and raise
        :class:`RaceError` when the tensors were touched. ``wait()`` and a future's
        callback on the worker may settle at once: the second finds the result written."""
        with self._settling:
            if not self._settled:
                with _lock:
                    for i, t in enumerate(self._watched):
                        entry = _entry(t)
                        if self.private:
                            self._changed(t, self._issued[i])
                        elif entry is not None and entry[1] == 1:  # else another op writes it
                            self._changed(t, entry[0])
                        _release(t)
                if self.private:
                    began = time.perf_counter()
                    with torch.no_grad():
                        for t, mine, written in zip(self.tensors, self.working, self.writes,
                                                    strict=True):  # fmt: skip
                            if written:
                                t.copy_(mine)
                    self.copy_back_s = time.perf_counter() - began
                self._settled = True
        if self.error is not None:
            raise RaceError(self.error)

    def abandon(self) -> None:
        """The op failed: release its tensors (its failure is what wait() raises)."""
        with self._settling:
            if not self._settled:
                self._settled = True
                with _lock:
                    for t in self._watched:
                        _release(t)
