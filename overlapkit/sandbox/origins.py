"""Whose code a frame runs: the kit's, torch's, the installed libraries', or else the
learner's. A watch neither sends nor walks the libraries' code (it is nobody's copy), takes
a profiler change or a process-group operation from the kit's or torch.distributed's code
as theirs, and tells torch's process-group operations called by the learner's code by the
builtin function they run."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings

import torch

from .codes import _functions, _nested

_KIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # overlapkit/
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))

#: the operations of torch's process groups, by the builtin function a call runs
_GROUP_OPS = ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
              "allgather_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter",
              "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "reduce", "alltoall",
              "alltoall_base", "send", "recv", "recv_anysource", "gather", "scatter", "barrier",
              "monitored_barrier")  # fmt: skip


def _group_ops() -> dict[int, str]:
    """id of each process-group operation's builtin function -> its name: a call of one
    from the learner's code is seen whatever group it is on (one made outside torch's
    registry too, which no sequence number of the registry's groups counts)."""
    import torch._C._distributed_c10d as c10d  # noqa: PLC0415

    found = {}
    kinds = ("ProcessGroup", "Backend", "ProcessGroupGloo", "ProcessGroupNCCL", "ProcessGroupMPI")
    for cls in (getattr(c10d, n, None) for n in kinds):
        for name in _GROUP_OPS if cls is not None else ():
            fn = getattr(vars(cls).get(name), "__func__", vars(cls).get(name))
            if fn is not None:
                found[id(fn)] = f"{cls.__name__}.{name}"
    return found


_CTYPES_NAMES = frozenset({"memmove", "from_buffer", "addressof", "CDLL", "cdll", "PyDLL", "pydll",
                           "prctl", "fflush", "byref", "string_at", "c_void_p", "c_int", "c_uint",
                           "c_size_t", "c_char_p", "POINTER", "CFUNCTYPE"})  # fmt: skip
_library: list = []
#: where what is installed lives (Python's own modules, site-packages): a check's ranks
#: cannot write there (sandbox.nofiles)
_INSTALLED = tuple(
    {p + os.sep for base in (sys.prefix, sys.base_prefix) for p in (base, os.path.realpath(base))}
)


def library() -> tuple[frozenset[int], frozenset]:
    """(ids of the code objects of the libraries' functions as loaded — Python's own,
    torch's, numpy's: what is installed, not the kit —, those code objects of theirs and the
    kit's that call C through ctypes). Worked out once per process (the forkserver does it
    before it forks ranks: ``overlapkit._preload``), before any learner's code runs: by
    identity, so code compiled under a library's file name is not the library's. A watch
    neither sends nor walks the libraries' code (it is nobody's copy), and only the
    ctypes callers may call C while a learner's function runs (``sealed``)."""
    if not _library:
        roots = _INSTALLED
        ids, calls_c = set(), set()
        with warnings.catch_warnings():  # deprecated names say so when touched
            warnings.simplefilter("ignore")
            for name, module in list(sys.modules.items()):
                path = getattr(module, "__file__", None) or ""
                kit = name == "overlapkit" or name.startswith("overlapkit.")
                if getattr(module, "__name__", None) != name:
                    continue
                if not kit and not os.path.realpath(path).startswith(roots):
                    continue
                with contextlib.suppress(Exception):  # a module that cannot be looked into
                    for fn in _functions(module):
                        for code in _nested(fn.__code__):
                            if not kit:
                                ids.add(id(code))
                            if _CTYPES_NAMES & set(code.co_names):
                                calls_c.add(code)
        _library.append((frozenset(ids), frozenset(calls_c)))
    return _library[0]


#: where torch.distributed's own code lives (in torch's installed package, which a check's
#: ranks cannot write to: ``sandbox.nofiles``): a frame whose code comes from there is
#: torch's, whichever functions a torch release defines there and however they were made
_TORCH_DISTRIBUTED = os.path.join(_TORCH, "distributed") + os.sep
#: module name -> (the module, the ids of its code objects), for :func:`_trusted`: filled
#: in the forkserver (``overlapkit._preload``) for what it loaded, so that a rank's watch
#: only looks into the modules loaded since (ids only: no code object is handed out here)
_trusted_by_module: dict[str, tuple] = {}


def _trusted() -> frozenset[int]:
    """The ids of the code objects of the kit's own modules, as loaded (by identity: code
    compiled elsewhere under the kit's file names is not the kit's): with torch.distributed's
    code, told by where it lives (:data:`_TORCH_DISTRIBUTED`), the frames from which a
    process-group operation or a profiler change is theirs."""
    names = [m for m in list(sys.modules) if m == "overlapkit" or m.startswith("overlapkit.")]
    found = set()
    with warnings.catch_warnings():  # deprecated names say so when touched
        warnings.simplefilter("ignore")
        for name in names:
            module = sys.modules.get(name)
            path = getattr(module, "__file__", None) or ""
            if not path.startswith(_KIT) or module.__name__ != name:
                continue
            known = _trusted_by_module.get(name)
            if known is None or known[0] is not module:  # (a module loaded afresh: looked into)
                ids = frozenset(id(c) for fn in _functions(module) for c in _nested(fn.__code__))
                known = _trusted_by_module[name] = (module, ids)
            found.update(known[1])
    # a thread's own start sets threading.setprofile's profiler (under the watch that
    # _raw_threads_watched gave it first)
    found.add(id(threading.Thread._bootstrap_inner.__code__))
    return frozenset(found)
