"""The kit's code an answer's dotted name stands for: ``overlapkit.<dotted>`` resolved to a
module, class or function, then to every code object it defines (its functions, its
classes' methods, the functions nested in them), each with the name a learner is told."""

from __future__ import annotations

import importlib
import inspect
import types


def _resolve(dotted: str):
    """The object ``overlapkit.<dotted>``: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module("overlapkit." + ".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(f"overlapkit.{dotted}")


def _nested(code: types.CodeType):
    """``code`` and the code of every function, lambda and class body defined inside it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def _functions(obj):
    """The plain functions an object stands for (a class: its own methods of every kind)."""
    if isinstance(obj, types.ModuleType):
        for value in vars(obj).values():
            if isinstance(value, dict):  # a table of functions (costmodel.BUSBW_FACTOR)
                yield from (f for f in value.values() if inspect.isfunction(f)
                            and f.__module__ == obj.__name__)  # fmt: skip
            elif getattr(value, "__module__", None) == obj.__name__ and (
                inspect.isfunction(value) or inspect.isclass(value)
            ):
                yield from _functions(value)
    elif isinstance(obj, dict):
        yield from (_unwrapped(f) for f in obj.values() if inspect.isfunction(f))
    elif inspect.isclass(obj):
        for value in vars(obj).values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property):
                yield from (
                    f for f in (value.fget, value.fset, value.fdel) if inspect.isfunction(f)
                )
            elif inspect.isfunction(value):
                yield _unwrapped(value)
    elif inspect.isfunction(obj):
        # the original under a check's own recorder (functools.wraps): the recorder's code
        # is the same for every function it wraps, the learner's messages included
        yield _unwrapped(obj)


def _answer(obj):
    """The functions an answer stands for (:func:`_functions`); a package (the cost model)
    stands for what each of its modules defines too, its private helpers included."""
    yield from _functions(obj)
    if isinstance(obj, types.ModuleType) and hasattr(obj, "__path__"):
        inside = obj.__name__ + "."
        for value in list(vars(obj).values()):
            if isinstance(value, types.ModuleType) and value.__name__.startswith(inside):
                yield from _answer(value)


def _unwrapped(fn):
    original = inspect.unwrap(fn)
    return original if inspect.isfunction(original) else fn


def _table_entries(module) -> dict[int, str]:
    """id of each function a module holds in a dict -> its name there, ``TABLE['key']``."""
    if not isinstance(module, types.ModuleType):
        return {}
    found = {}
    for name, value in vars(module).items():
        if isinstance(value, dict):
            found.update(
                {id(f): f"{name}[{k!r}]" for k, f in value.items() if inspect.isfunction(f)}
            )
    return found


def code_objects(names) -> dict[types.CodeType, str]:
    """Each code object of the answers ``names`` (dotted under overlapkit), with the name
    a learner is told: ``ok.<dotted>``. A name that starts with "!" is allowed: its code
    is left out (a module's helper the lab tells the learner to use)."""
    codes = {}
    allowed = {
        code
        for dotted in names if dotted.startswith("!")
        for fn in _answer(_resolve(dotted[1:]))
        for code in _nested(fn.__code__)
    }  # fmt: skip
    for dotted in (n for n in names if not n.startswith("!")):
        obj = _resolve(dotted)
        tables = _table_entries(obj)
        for fn in _answer(obj):
            own = fn.__qualname__.split(".<locals>")[0]  # a table's lambda: TABLE['key']
            own = tables.get(id(fn), own) if own == "<lambda>" else own
            label = (
                f"ok.{dotted}" if not isinstance(obj, types.ModuleType) else f"ok.{dotted}.{own}"
            )
            for code in _nested(fn.__code__):
                if code not in allowed:
                    codes.setdefault(code, label)
    return codes


def _answer_functions(names, codes: dict) -> list[tuple[types.FunctionType, str]]:
    """The functions whose code answers ``names`` (``codes``: their :func:`code_objects`),
    each once."""
    found, seen = [], set()
    for dotted in (n for n in names if not n.startswith("!")):
        for fn in _answer(_resolve(dotted)):
            if id(fn) not in seen and fn.__code__ in codes:
                seen.add(id(fn))
                found.append((fn, codes[fn.__code__]))
    return found
