"""The check decides what ran from what left the rank: a rank's watch sends each sighting
out the moment it sees it (on the rank's channel, ``launcher.heard``), and the check judges
copies of the kit's answers itself. Whatever the rank's code does afterwards to its own report (the
builtins its end uses, the lists it returns), or to the watch (its frame, its generator,
its pipe), it cannot take back what was sent; what cuts the watch off ends the process."""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import textwrap
from pathlib import Path

import pytest

import overlapkit as ok

from .conftest import failed_with as _failed_with

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")


def _source_of(module, name: str) -> str:
    """A function's text in the kit's file (read when this module is imported: on a
    check's rank too, where the kit's answers are disarmed and inspect finds no source)."""
    text = Path(module.__file__).read_text()
    tree = ast.parse(text)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(text, node)


# the kit's answer pasted into the notebook (compiled anew there, under its own name), and
# the same with its name changed: the one a learner copies from the kit's source
_NAMESPACE = {**vars(ok.costmodel.alphabeta), "__name__": "__main__"}
_FIT = _source_of(ok.costmodel.alphabeta, "fit_alpha_beta")
exec(compile(_FIT, "<cell>", "exec"), _NAMESPACE)
pasted = _NAMESPACE["fit_alpha_beta"]
exec(compile(_FIT.replace("def fit_alpha_beta", "def fab"), "<cell>", "exec"), _NAMESPACE)
renamed = _NAMESPACE["fab"]


def _blind_the_report():
    """What the rank reports at its end is built with ``list``: make it return nothing."""
    import builtins

    real = builtins.list

    def blind(*args):
        items = args[0] if args else None
        if isinstance(items, real) and items and isinstance(items[0], str):
            return []
        return real(*args)

    builtins.list = blind


def pasted_then_the_report_blinded(sizes, times):
    out = pasted(sizes, times)
    _blind_the_report()
    return out


def renamed_then_the_report_blinded(sizes, times):
    out = renamed(sizes, times)
    _blind_the_report()
    return out


@pytest.mark.parametrize("fn", [pasted_then_the_report_blinded, renamed_then_the_report_blinded])
def test_a_copy_run_then_the_ranks_report_blinded_still_fails(fn):
    # (a blinded report would pass both without the sightings pipe)
    _failed_with(ok.grading.check_fit_alpha_beta(fn), "ran ok.costmodel.fit_alpha_beta")


def _state():
    import sys

    return sys.getprofile().__self__[0]


def reads_the_watchs_frame(sizes, times):
    _state().gi_frame.f_locals["seen"].clear()
    return pasted(sizes, times)


def closes_the_watch(sizes, times):
    _state().close()
    return pasted(sizes, times)


def throws_into_the_watch(sizes, times):
    try:
        _state().throw(KeyError("stop"))
    except KeyError:
        pass
    return pasted(sizes, times)


def sends_the_watch_a_fake_frame(sizes, times):
    """A frame whose f_code would run the learner's code inside the watch."""
    import sys

    class Frame:
        @property
        def f_code(self):
            return None

    sys.getprofile()(Frame(), "call", None)
    return pasted(sizes, times)


def replaces_the_watchs_pipe(sizes, times):
    from overlapkit import rankhook

    fd = rankhook.channel().fileno()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    return pasted(sizes, times)


def closes_the_watchs_pipe(sizes, times):
    from overlapkit import rankhook

    os.close(rankhook.channel().fileno())
    return pasted(sizes, times)


def writes_junk_into_the_watchs_pipe(sizes, times):
    from overlapkit import rankhook

    os.write(rankhook.channel().fileno(), b"\x00\x00\x00\x05\x09\x00\x00\x00\x00")
    return pasted(sizes, times)


@pytest.mark.parametrize(
    "fn, words",
    [
        (reads_the_watchs_frame, "the check's watch is not yours to read"),
        (closes_the_watch, "cut off the check's watch"),
        (throws_into_the_watch, "cut off the check's watch"),
        (sends_the_watch_a_fake_frame, "cut off the check's watch"),
        (replaces_the_watchs_pipe, "cut off the check's watch"),
        (closes_the_watchs_pipe, "cut off the check's watch"),
        (writes_junk_into_the_watchs_pipe, "changed the profiler the check watches"),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_the_watch_cannot_be_read_quieted_or_cut_off_unseen(fn, words):
    _failed_with(ok.grading.check_fit_alpha_beta(fn), words)


def reads_the_kits_source(sizes, times):
    source = inspect.getsource(ok.costmodel.fit_alpha_beta)  # through linecache
    namespace = {**vars(ok.costmodel.alphabeta)}
    exec(compile(source.replace("fit_alpha_beta", "fab"), "<mine>", "exec"), namespace)
    return namespace["fab"](sizes, times)


def opens_the_kits_file_through_a_link(sizes, times):
    import tempfile

    link = os.path.join(tempfile.mkdtemp(), "mine.py")
    os.symlink(ok.costmodel.alphabeta.__file__, link)
    with open(link) as f:
        return f.read()


@pytest.mark.parametrize(
    "fn, words",
    [
        (reads_the_kits_source, "OSError"),  # no source: linecache was refused it
        (opens_the_kits_file_through_a_link, "opened the kit's own file costmodel/alphabeta.py"),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_the_kits_source_is_not_to_be_had_while_a_check_runs(fn, words):
    _failed_with(ok.grading.check_fit_alpha_beta(fn), words)


# a multi-rank check: the kit's all-gather pasted (its helpers, which stay disarmed, put
# by the learner's own), run on the ranks, the ranks' reports blinded there


def _my_ring(group):
    me, world = ok.rank(), ok.world_size()
    return me, world, (me - 1) % world, (me + 1) % world


def _my_spans(timeline):
    return lambda name, lane: contextlib.nullcontext()


_RING = {**vars(ok.collectives), "__name__": "__main__", "_ring": _my_ring, "_spans": _my_spans}
exec(compile(_source_of(ok.collectives, "_ring_all_gather_flat"), "<cell>", "exec"), _RING)


def pasted_all_gather_then_the_report_blinded(tensor):
    flat = tensor.view(-1)
    bounds = ok.collectives.chunk_bounds(flat.numel(), ok.world_size())
    _RING["_ring_all_gather_flat"](flat, bounds, None)
    _blind_the_report()


def test_a_pasted_all_gather_on_ranks_is_judged_from_what_the_ranks_sent_out():
    report = ok.grading.check_all_reduce(
        pasted_all_gather_then_the_report_blinded, pattern="ring", world_sizes=(2,)
    )
    _failed_with(report, "ran ok.collectives._ring_all_gather_flat")


# --------------------------------------------------------------------------- (A) the kit's
# code renamed "<…>", which a watch that goes by names would let go; (B) a copy run on a
# thread started from C (ctypes' pthread_create), which no profiler reaches


# As a notebook's: defined in __main__, so that the check ships them by value, with what
# they hold (the kit's code objects taken here, before the check; imported by name on the
# rank they would be taken there, from the disarmed answers). Their copies' builtins are the
# module: the global __builtins__ is its dict, which would ship by value, and torch < 2.9
# (pybind11 before 3) keeps an object that cannot pickle in it
_ATTACKS = {"__name__": "__main__", "ok": ok, "inspect": inspect}
_ATTACKS_SOURCE = """
def _renamed(code):
    consts = tuple(_renamed(c) if isinstance(c, type(code)) else c for c in code.co_consts)
    return code.replace(co_name="<" + code.co_name + ">", co_consts=consts)

_FIT_CODE = ok.costmodel.fit_alpha_beta.__code__
_FIT_AS_LAMBDA = _FIT_CODE.replace(co_name="<lambda>")
_COLLECTIVES = {
    name: (_renamed(f.__code__), f.__defaults__)
    for name, f in vars(ok.collectives).items()
    if inspect.isfunction(f)
    and f.__module__ == "overlapkit.collectives"
    and not f.__code__.co_freevars
}

def fit_renamed_as_a_lambda(sizes, times):
    import builtins
    import types
    import numpy as np
    fit = types.FunctionType(_FIT_AS_LAMBDA, {"np": np, "__builtins__": builtins})
    return fit(sizes, times)

def _kit_namespace():
    import types
    namespace = dict(vars(ok.collectives))
    for name, (code, defaults) in _COLLECTIVES.items():
        namespace[name] = types.FunctionType(code, namespace, name, defaults)
    return namespace

def ring_from_the_kit_renamed(tensor):
    namespace = _kit_namespace()
    flat = tensor.view(-1)
    bounds = namespace["chunk_bounds"](flat.numel(), ok.world_size())
    namespace["_ring_reduce_scatter_flat"](flat, bounds, "sum", None)
    namespace["_ring_all_gather_flat"](flat, bounds, None)

def _on_a_c_thread(work):
    import ctypes
    out = []
    kind = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
    callback = kind(lambda _: out.append(work()) or 0)
    libc, thread = ctypes.CDLL(None), ctypes.c_ulong()
    libc.pthread_create(ctypes.byref(thread), None, callback, None)
    libc.pthread_join(thread, None)
    return out[0]

def fit_copy_on_a_c_thread(sizes, times):
    import builtins
    import types
    import numpy as np
    fit = types.FunctionType(_FIT_CODE, {"np": np, "__builtins__": builtins})
    return _on_a_c_thread(lambda: fit(sizes, times))

def fit_copy_handed_over_unrun(sizes, times):
    # only holds the copy (to run it where nothing watches); computes nothing
    import builtins
    import types
    import numpy as np
    types.FunctionType(_FIT_CODE, {"np": np, "__builtins__": builtins})
    return (1e-5, 1e-9)

def ring_from_the_kit_on_a_c_thread(tensor):
    namespace = _kit_namespace()
    flat = tensor.view(-1)
    bounds = namespace["chunk_bounds"](flat.numel(), ok.world_size())

    def work():
        namespace["_ring_reduce_scatter_flat"](flat, bounds, "sum", None)
        namespace["_ring_all_gather_flat"](flat, bounds, None)

    _on_a_c_thread(work)
"""
exec(compile(_ATTACKS_SOURCE, "<notebook>", "exec"), _ATTACKS)
fit_renamed_as_a_lambda = _ATTACKS["fit_renamed_as_a_lambda"]
fit_copy_on_a_c_thread = _ATTACKS["fit_copy_on_a_c_thread"]
fit_copy_handed_over_unrun = _ATTACKS["fit_copy_handed_over_unrun"]
ring_from_the_kit_renamed = _ATTACKS["ring_from_the_kit_renamed"]
ring_from_the_kit_on_a_c_thread = _ATTACKS["ring_from_the_kit_on_a_c_thread"]


@pytest.mark.parametrize(
    "fn, words",
    [
        (fit_renamed_as_a_lambda, "ran ok.costmodel.fit_alpha_beta"),
        (fit_copy_on_a_c_thread, "called C code through ctypes"),
        (fit_copy_handed_over_unrun, "ran ok.costmodel.fit_alpha_beta"),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_the_kits_answer_renamed_or_on_a_c_thread_is_still_its_answer(fn, words):
    _failed_with(ok.grading.check_fit_alpha_beta(fn), words)


def test_the_kits_ring_renamed_on_ranks_is_still_its_answer():
    report = ok.grading.check_all_reduce(
        ring_from_the_kit_renamed, pattern="ring", world_sizes=(2,)
    )
    _failed_with(report, "ran ok.collectives.")


def test_the_kits_ring_on_a_c_thread_on_ranks_fails():
    report = ok.grading.check_all_reduce(ring_from_the_kit_on_a_c_thread, pattern="ring",
                                         world_sizes=(2,))  # fmt: skip
    assert not report.all_passed, report.cases


# --------------------------------------------------------------------------- a copy
# compiled from text only on a thread no profiler watches (a raw thread started with the
# original _thread.start_new_thread, read out of the check's wrapper; torch's inter-op
# pool), and a copy padded past the size the judge compares


_UNWATCHED = {"__name__": "__main__", "ok": ok}
_UNWATCHED_SOURCE = """
FIT = _FIT_SOURCE
PIPELINE = _PIPELINE_SOURCE
FORK = '''
import torch
@torch.jit.ignore
def py(x: torch.Tensor) -> torch.Tensor:
    BOX[0]()
    return x
def inner(x: torch.Tensor) -> torch.Tensor:
    return py(x)
def outer(x: torch.Tensor) -> torch.Tensor:
    return torch.jit.wait(torch.jit.fork(inner, x))
'''

def fit_compiled_on_a_raw_thread(sizes, times):
    import _thread, time
    start = _thread.start_new_thread
    while getattr(start, "__closure__", None):
        start = [c.cell_contents for c in start.__closure__ if callable(c.cell_contents)][0]
    box = []
    def body():
        ns = {"np": __import__("numpy"), "Sequence": __import__("typing").Sequence}
        exec(compile(FIT, "<x>", "exec"), ns)
        box.append(ns["fit_alpha_beta"](sizes, times))
    start(body, ())
    for _ in range(3000):
        if box:
            break
        time.sleep(0.01)
    return box[0]

def schedule_compiled_on_torchs_interop_pool(stages, micro_batches):
    import linecache, sys, types, warnings, torch
    warnings.simplefilter("ignore")
    def body():
        mod = types.ModuleType("overlapkit._p3")
        mod.__package__ = "overlapkit"
        sys.modules[mod.__name__] = mod
        exec(compile(PIPELINE, "<p3>", "exec"), mod.__dict__)
        return [[str(a) for a in s] for s in mod.make_schedule("1f1b", stages, micro_batches)]
    ns = {"BOX": [None], "__name__": "forkmod"}
    linecache.cache["<fork>"] = (len(FORK), None, FORK.splitlines(True), "<fork>")
    exec(compile(FORK, "<fork>", "exec"), ns)
    got = []
    ns["BOX"][0] = lambda: got.append(body())
    torch.jit.script(ns["outer"])(torch.zeros(1))
    return got[0]
"""
_UNWATCHED.update(
    _FIT_SOURCE=_source_of(ok.costmodel.alphabeta, "fit_alpha_beta"),
    _PIPELINE_SOURCE=Path(ok.pipeline.__file__).read_text(),
)
exec(compile(_UNWATCHED_SOURCE, "<notebook>", "exec", dont_inherit=True), _UNWATCHED)
fit_compiled_on_a_raw_thread = _UNWATCHED["fit_compiled_on_a_raw_thread"]
schedule_compiled_on_torchs_interop_pool = _UNWATCHED["schedule_compiled_on_torchs_interop_pool"]

# make_schedule pasted with its globals aliased and 200 unused lines: past 1.6× its size
_PADDED = {"__name__": "__main__", "S": ok.pipeline.SCHEDULES, "E": ValueError, "R": range,
           "M": min, "A": ok.pipeline.Action, "PAD": False}  # fmt: skip
exec(
    compile(
        "def one_f_one_b(stages, micro_batches, name='1f1b', extra_warmup=0):\n"
        "    if PAD:\n"
        + "".join(f"        z = {i}\n" for i in range(200))
        + textwrap.indent(
            textwrap.dedent(
                """
                if name not in S:
                    raise E(f"unknown schedule {name!r}: choose one of {', '.join(S)}")
                if extra_warmup < 0:
                    raise E(f"extra_warmup must be ≥ 0, got {extra_warmup}")
                if stages < 1 or micro_batches < 1:
                    raise E(f"stages and micro_batches ≥ 1, got {stages}, {micro_batches}")
                m = 1 if name == "sequential" else micro_batches
                out = []
                for s in R(stages):
                    if name in ("sequential", "gpipe"):
                        out.append([A("F", k) for k in R(m)] + [A("B", k) for k in R(m)])
                        continue
                    warmup = M(stages - s - 1 + (extra_warmup if s < stages - 1 else 0), m)
                    acts = [A("F", k) for k in R(warmup)]
                    for k in R(m - warmup):
                        acts += [A("F", warmup + k), A("B", k)]
                    acts += [A("B", k) for k in R(m - warmup, m)]
                    out.append([str(a) for a in acts])
                return out
                """
            ),
            "    ",
        ),
        "<notebook>",
        "exec",
    ),
    _PADDED,
)
padded_schedule = _PADDED["one_f_one_b"]


def test_a_copy_compiled_on_a_raw_thread_is_judged_from_its_text():
    _failed_with(
        ok.grading.check_fit_alpha_beta(fit_compiled_on_a_raw_thread),
        "ran ok.costmodel.fit_alpha_beta",
    )


@pytest.mark.parametrize("fn", [schedule_compiled_on_torchs_interop_pool, padded_schedule],
                         ids=["on torch's inter-op pool", "padded past its size"])  # fmt: skip
def test_the_kits_schedule_compiled_elsewhere_or_padded_is_still_its_answer(fn):
    _failed_with(ok.grading.check_1f1b_schedule(fn), "ran ok.pipeline.make_schedule")


# --------------------------------------------------------- after the check's call
# Code of the learner's that runs after the check's call of it ended (the watch closed,
# the answers armed again) but before the rank's value left: a fake unwaited handle that
# the rank's end waits for, a finaliser. Unseen, it gives lab 00 2/2, lab 08 3/3 and
# lab 03 4/4 in the grader.
_LATE = {"__name__": "__main__", "ok": ok}
exec(
    compile(
        textwrap.dedent("""
        def fit_filled_by_a_handle_waited_at_the_end(sizes, times):
            from overlapkit import handles
            out = []

            class Later:
                what, site = "an op", "here"

                def _wait(self, deadline):
                    import overlapkit.costmodel as cm
                    out[:] = list(cm.fit_alpha_beta(sizes, times))

            h = Later()
            handles._unwaited[id(h)] = h
            return out

        def ring_whose_result_a_finaliser_hands_to_the_end(tensor):
            from overlapkit import handles

            class Later:
                what, site = "an op", "here"

                def _wait(self, deadline):
                    ok.ring_all_reduce(tensor)

            class Bomb:
                def __del__(self):
                    h = Later()
                    handles._unwaited[id(h)] = h

            return Bomb()  # not a tensor: the check drops it after the call

        def fit_with_the_watch_off_at_the_end(sizes, times):
            import functools, sys
            from overlapkit import handles
            out = []

            class Later:
                what, site = "an op", "here"

                def _wait(self, deadline):
                    import overlapkit.costmodel as cm
                    functools.partial(sys.setprofile, None)()  # no event the watch sees
                    out[:] = list(cm.fit_alpha_beta(sizes, times))

            h = Later()
            handles._unwaited[id(h)] = h
            return out

        def fit_filled_from_c_alone_at_the_end(sizes, times):
            import functools, types
            from overlapkit import handles
            import overlapkit.costmodel as cm

            out = []
            # no code of the learner's runs at the end: C alone starts the answer
            consume = functools.partial(dict.fromkeys, map(out.extend, map(
                cm.fit_alpha_beta, [sizes], [times])))
            h = types.SimpleNamespace(what="an op", site="here", _wait=consume)
            handles._unwaited[id(h)] = h
            return out
        """),
        "<cell>",
        "exec",
        dont_inherit=True,
    ),
    _LATE,
)


def test_the_watch_cannot_be_switched_off_after_the_call():
    """On a check's rank the watch stays the profiler until the rank's value has left."""
    _failed_with(
        ok.grading.check_fit_alpha_beta(_LATE["fit_with_the_watch_off_at_the_end"]),
        "sys.setprofile after your function had returned",
    )


@pytest.mark.parametrize(
    "check, fn",
    [
        (ok.grading.check_fit_alpha_beta, _LATE["fit_filled_by_a_handle_waited_at_the_end"]),
        (ok.grading.check_fit_alpha_beta, _LATE["fit_filled_from_c_alone_at_the_end"]),
        (
            lambda fn: ok.grading.check_all_reduce(fn, pattern="ring", world_sizes=(2,)),
            _LATE["ring_whose_result_a_finaliser_hands_to_the_end"],
        ),
    ],
    ids=["handle_waited_at_the_end", "c_alone_at_the_end", "finaliser_hands_a_handle_to_the_end"],
)
def test_code_of_the_learners_that_runs_after_the_call_fails_the_check(check, fn):
    """The answer started after the call (from a handle the rank's end waits for, which a
    finaliser may have registered, or from C alone) is named as the answer that ran."""
    _failed_with(check(fn), "the kit's own answer")


# --------------------------------------------------------- rings built of lab 11's matmuls
# ReduceScatter and AllGather as lab 11's decomposed matmuls with a 1x1 weight of ones:
# ring-shaped messages, all of them the kit's (its neighbour helper swapped for one's own).
_TP = {"__name__": "__main__", "ok": ok}
exec(
    compile(
        textwrap.dedent("""
        import torch

        def _neighbours(group=None):
            me, world = ok.rank(), ok.world_size()
            return me, world, (me - 1) % world, (me + 1) % world

        def reduce_scatter_by_the_tp_ring(output, input, op="sum"):
            from overlapkit import tensor_parallel as tp
            tp._ring = _neighbours
            output.copy_(tp.matmul_reduce_scatter(input.view(-1, 1), torch.ones(1, 1),
                                                  check=False).view(-1))

        def all_gather_by_the_tp_ring(output, input):
            from overlapkit import tensor_parallel as tp
            tp._ring = _neighbours
            output.copy_(tp.all_gather_matmul(input.view(-1, 1), torch.ones(1, 1),
                                              check=False).view(-1))
        """),
        "<cell>",
        "exec",
        dont_inherit=True,
    ),
    _TP,
)


@pytest.mark.parametrize(
    "check, fn",
    [
        (ok.grading.check_reduce_scatter, _TP["reduce_scatter_by_the_tp_ring"]),
        (ok.grading.check_all_gather, _TP["all_gather_by_the_tp_ring"]),
    ],
    ids=["reduce_scatter", "all_gather"],
)
def test_a_collective_from_the_kits_tensor_parallel_rings_is_the_kits_answer(check, fn):
    _failed_with(check(fn), "ok.tensor_parallel.")
