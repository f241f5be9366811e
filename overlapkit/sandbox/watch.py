"""The watch itself: while a learner's function runs (:func:`running`), a profile function
notes each start of an answer's code, in the calling thread, in threads started meanwhile
(``_thread``'s too) and in the kit's communication workers; on a check's rank it sends each
sighting out at once (``sightings``) with every code object that may be a copy. Its state
lives in a generator (:func:`_judge`) whose frame is refused to everyone (:func:`hide`),
fed one event at a time by a bound method of an immutable tuple (:func:`_entry`); all it
runs with is bound when the watch is made, before the learner's code runs."""

from __future__ import annotations

import _thread
import contextlib
import itertools
import marshal
import os
import sys
import threading
import types

from .. import plaindata, warmup
from .codes import code_objects
from .copies import COPIED, COPY_MIN_TOKENS, TELLING_BYTES, _prefilter
from .disarm import _disarmed, _open
from .forwarded import watching
from .origins import _INSTALLED, _TORCH, _TORCH_DISTRIBUTED, _group_ops, _trusted, library
from .sightings import CODE, NOTE, START, _numbers, _remember, _sightings_pipe, _writer
from .told import GROUP, TAMPERED


@contextlib.contextmanager
def _raw_threads_watched(watch):
    """Threads started with ``_thread.start_new_thread`` (which ``threading.setprofile``
    does not reach) start under ``watch`` too while the block runs: a copy of an answer
    recompiled from the kit's source and run on one was seen by nothing."""

    def watched(original):
        def start_new_thread(function, args, kwargs=None):
            def run(*a, **k):  # (a threading.Thread then sets threading.setprofile's
                # watch again, if it is still there: threading._profile_hook = None is no door)
                sys.setprofile(watch)
                return function(*a, **k)

            return original(run, args, kwargs or {})

        return start_new_thread

    places = [(m, n) for m, n in ((_thread, "start_new_thread"), (_thread, "start_new"),
                                  (threading, "_start_new_thread")) if hasattr(m, n)]  # fmt: skip
    saved = [(m, n, getattr(m, n)) for m, n in places]
    for m, n, original in saved:
        setattr(m, n, watched(original))
    try:
        yield
    finally:
        for m, n, original in saved:
            setattr(m, n, original)


@contextlib.contextmanager
def running(names):
    """Watch the answers ``names`` while the block runs; yields the list of the answers'
    names, one entry per time their code started (see the module docstring for where),
    and what else the watch saw (:func:`said` words it)."""
    ran: list[str] = []
    if not names:
        yield ran
        return
    if plaindata.trusting():  # the learner's code may run here (in a judge it runs on
        warmup.warm_torch()  # ranks): torch's start-up before the watch, once per process
    before, before_threads = sys.getprofile(), threading.getprofile()
    counter = itertools.count()
    codes = code_objects(names)
    if _sightings_pipe() is None:  # the judging side: the answers' code as it is now, whole
        _remember(tuple(names), codes)
    watch = _watch(codes, ran, before, counter)
    _open.append(ran)
    sys.setprofile(watch)
    threading.setprofile(watch)
    try:
        # a sealed student function called meanwhile is watched on its own rank the same way
        with (_disarmed(names, codes), _raw_threads_watched(watch),
              watching(("answers", tuple(names)), ran)):  # fmt: skip
            yield ran
    finally:
        _open.remove(ran)
        # notes taken out of ``ran`` (or a list put in its place) leave the count higher
        if sys.getprofile() is not watch or next(counter) > len(ran):
            ran.append(TAMPERED)
        if _sightings_pipe() is None:
            sys.setprofile(before)
            threading.setprofile(before_threads)
        # else a check's rank: the watch stays on until the rank's value has left it (see
        # _judge: code of the learner's that runs after its call is noted)


#: the check's functions that run the kit's answer on a rank between two watched calls of
#: the learner's (:func:`between_blocks`)
_BETWEEN_BLOCKS: set = set()


def between_blocks(fn):
    """Mark ``fn`` (a check's, run on a rank) as calling the kit's answers between two
    ``running`` blocks: lab 00 times the kit's ping-pong between the learner's. Elsewhere
    an answer that starts after a block has closed fails the check."""
    _BETWEEN_BLOCKS.add(fn.__code__)
    return fn


def _watch(codes: dict, ran: list, before, counter):
    """A profile function that notes each start of a watched code object (its answer's
    name), a call of sys.setprofile or threading.setprofile from the learner's code
    (:data:`TAMPERED`), and a process-group operation the learner's code calls itself
    (:data:`GROUP`); every event goes on to the profiler that was there before (another
    watch, a learner's profiler). ``counter`` (an ``itertools.count`` that cannot be wound
    back) counts every note, so that notes taken out of ``ran`` afterwards show.

    On a launched rank (a check's) each note also leaves the process at once, on the
    rank's sightings pipe, with every code object that may be an edited or recompiled
    copy of an answer: the check judges those itself, from what left the rank
    (:func:`seen_by_watches`), not from what the rank's code reports at its end.

    Nothing of its state is within the learner's reach (a closure's cells are readable
    and writable, so none holds it): the profile function is a bound method of an
    immutable tuple, and the state lives in a generator's frame, which no attribute
    hands out while the learner's call runs (``gi_frame`` is refused, :func:`hide`).
    Everything it runs with was bound before the learner's code ran: the module's names
    (``answers._copy_of``, ``builtins.len``) may be rebound meanwhile, not these. A
    generator interfered with (closed, thrown into, sent what is not an event) ends the
    process (:data:`CUT`)."""
    from .. import rankhook  # noqa: PLC0415

    labels_by_id = {id(code): label for code, label in codes.items()}
    sizes, shapes = _prefilter(codes)
    pipe = _sightings_pipe()
    send = _writer(pipe, next(_numbers)) if pipe is not None else None
    # what tells the watch where the rank is once its block has closed: the block's own
    # frame (``running``'s, resumed to close it), another block's, the rank's entry point
    # (whose own calls after the check's function returned are the rank's tail) and the
    # flush that ends the tail just before the rank's value leaves
    between = frozenset(id(code) for code in _BETWEEN_BLOCKS)
    marks = (sys._getframe(1), running.__wrapped__.__code__, *rankhook.launcher_code(),
             between)  # fmt: skip
    state = _judge(
        labels_by_id, frozenset(labels_by_id), sizes, shapes, _trusted(), _group_ops(), ran,
        before, counter.__next__, send, library()[0],
        (sys.setprofile, threading.setprofile.__code__, len, id, set, frozenset, type,
         types.FrameType, str, marshal.dumps, TAMPERED, GROUP.format, _SCANNED_TYPES,
         dict.values, dict.get, SCAN_LIMIT, ValueError),
        marks,
    )  # fmt: skip
    next(state)  # runs to its first yield: everything bound, the start sent
    hide(state)
    # on a check's rank a watch that stopped seeing ends the process; elsewhere (a
    # notebook's kernel, the judge) it must not, and a check there has no ranks to trust
    end = os._exit if pipe is not None else int
    return types.MethodType(_entry, (state, _thread.RLock(), end))


def _entry(bound, frame, event, arg):
    """The profile function (bound to ``(generator, lock, os._exit)``): one event at a time
    into the generator. Any failure there, or a generator that has ended, ends the process:
    a watch that stopped seeing would pass what it missed. (The lock is re-entrant: called
    by the learner's code, outside a profile event, the call's own events come back here
    on the same thread, and find the generator running: that ends the process, not a
    deadlock.)"""
    try:
        with bound[1]:
            bound[0].send((frame, event, arg))
    except:  # noqa: E722 - a bare except: no name the learner's code could rebind
        bound[2](87)  # CUT, written out: a global is the learner's to rebind


_entry.propagates = True  # the kit's communication workers run an op under its watch


#: the kinds of object a watch walks for code objects (exactly these types: a subclass
#: could run the learner's code inside the watch), and the most objects one walk visits
_SCANNED_TYPES = (types.FunctionType, types.CodeType, types.CellType, types.MethodType, dict,
                  list, tuple, set, frozenset, type)  # fmt: skip
SCAN_LIMIT = 20000


def _judge(labels_by_id, answer_ids, sizes, shapes, trusted, ops, ran, before, tick, out,
           libraries, tools, marks):  # fmt: skip
    """The watch's state and work (see :func:`_watch`): a generator sent one
    ``(frame, event, arg)`` per profile event.

    A code object that starts is sent out when it may be an answer's copy (its size, or
    its names and length, are an answer's). And where the check's or the kit's code calls
    the learner's (its function, a callback), everything that function can reach (its
    constants, globals, closure, defaults, arguments) is walked for code objects, which go
    out the same way: a copy that will run on a thread no profile function reaches (one
    started from C) was already seen where it was handed over.

    On a check's rank the watch outlives its block (``running`` leaves it on, and the
    call's guard refuses switching it off from then on): code of the learner's may still
    run once the block has closed (a finaliser, a handle whose ``_wait`` the rank's end
    calls, a kit function rebound), and the answers are armed again then: the kit's
    answer run from a fake unwaited handle would pass labs 00, 03 and 08 in the grader.
    So an answer that starts after the block is noted too,
    until the rank's value is on its way (the flush before the send), except where the
    check's own code calls it (a function marked :func:`between_blocks`: lab 00 times the
    kit's ping-pong between its blocks), an answer does, or a later block is open (its
    own watch judges it)."""
    (setprofile, threading_setprofile, len_, id_, set_, frozenset_, type_, frame_type, str_,
     dumps, tampered, group, kinds, dict_values, dict_get, limit, value_error) = tools  # fmt: skip
    between = marks[-1]
    closed = tail = done = False  # the block closed; the rank's tail began; it ended
    blocks: dict = {}  # id of another block's frame -> the times it started (open, close)
    later = 0  # later blocks open now
    keep = []  # what was looked at, alive: its id stays its own
    sends = out is not None  # (outside a check's rank the watch only notes)
    # the helpers' closures, made now (before the learner's code runs, which could rebind
    # the module's names and constants); the state that changes stays in this frame
    send = _sender(out)
    note = _noter(tick, ran.append, set_(), send, NOTE)
    look = _looker(set_(), keep, trusted, libraries, answer_ids, sends, send, dumps, id_,
                   _copy_filter(sizes, shapes, len_, frozenset_))  # fmt: skip
    walk = _walker(look, trusted, libraries, _TORCH + os.sep, limit, kinds,
                   (id_, set_, type_, dict_values, dict_get, value_error))  # fmt: skip
    where = _tracker(marks[:-1], blocks, keep, id_)
    trusts = _truster(trusted, _TORCH_DISTRIBUTED, id_)
    entered = _entered(walk, trusts, _TORCH + os.sep, kinds, (id_, type_, dict_values, dict_get))
    installed = _INSTALLED
    send(START, b"")
    while True:
        frame, event, arg = yield
        # what else the learner's code might send in (a frame-like object whose f_code,
        # a str whose __eq__, would run its code in here) ends the watch: see _entry
        if type_(frame) is not frame_type or type_(event) is not str_:
            raise TypeError("not a profile event")
        if event == "call":
            code = frame.f_code
            key = id_(code)
            if sends and not done:
                closed, tail, done, later = where(frame, code, closed, tail, later)
            if key in answer_ids:
                # after the block an answer is the check's own only where its code calls
                # it (between_blocks) or an answer does: not one a finaliser started, nor
                # one started from C alone (a partial over map(answer, …))
                back = frame.f_back
                caller = id_(back.f_code) if back is not None else None
                if not closed or (
                    not done and not later and caller not in between and caller not in answer_ids
                ):
                    note(labels_by_id[key])
            elif code is threading_setprofile and (
                frame.f_back is None or not trusts(frame.f_back.f_code)
            ):
                note(tampered)
            elif code.co_name == "<module>" and code.co_filename.startswith(installed):
                pass  # a library imported meanwhile: its functions run as it loads them
            elif look(code) and key not in trusted and key not in libraries and sends:
                entered(frame, code)
        elif event == "c_call" and not trusts(frame.f_code):
            if arg is setprofile:
                note(tampered)
            elif id_(arg) in ops:  # (a partial's call of one shows no event: lab 09 counts
                note(group(ops[id_(arg)]))  # the values the kit moved as well)
        if before is not None:
            before(frame, event, arg)


# The helpers of the watch's generator. Each is a factory that :func:`_judge` calls before
# its first event, so that the closure it returns holds everything it runs with (bound
# before the learner's code runs) and looks up no module name at event time.


def _tracker(marks, blocks, keep, id_):
    """``where(frame, code, closed, tail, later)``: where the rank is once a ``call`` event
    of ``code`` in ``frame`` has come, as the new ``(closed, tail, done, later)`` (see
    :func:`_judge`; the state stays in its frame). ``marks``: the block's own frame, the
    code of ``running``, of the rank's entry point and of the flush before its value
    leaves; ``blocks``: id of another block's frame -> the times it started."""
    block, running_code, main_code, flush_code = marks

    def where(frame, code, closed, tail, later):
        if frame is block:  # resumed to close: the learner's call is over
            closed = True
        elif code is running_code:  # another block: opens, then closes
            keep.append(frame)
            blocks[id_(frame)] = blocks.get(id_(frame), 0) + 1
            later += 1 if blocks[id_(frame)] == 1 else -1
        elif closed and frame.f_back is not None and frame.f_back.f_code is main_code:
            tail = True  # the rank's entry point calls on: its value goes next
        return closed, tail, tail and code is flush_code, later

    return where


def _truster(trusted, torch_distributed, id_):
    """``trusts(code)``: is ``code`` the kit's (its id in ``trusted``: by identity, a copy
    may claim the kit's file) or torch.distributed's (by where it lives: under
    ``torch_distributed``, whatever a torch release defines there)? Where a process-group
    operation or a profiler change is theirs, and where they call the learner's code."""

    def trusts(code):
        return id_(code) in trusted or code.co_filename.startswith(torch_distributed)

    return trusts


def _sender(out):
    """``send(kind, data)``: one message out of the rank (``out``), where there is one."""
    sends = out is not None

    def send(kind, data):
        if sends:
            out(kind, data)

    return send


def _noter(tick, append, sent, send, note_kind):
    """``note(what)``: counted (``tick``), listed (``append``), and sent out once each
    (``sent``: the check needs which, not how often)."""

    def note(what):
        tick()
        append(what)
        if what not in sent:
            sent.add(what)
            send(note_kind, what.encode())

    return note


def _copy_filter(sizes, shapes, len_, frozenset_):
    """``worth_sending(code)``: may ``code`` be a copy of an answer (whatever its name: the
    learner's to choose)? ``sizes`` and ``shapes``: :func:`~.copies._prefilter`'s."""
    telling = TELLING_BYTES
    min_copy = 2 * COPIED * COPY_MIN_TOKENS  # bytes of bytecode an edited copy needs

    def worth_sending(code):
        size = len_(code.co_code)
        if size < telling:
            return False
        if size in sizes:  # an answer's own bytecode is this long
            return True
        if size < min_copy:
            return False
        mine = frozenset_(code.co_names)
        for their_names, their_size in shapes:
            if 2 * len_(mine & their_names) >= len_(their_names):
                return True
            # (no upper bound: unused lines added take nothing from a copy, and one
            # padded past 1.6× the answer's size is still one)
            if 0.8 * their_size <= size:
                return True
        return False

    return worth_sending


def _looker(seen, keep, trusted, libraries, answer_ids, sends, send, dumps, id_, worth_sending):
    """``look(code)``: send ``code`` out (once) when it may be a copy; false when it was
    looked at before. ``seen``: the ids looked at, kept alive by ``keep``."""
    code_kind = CODE

    def look(code):
        key = id_(code)
        if key in seen:
            return False
        seen.add(key)
        keep.append(code)
        if key not in trusted and key not in libraries and key not in answer_ids and sends:
            if worth_sending(code):
                send(code_kind, dumps(code))  # the check judges it
        return True

    return look


def _walker(look, trusted, libraries, torch_files, limit, kinds, tools):
    """``walk(roots)``: every code object reachable from ``roots`` (at most ``limit``
    objects of the ``kinds`` :data:`_SCANNED_TYPES`), looked at (see :func:`_judge`)."""
    id_, set_, type_, dict_values, dict_get, value_error = tools
    function_t, code_t, cell_t, method_t, dict_t, list_t, tuple_t, set_t, frozen_t, type_t = kinds
    containers = (list_t, tuple_t, set_t, frozen_t)

    def walk(roots):
        todo, visited, count = list_t(roots), set_(), 0
        while todo and count < limit:
            obj = todo.pop()
            key = id_(obj)
            if key in visited:
                continue
            visited.add(key)
            count += 1
            kind = type_(obj)
            if kind is code_t:
                look(obj)
                todo.extend(obj.co_consts)
            elif kind is function_t:
                code = obj.__code__
                if id_(code) in trusted or id_(code) in libraries:  # nothing of the learner's
                    continue
                todo.append(code)
                if code.co_filename.startswith(torch_files):
                    continue  # looked at (a copy may claim torch's file), not walked into
                todo.append(obj.__defaults__)
                todo.append(obj.__kwdefaults__)
                todo.append(obj.__closure__)
                scope = obj.__globals__
                if type_(scope) is dict_t:
                    for inner in (code, *code.co_consts):
                        if type_(inner) is code_t:
                            todo.extend(dict_get(scope, name) for name in inner.co_names)
            elif kind is cell_t:
                try:
                    todo.append(obj.cell_contents)
                except value_error:  # an empty cell
                    pass
            elif kind is method_t:
                todo.append(obj.__func__)
            elif kind is dict_t:
                todo.extend(dict_values(obj))
            elif kind in containers:
                todo.extend(obj)
            elif kind is type_t:
                todo.extend(obj.__dict__.values())

    return walk


def _entered(walk, trusts, torch_files, kinds, tools):
    """``entered(frame, code)``: the learner's ``code`` starting in ``frame``; entered from
    the check's or the kit's code (not torch's own functions, called from the kit by the
    hundred), everything it can reach is walked."""
    id_, type_, dict_values, dict_get = tools
    code_t, dict_t = kinds[1], kinds[4]

    def entered(frame, code):
        back = frame.f_back
        if (back is not None and trusts(back.f_code)
                and not code.co_filename.startswith(torch_files)):  # fmt: skip
            scope = frame.f_globals
            roots = [code, *dict_values(frame.f_locals)]
            for inner in (code, *code.co_consts):
                if type_(inner) is code_t and type_(scope) is dict_t:
                    roots.extend(dict_get(scope, name) for name in inner.co_names)
            walk(roots)

    return entered


def _hider(hidden: set, keep: list, id_=id, frames=frozenset({"gi_frame", "cr_frame", "ag_frame"})):
    """An audit hook (PEP 578: never removed, never listed, so its state is out of reach)
    that refuses handing out the frame of an object hidden with :func:`hide`."""

    def hook(event, args):
        if event == "overlapkit.hide":
            keep.append(args[0])  # alive: its id stays its own
            hidden.add(id_(args[0]))
        elif event == "object.__getattr__" and args[1] in frames and id_(args[0]) in hidden:
            raise RuntimeError(
                "the check's watch is not yours to read: its frame is refused while a check "
                "runs (the watch judges your function; nothing in it helps the exercise)"
            )

    return hook


_hider_installed: list = []


def hide(obj) -> None:
    """From now on in this process, ``obj``'s frame (a generator's ``gi_frame``) is refused
    to everyone: the state a watch keeps there is out of reach."""
    if not _hider_installed:
        sys.addaudithook(_hider(set(), []))
        _hider_installed.append(True)
    sys.audit("overlapkit.hide", obj)
