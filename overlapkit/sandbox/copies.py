"""A copy of an answer, told from honest work: compiled anew from the kit's source (the
same key: :func:`_key`), or edited a little (unused lines added, names changed, a code
object renamed: most of the answer's instructions, in order, :func:`_copy_of`). The judging
side works with the instructions (:func:`_tokens`); a watch on a rank only picks the code
objects worth sending out, cheaply (:func:`_prefilter`)."""

from __future__ import annotations

import collections
import difflib
import dis
import types

from .origins import _KIT


def _key(code: types.CodeType) -> tuple:
    """What a code object does, not where it was compiled nor what it is called: the kit's
    source compiled again (blank lines in front, another file or module name), or its code
    renamed (``co_name="<lambda>"``), has the same key."""
    consts = tuple(_key(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return (code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
            consts)  # fmt: skip


#: the least bytecode a function needs for its copy to be recognised (bytes_moved_per_rank
#: has 50: the smallest answer)
TELLING_BYTES = 48


def _telling(code: types.CodeType) -> bool:
    """Whether an *answer's* code is recognised in a copy: a function's, long enough (the
    kit's comprehensions and lambdas may read like a learner's ``[p for p in ...]``). A
    code object that runs is judged whatever its name: a name is the learner's to choose."""
    return not code.co_name.startswith("<") and len(code.co_code) >= TELLING_BYTES


#: an answer's function is recognised in an edited copy only with at least this many
#: instructions: below, honest functions (the solutions', the tests' learners') hold up to
#: 95% of one (lab 07's greedy loop and ok.costmodel.ddp_buckets, 55); from 57 up, 67% at
#: most (measured over 1,076 functions, 165 answers)
COPY_MIN_TOKENS = 64
#: the share of such an answer's instructions, in order, that makes a function its copy;
#: unused lines added anywhere take nothing from it
COPIED = 0.85
#: instructions whose argument is kept: the names and constants a function uses (its own
#: variables' names and its jumps' targets are left out: a copy renames and moves those)
_NAMED = {"LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD", "LOAD_NAME", "IMPORT_NAME", "IMPORT_FROM",
          "STORE_ATTR", "LOAD_CONST", "KW_NAMES", "COMPARE_OP", "BINARY_OP"}  # fmt: skip
_tokens_of: dict[int, tuple] = {}


def _tokens(code: types.CodeType, cache: dict | None = None) -> tuple:
    """What a function does, as its instructions (see :data:`_NAMED`); kept in ``cache``
    (by default the module's: only where no learner's code runs, the judge's process)."""
    cache = _tokens_of if cache is None else cache
    entry = cache.get(id(code))
    if entry is None or entry[0] is not code:  # (the entry keeps its code's id its own)
        out = []
        for ins in dis.get_instructions(code):
            if ins.opname in ("RESUME", "NOP", "CACHE", "EXTENDED_ARG"):
                continue
            # a global's name is the learner's to choose (an alias of the kit's own, in
            # lab 14 say); what it does with it is not
            arg = ins.argval if ins.opname in _NAMED and ins.opname != "LOAD_GLOBAL" else None
            if not isinstance(arg, (str, int, float, bool, type(None))):
                arg = type(arg).__name__
            out.append((ins.opname, arg))
        entry = cache[id(code)] = (code, tuple(out), collections.Counter(out))
    return entry[1]


def _shapes(codes: dict) -> list:
    """The answers' functions an edited copy of which is recognised: the kit's own
    (not the methods dataclasses generate, alike in every dataclass), long enough."""
    found = []
    for code, label in codes.items():
        if code.co_filename.startswith(_KIT) and len(_tokens(code)) >= COPY_MIN_TOKENS:
            found.append((_tokens(code), _tokens_of[id(code)][2], frozenset(code.co_names),
                          label, len(code.co_code)))  # fmt: skip
    return found


def _copy_of(code: types.CodeType, shapes: list, cache: dict | None = None) -> str | None:
    """The answer (its label, and how much of it) that ``code`` is an edited copy of:
    ``code`` holds at least :data:`COPIED` of its instructions in their order."""
    # (an instruction takes two bytes or more: too short a function is let go before dis)
    if not shapes or len(code.co_code) < 2 * COPIED * COPY_MIN_TOKENS:
        return None
    # the global and attribute names it uses, at no cost: a copy keeps most of the answer's
    # (a lenient half, for renamed imports); torch's own functions, started by the hundred
    # under a watch, share few, and are let go before the costly disassembly. A copy whose
    # globals were all renamed (lab 14: plan_for's four through aliases) shares
    # none but is as long: the length lets it through to the instructions
    names, size = set(code.co_names), len(code.co_code)
    near = [s for s in shapes if len(names & s[2]) >= 0.5 * len(s[2])
            or 0.8 * s[4] <= size]  # fmt: skip
    if not near:
        return None
    cache = _tokens_of if cache is None else cache
    mine = _tokens(code, cache)
    counts = cache[id(code)][2]
    for theirs, their_counts, _, label, _ in near:
        if len(mine) < COPIED * len(theirs):
            continue
        # the instructions both have, whatever the order: an upper bound, and cheap
        if sum((counts & their_counts).values()) < COPIED * len(theirs):
            continue
        blocks = difflib.SequenceMatcher(None, mine, theirs, autojunk=False).get_matching_blocks()
        held = sum(b.size for b in blocks) / len(theirs)
        if held >= COPIED:
            return f"{label} (an edited copy: {held:.0%} of its instructions, in their order)"
    return None


#: the opcodes :func:`_tokens` leaves out (CACHE: 3.11's inline caches, which dis hides)
_UNCOUNTED = frozenset(
    dis.opmap[name] for name in ("CACHE", "RESUME", "NOP", "EXTENDED_ARG") if name in dis.opmap
)


def _token_count(code: types.CodeType) -> int:
    """``len(_tokens(code))`` read off the bytecode's 2-byte units, without dis (which
    builds an object per instruction: most of a watch's start-up on every rank)."""
    ops = code.co_code[::2]
    return len(ops) - sum(ops.count(op) for op in _UNCOUNTED)


def _prefilter(codes: dict) -> tuple:
    """What a watch on a rank needs to choose the code objects worth sending out: the
    answers' bytecode sizes (a copy compiled anew has its answer's) and, per answer long
    enough for an edited copy to be told (:data:`COPY_MIN_TOKENS`), its global names and
    size."""
    sizes = frozenset(len(code.co_code) for code in codes if _telling(code))
    shapes = tuple(
        (frozenset(code.co_names), len(code.co_code))
        for code in codes
        if code.co_filename.startswith(_KIT) and _token_count(code) >= COPY_MIN_TOKENS
    )
    return sizes, shapes
