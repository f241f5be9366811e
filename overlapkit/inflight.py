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
  every in-place op) is recorded when the op is issued, and the op writes
  through aliases of the same memory (``t.data``) whose writes leave it alone;
  so any change before ``wait()``, before or while the op runs, is someone
  else's, and raises :class:`RaceError` at ``wait()``, naming the tensor, the
  op and the line that started it.
  A slice of a larger buffer shares its counter with the rest of the buffer,
  so a write elsewhere in it (the next bucket's gradients) looks the same:
  slices are judged by the read guard below, by their content.
* **Reads**, under :func:`debug_races`: the op works
  on a private copy and the caller's tensor holds a poison value (a
  signalling NaN; the smallest integer for integer tensors) until ``wait()``
  (or an ``is_completed()`` that returns True) writes the result back. A
  premature read then sees NaN every time, not one run in ten. Writes are
  caught even while the op runs, and by content: any arithmetic on a
  signalling NaN (``grad /= n``) leaves a quiet one, other bits, and a tensor
  only read must keep the bits the op read.
* **Two ops on the same bytes** in flight at once, one of them writing, are
  refused under :func:`debug_races`; disjoint slices of one buffer, or two
  sends of one tensor, are not.

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

from . import plaindata

_state = {"debug": os.environ.get("OVERLAPKIT_DEBUG_RACES", "") not in ("", "0")}
_lock = threading.Lock()
#: storage key -> [version the kit last saw, the guards in flight on that storage as
#: (guard, tensor, written) rows, a weak reference to a tensor on it (a dead one means
#: the storage was freed and its address reused)]. Views of one buffer share a storage:
#: a row keeps its own tensor so that only overlapping bytes conflict.
_owned: dict = {}


@plaindata.allow  # rebuilt by name from a distrusted rank's report
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
        entry = _owned[key] = [tensor._version, [], weakref.ref(tensor)]
    return entry


def _release(guard, tensor: torch.Tensor) -> None:
    entry = _entry(tensor)
    if entry is not None:
        entry[1][:] = [row for row in entry[1] if row[0] is not guard]
        if not entry[1]:
            del _owned[_key(tensor)]


def _extent(t: torch.Tensor) -> tuple[int, int, bool]:
    """The bytes ``[lo, hi)`` of its storage that ``t``'s elements lie within, and whether
    they fill that range (a slice does; a column of a matrix does not)."""
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))
    lo = t.storage_offset() * t.element_size()
    return lo, lo + span * t.element_size(), span == t.numel()


def _bytes(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Which bytes of ``[lo, hi)`` of its storage ``t`` holds (a mask)."""
    first, last, _ = _extent(t)
    size = t.element_size()
    elements = torch.arange((last - first) // size).as_strided(t.shape, t.stride())
    starts = (elements.reshape(-1) + t.storage_offset()) * size
    held = (starts[:, None] + torch.arange(size)).reshape(-1)
    held = held[(held >= lo) & (held < hi)] - lo
    mask = torch.zeros(hi - lo, dtype=torch.bool)
    mask[held] = True
    return mask


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share a byte of memory (views of one buffer may, or may not)."""
    if a.numel() == 0 or b.numel() == 0 or _key(a) != _key(b):
        return False
    (a_lo, a_hi, a_dense), (b_lo, b_hi, b_dense) = _extent(a), _extent(b)
    lo, hi = max(a_lo, b_lo), min(a_hi, b_hi)
    if lo >= hi:
        return False
    if a_dense and b_dense:
        return True
    return bool((_bytes(a, lo, hi) & _bytes(b, lo, hi)).any())


def _whole(t: torch.Tensor) -> bool:
    """Whether ``t`` is all of its storage: then any write to the storage is one to ``t``."""
    lo, hi, dense = _extent(t)
    return dense and lo == 0 and hi == t.untyped_storage().nbytes()


#: a signalling NaN per floating dtype, as the bits of a same-sized integer: a NaN to
#: every reader, and arithmetic on it (``x /= 2``, ``x += 0``) gives a *quiet* NaN, other
#: bits, so a write to a poisoned tensor shows even where its value stays NaN
_SIGNALLING = {
    torch.float64: (torch.int64, 0x7FF4000000000000),
    torch.float32: (torch.int32, 0x7FA00000),
    torch.float16: (torch.int16, 0x7D00),
    torch.bfloat16: (torch.int16, 0x7FA0),
}


def _bits(tensor: torch.Tensor):
    """``tensor`` as integers of its element size, and its poison's bits (None: no poison
    whose every change shows: bool, float8)."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.dtype in _SIGNALLING:
        int_dtype, pattern = _SIGNALLING[tensor.dtype]
        return tensor.view(int_dtype), pattern
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        return None, None
    return tensor, torch.iinfo(tensor.dtype).min


def poison(tensor: torch.Tensor) -> None:
    """Fill ``tensor`` with a value no honest result holds: a signalling NaN for floats,
    the smallest integer for integers."""
    if tensor.numel() == 0 or tensor.dtype == torch.bool:
        return
    bits, pattern = _bits(tensor)
    if bits is None:
        tensor.fill_(float("nan"))
    else:
        bits.fill_(pattern)


def _still_poisoned(tensor: torch.Tensor) -> bool | None:
    """Whether every element of ``tensor`` still holds the poison's exact bits (None:
    its dtype has no such poison)."""
    bits, pattern = _bits(tensor)
    return None if bits is None else bool((bits == pattern).all())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits_a, _ = _bits(a)
    bits_b, _ = _bits(b)
    if bits_a is None:  # bool or float8: compare as bytes
        bits_a, bits_b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return torch.equal(bits_a, bits_b)


class Guard:
    """The guard of one asynchronous operation over ``tensors`` (``writes[i]``: the op
    writes ``tensors[i]``; otherwise it only reads it).

    The op runs on :attr:`working` (aliases of the caller's tensors, or private copies
    under :func:`debug_races`), calls :meth:`started` on its worker,
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
        #: seconds the private copies took to make and write back (a timing measurement allows
        #: for them: they are the guard's, not the operation's)
        self.copy_s = self.copy_back_s = 0.0
        if self.private:
            with _lock:
                self._refuse_overlaps()
            began = time.perf_counter()
            with torch.no_grad():
                self.working = [t.detach().clone() for t in self.tensors]
                for t, written in zip(self.tensors, self.writes, strict=True):
                    if written:
                        poison(t)
            self.copy_s = time.perf_counter() - began
        else:  # the caller's storage, through aliases whose writes leave its version alone
            self.working = [t.data for t in self.tensors]
        with _lock:
            for t, written in self._rows():
                entry = _entry(t, create=True)
                entry[0] = t._version
                entry[1].append((self, t, written))
        self._issued = {id(t): t._version for t in self._watched}

    def _rows(self):
        """(tensor, written) of the tensors watched."""
        return [(t, w) for t, w in zip(self.tensors, self.writes, strict=True) if t.numel()]

    def _refuse_overlaps(self) -> None:
        """Two ops in flight at once on the same bytes, one of them writing, race with
        each other (which lands last?). Disjoint slices of one buffer do not; nor do two
        ops that only read (call with ``_lock`` held)."""
        for t, written in self._rows():
            entry = _entry(t)
            for _, other, other_writes in entry[1] if entry is not None else ():
                if (written or other_writes) and overlaps(t, other):
                    raise RaceError(
                        f"{describe(t)} is already in flight in an earlier operation that "
                        f"was not waited yet: wait() for it before starting {self.what} at "
                        f"{self.site}"
                    )

    def _changed(self, t: torch.Tensor, expected: int | None = None) -> None:
        """Record a race on ``t`` when its version is not ``expected`` (None: it was
        changed, as its content shows)."""
        if self.error is None and (expected is None or t._version != expected):
            self.error = (
                f"{describe(t)} was changed while {self.what} (started at {self.site}) was "
                "still in flight, before its wait(): the operation reads and writes it in the "
                "background until wait() returns, so the change is lost or mixed into its "
                "result. Touch the tensor only after wait() — e.g. divide a gradient after its "
                "handle's wait()"
            )

    def started(self) -> None:
        """On the worker, as the op begins: nobody wrote the tensors since their issue.

        Only a tensor that is all of its buffer is judged by its version counter: a
        slice shares its counter with the rest of the buffer, so a write elsewhere in the
        buffer (the next bucket's gradients) would look the same as one to the slice.
        Slices are judged by their content under :func:`debug_races`."""
        if self.private:
            return  # the caller's tensors are checked at wait(); the op has its copies
        with _lock:
            for t in self._watched:
                entry = _entry(t)
                if entry is not None and _whole(t):
                    self._changed(t, entry[0])

    def _private_changes(self) -> None:
        """Under :func:`debug_races`: whether the caller wrote a tensor while the op worked
        on its copy, told by content, so that a write to another slice of the same buffer
        is not mistaken for one to this tensor. A written tensor must still hold the
        poison's exact bits (``grad /= n`` turns a signalling NaN into a quiet one); a
        read one, the bits the op read."""
        for t, mine, written in zip(self.tensors, self.working, self.writes, strict=True):
            if not t.numel():
                continue
            if written:
                untouched = _still_poisoned(t)
                if untouched is None:  # no exact poison for its dtype: its version decides
                    untouched = not _whole(t) or t._version == self._issued[id(t)]
            else:
                untouched = _same_bits(t, mine)
            if not untouched:
                self._changed(t)

    def settle(self) -> None:
        """On the caller (``wait()``, or ``is_completed()`` once True; idempotent): check
        that nobody else changed the tensors, write a private result back, and raise
        :class:`RaceError` when the tensors were touched. ``wait()`` and a future's
        callback on the worker may settle at once: the second finds the result written."""
        with self._settling:
            if not self._settled:
                with _lock:
                    if self.private:
                        self._private_changes()
                    for t in self._watched:
                        entry = _entry(t)
                        alone = entry is not None and all(r[0] is self for r in entry[1])
                        if not self.private and alone and _whole(t):  # else another op writes it
                            self._changed(t, entry[0])
                        _release(self, t)
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
                        _release(self, t)
