"""Values that come back from ranks the caller does not trust, read as plain data.

Unpickling runs code: the bytes name the functions to call while they are read
(``__reduce__``), so whoever wrote them runs code in the reader. ``ok.launch`` normally
trusts its ranks, since they run the caller's own function. A caller that runs a function
someone else wrote (a program that runs its users' code, say) cannot: that function could
make its rank's return value, its exception or the message around both run code in the
caller. Under :func:`distrust`, therefore, as ``torch.load(weights_only=True)`` does for
checkpoints:

* the message a rank sends (``("ok", value)``, or an error's type name, text and
  frames) is read by an unpickler that knows no class at all: tuples, lists, strings,
  bytes and numbers only;
* the value inside is written with ``torch.save`` and read with PyTorch's weights-only
  loader (its safety is PyTorch's to keep): tensors, numbers, strings, lists, tuples,
  dicts, None, and the data-only classes registered with :func:`allow` — no other class,
  so not a ``float`` subclass whose ``__sub__`` always agrees either;
* an exception is rebuilt from its type's name, among the built-in exceptions and the
  ones registered with :func:`allow` (the launcher's, the race guard's, ...)
  (:func:`rebuild_exception`), with the rank's text; never unpickled.

What this does not cover: code that runs as the same user can still change files and
other processes of that user.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import pickle
import re

_trusting = True


def trusting() -> bool:
    """Whether launches here read their ranks' results with the full unpickler."""
    return _trusting


@contextlib.contextmanager
def distrust():
    """Within the block (and in this process only), ranks' results are read as plain data."""
    global _trusting
    before, _trusting = _trusting, False
    try:
        yield
    finally:
        _trusting = before


def distrust_from_now() -> None:
    """For a process that reads only from ranks it does not trust, from now on."""
    global _trusting
    _trusting = False


class NotPlainData(ValueError):
    """A value from an untrusted rank holds something other than plain data."""


def dumps(value) -> bytes:
    """On the rank: ``value`` in ``torch.save``'s format (CUDA tensors moved to the CPU)."""
    import torch  # noqa: PLC0415

    def to_cpu(v):
        if isinstance(v, torch.Tensor) and v.device.type not in ("cpu", "meta"):
            return v.detach().cpu()
        if type(v).__module__.split(".")[0] == "numpy":  # NumPy's numbers and arrays, as
            import numpy as np  # noqa: PLC0415 - torch's: np.linalg.lstsq's fit is a fit

            if isinstance(v, np.generic):
                return v.item()
            if isinstance(v, np.ndarray):
                return torch.as_tensor(v) if v.dtype.kind in "biuf" else _map(v.tolist(), to_cpu)
        return v

    buf = io.BytesIO()
    torch.save(_map(value, to_cpu), buf)
    return buf.getvalue()


def _map(value, fn):
    if type(value) in (list, tuple):
        return type(value)(_map(v, fn) for v in value)
    if type(value) is dict:
        return {k: _map(v, fn) for k, v in value.items()}
    return fn(value)


_allowed: list[type] = []


def allow(cls: type) -> type:
    """Let plain data hold ``cls``: a record class (no method of its runs on load), or an
    exception type rebuilt from its name and text. Usable as a class decorator."""
    if cls not in _allowed:
        _allowed.append(cls)
    return cls


def _records() -> list:
    """The classes a rank's value may hold besides plain data."""
    from .timeline import Span, Timeline  # noqa: PLC0415

    return [Timeline, Span, *(c for c in _allowed if not issubclass(c, BaseException))]


def loads(data: bytes):
    """In the caller: a value written by :func:`dumps`, read with the weights-only loader."""
    import torch  # noqa: PLC0415

    torch.serialization.add_safe_globals(_records())
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"an object of {found.group(1)}" if found else "something that is not plain data"
        raise NotPlainData(
            f"the value holds {what}: return plain data (tensors, numbers, strings, lists, "
            "tuples, dicts)"
        ) from None


class _NoClasses(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"a message from a rank named a class ({module}.{name})")


def message(data: bytes):
    """A rank's message read with no class allowed: tuples, lists, str, bytes, numbers."""
    return _NoClasses(io.BytesIO(data)).load()


def _exception_types() -> dict[str, type]:
    found = {
        name: obj
        for name, obj in vars(builtins).items()
        if isinstance(obj, type) and issubclass(obj, Exception)
    }
    found.update({c.__name__: c for c in _allowed if issubclass(c, Exception)})
    return found


def rebuild_exception(type_name: str, text: str) -> BaseException | None:
    """``type_name(text)`` for a built-in or kit exception type; None for any other type
    (or one that cannot be made from a text alone)."""
    cls = _exception_types().get(type_name) if isinstance(type_name, str) else None
    if cls is None or not isinstance(text, str):
        return None
    try:
        exc = cls(text)
    except Exception:  # noqa: BLE001 - a type that wants other arguments
        return None
    return exc if str(exc) == text else None
