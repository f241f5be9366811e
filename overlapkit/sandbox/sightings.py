"""What a rank's watch sends out of the process the moment it sees it (on the rank's
channel to the caller, ``overlapkit.rankhook.channel``), and how the check reads it: an
answer seen by identity goes as its name, a code object that may be a copy as its marshal,
code made during the call as its source, marshal or bytecode; the check judges those
itself (:func:`seen_by_watches`), never on the rank."""

from __future__ import annotations

import _thread
import itertools
import marshal
import os
import struct
import types

from .codes import _nested, code_objects
from .copies import TELLING_BYTES, _copy_of, _key, _shapes, _telling
from .told import CUT, TAMPERED

#: what a rank's watch sends on the rank's channel (``launcher.heard``): a watch's
#: start (before the learner's code runs), an answer seen by identity, or a code object
#: that may be an answer's copy, for the check to judge outside the rank
START, NOTE, CODE = 0, 1, 2
#: what the audit hook of a learner's call sends (:func:`code_made_meanwhile`), for every
#: watch of the rank: source text compiled, a code object run by exec or unmarshalled,
#: the bytecode of a code object made by hand (``types.CodeType``, ``code.replace``)
SOURCE, MADE, BYTECODE = 3, 4, 5
EVERY_WATCH = 0xFFFFFFFF
_numbers = itertools.count()


def _sightings_pipe():
    """(fd, identity) of this rank's channel, where its watches write their sightings;
    None outside a launched rank."""
    from .. import rankhook  # noqa: PLC0415

    conn = rankhook.channel()
    if conn is None:
        return None
    st = os.fstat(conn.fileno())
    return conn.fileno(), (st.st_dev, st.st_ino)


#: one message at a time on the channel, whichever thread or watch writes it (the guard's
#: audit hook writes from any thread, each watch under a lock of its own): a pipe takes a
#: write of more than a few KiB in pieces, two writers' pieces interleaved garble the
#: channel, and the caller stops reading a garbled one, so the next writer blocks for good
_ONE_AT_A_TIME = _thread.RLock()


def _writer(pipe, number: int):
    """``send(kind, data)``: one message on the sightings pipe ``pipe`` = (fd, identity),
    for the watch ``number``. Made, with all it calls bound, before the learner's code runs;
    it raises when the pipe is not the one it was given (closed, or another in its place)."""
    fd, identity = pipe
    fstat, write, pack, len_, memoryview_ = os.fstat, os.write, struct.pack, len, memoryview
    one_at_a_time = _ONE_AT_A_TIME

    def send(kind, data):
        st = fstat(fd)
        if (st.st_dev, st.st_ino) != identity:
            raise OSError("the sightings pipe was replaced")
        message = pack("!BI", kind, number) + data
        view = memoryview_(pack("!i", len_(message)) + message)
        with one_at_a_time:
            while len_(view):
                view = view[write(fd, view) :]

    return send


def code_made_meanwhile():
    """What the audit hook of a learner's call (``sealed._guard_the_call``) does with an
    event that makes code while the call runs, in any thread: ``made(event, args,
    caller_file)`` sends it out on the rank's sightings pipe for the check to judge (a
    copy of an answer compiled from text on a thread no profiler watches, a raw thread's
    or one torch started). Imports are let by (they load
    files; the guard refuses the kit's). Everything is bound now, before the learner's
    code runs; a pipe that cannot be written ends the process (:data:`CUT`)."""
    pipe = _sightings_pipe()
    if pipe is None:
        return lambda event, args, caller: None
    write, dumps, exit_, type_ = _writer(pipe, EVERY_WATCH), marshal.dumps, os._exit, type
    cut, source_kind, made_kind, bytecode_kind = CUT, SOURCE, MADE, BYTECODE
    str_, bytes_, code_t = str, bytes, types.CodeType
    importing = "<frozen importlib"

    def send(kind, data):
        try:
            write(kind, data)
        except BaseException:  # noqa: BLE001 - unseen is unjudged: end the process
            exit_(cut)

    def made(event, args, caller):
        if caller.startswith(importing):
            return
        if event == "compile":
            source = args[0]
            if type_(source) is str_:
                send(source_kind, source.encode("utf-8", "surrogatepass"))
            elif type_(source) is bytes_:
                send(source_kind, source)
            else:  # a syntax tree: compiled, it would be judged by nothing; refused
                raise RuntimeError(
                    "your function compiled a syntax tree: an exercise never needs to, and "
                    "the check could not see what it made"
                )
        elif event == "exec" and type_(args[0]) is code_t:
            send(made_kind, dumps(args[0]))
        elif event == "marshal.loads" and type_(args[0]) is bytes_:
            send(made_kind, args[0])
        elif event == "code.__new__" and type_(args[0]) is bytes_:
            send(bytecode_kind, args[0])

    return made


def seen_by_watches(messages: list[bytes], garbled: bool, requested: list) -> list[list[str]]:
    """What each of a rank's watches saw, judged here from what it sent out on the rank's
    channel (``launcher.heard``): ``requested``, the answers' names of each watch
    the check made on the rank, in the order it made them. An answer seen by identity is
    named by the rank; a code object sent out is named here when it is an answer's copy
    (compiled anew, or edited). A message that is not the watch's, or a pipe that carried
    anything else, makes every watch's list say :data:`TAMPERED`."""
    starts: list[int] = []
    notes: dict[int, list[str]] = {}
    codes: dict[int, list[bytes]] = {}
    made: list[tuple[int, bytes]] = []  # the call's audit hook's, for every watch
    broken = garbled
    for message in messages:
        try:
            kind, number = struct.unpack_from("!BI", message)
            data = message[5:]
            if kind == START:
                starts.append(number)
            elif kind == NOTE:
                notes.setdefault(number, []).append(data.decode())
            elif kind == CODE:
                codes.setdefault(number, []).append(data)
            elif kind in (SOURCE, MADE, BYTECODE) and number == EVERY_WATCH:
                made.append((kind, data))
            else:
                broken = True
        except (struct.error, UnicodeDecodeError):
            broken = True
    out = []
    for number, names in zip(starts, requested, strict=False):
        seen = list(notes.get(number, []))
        for blob in codes.get(number, []):
            try:
                label = _judged_copy(blob, tuple(names))
            except Exception:  # noqa: BLE001 - not a code object of the rank's: its code's
                label = TAMPERED
            if label is not None:
                seen.append(label)
        for kind, data in made:
            label = _judged_made(kind, data, tuple(names))
            if label is not None:
                seen.append(label)
        out.append(seen + [TAMPERED] * broken)
    out += [[TAMPERED] * broken for _ in requested[len(out) :]]
    return out


def _judged_made(kind: int, data: bytes, names: tuple) -> str | None:
    """The answer (of ``names``) that code made during the call copies, if any: source
    text compiled (here, never run), a code object's marshal, or bytecode made by hand."""
    if kind == BYTECODE:
        if names not in _judged:
            _remember(names, code_objects(names))
        for key, label in _judged[names][0].items():
            if key[0] == data:  # (_key's first field: the bytecode)
                return label
        return None
    try:
        if kind == SOURCE:
            code = compile(data, "<made during the call>", "exec", dont_inherit=True)
        else:
            code = marshal.loads(data)
    except Exception:  # noqa: BLE001 - text that is no program, data that is no code
        return None
    if not isinstance(code, types.CodeType):
        return None
    for inner in _nested(code):
        if len(inner.co_code) >= TELLING_BYTES:
            label = _judged_copy(marshal.dumps(inner), names)
            if label is not None:
                return f"{label}, made while your function ran"
    return None


_judged: dict = {}


def _remember(names: tuple, codes: dict) -> None:
    """What the answers ``names`` look like (``codes``: their code, not disarmed), for
    :func:`_judged_copy`: what a copy's key would be, and the long answers' shapes."""
    if names not in _judged:
        telling = {_key(code): label for code, label in codes.items() if _telling(code)}
        _judged[names] = (telling, _shapes(codes))


def _judged_copy(blob: bytes, names: tuple) -> str | None:
    """The answer (of ``names``) whose copy the marshalled code object ``blob`` is, or None.
    Worked out in the judging process, never on the rank."""
    key = (blob, names)
    if key not in _judged:
        if names not in _judged:  # (a check that watches here remembered them undisarmed)
            _remember(names, code_objects(names))
        telling, shapes = _judged[names]
        code = marshal.loads(blob)
        if not isinstance(code, types.CodeType):
            raise TypeError("not a code object")
        label = telling.get(_key(code))
        if label is None and len(code.co_code) >= TELLING_BYTES:  # whatever its name
            label = _copy_of(code, shapes, cache={})
        _judged[key] = label
    return _judged[key]
