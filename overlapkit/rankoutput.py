"""What the ranks printed, shown to the caller: each rank's log grouped by rank, a hung
rank's stack (faulthandler's dump) reduced to where it waits, and the last words of a
rank that died. The kit's own frames (the rank's entry point and what registers itself
with :func:`hide_frames_from`) are left out of what the user sees.
"""

from __future__ import annotations

import linecache
import os
import re
import sys

from . import _rank


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def print_rank_output(logs: list[str], file=None) -> None:
    """Print each rank's output, every line prefixed by its rank, ranks in order."""
    file = file if file is not None else sys.stdout
    width = len(str(len(logs) - 1))
    for r, text in enumerate(logs):
        for line in text.splitlines():
            print(f"[rank {r:>{width}}] {line}", file=file)
    file.flush()


#: files whose frames are the kit's plumbing, hidden from the learner's tracebacks
_PLUMBING: set[str] = {os.path.abspath(_rank.__file__)}


def hide_frames_from(path: str) -> None:
    """Hide frames of ``path`` (a kit module that wraps the learner's code) from reports."""
    _PLUMBING.add(os.path.abspath(path))


def _is_plumbing(path: str) -> bool:
    return os.path.abspath(path) in _PLUMBING


_DUMP_HEADER = re.compile(
    r"^(Current thread|Thread) 0x[0-9a-f]+ .*\(most recent call first\):$", re.M
)
_DUMP_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<name>\S+)$')


def _dump_blocks(text: str) -> list[tuple[int, int]]:
    starts = [m.start() for m in _DUMP_HEADER.finditer(text)]
    blocks = []
    for i, s in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(text)
        blocks.append((s, end))
    return blocks


def _strip_dumps(text: str) -> str:
    """The rank's own output without the faulthandler dump we asked for."""
    blocks = _dump_blocks(text)
    return text[: blocks[0][0]] if blocks else text


def _frames(text: str, start: int, end: int) -> list[tuple[str, int, str]]:
    """(file, line, function) of one thread's dump, innermost first."""
    frames = []
    for line in text[start:end].splitlines()[1:]:
        m = _DUMP_FRAME.match(line)
        if m:
            frames.append((m["file"], int(m["line"]), m["name"]))
    return frames


def _show(frames, depth: int) -> str:
    lines = []
    for f, n, name in frames[:depth]:
        src = linecache.getline(f, n).strip()
        lines.append(f'  File "{f}", line {n}, in {name}' + (f"\n    {src}" if src else ""))
    return "\n".join(lines)


def _where_hung(text: str, depth: int = 6) -> str:
    """The innermost frames of the rank's main thread, with source lines where we know them;
    when it waits for an asynchronous kit operation, also where the communication worker
    running that operation is (the wait ends only when the worker does).

    faulthandler prints only file/line/function; the caller's linecache knows
    the source of notebook cells, so the learner sees the line that hangs.
    """
    rank_py = os.path.abspath(_rank.__file__)
    threads = [_frames(text, start, end) for start, end in _dump_blocks(text)]
    for frames in threads:
        if not any(os.path.abspath(f) == rank_py for f, _, _ in frames):
            continue  # not the main thread
        user = []
        for f, n, name in frames:  # innermost first
            if os.path.abspath(f) == rank_py:
                break
            if not _is_plumbing(f):
                user.append((f, n, name))
        # the kit's own frames (a p2p wait, say) would push the learner's line out of
        # view: show where the rank waits inside the kit, then the learner's frames
        kit = os.path.dirname(os.path.abspath(__file__)) + os.sep
        outside = [fr for fr in user if not os.path.abspath(fr[0]).startswith(kit)]
        if outside and outside[0] is not user[0]:
            user = [user[0], *outside]
        shown = _show(user, depth) or "  (no Python frame: it was starting up)"
        if any(_is_ordering(f) and name == "_wait" for f, _, name in frames):
            for worker in threads:
                # a worker's outermost kit frame is its loop; one idle in it runs nothing
                if (
                    worker
                    and worker[0][2] != "_loop"
                    and any(_is_ordering(f) and name == "_loop" for f, _, name in worker)
                ):
                    shown += ("\n  ... waiting for an operation that its communication "
                              f"worker runs, which was here:\n{_show(worker, depth)}")  # fmt: skip
        return shown
    return "  (the rank did not answer the request for its stack)"


def _is_ordering(path: str) -> bool:
    return os.path.basename(path) == "ordering.py"


def _format_frames(frames) -> str:
    lines = ["Traceback (most recent call last):"]
    for filename, lineno, name, line in frames:
        if _is_plumbing(filename):
            continue
        # the rank had no source for notebook cells; this kernel does
        line = line or linecache.getline(filename, lineno).strip()
        lines.append(f'  File "{filename}", line {lineno}, in {name}')
        if line:
            lines.append(f"    {line}")
    return "\n".join(lines)


#: lines of a dying process's output that say why (C++ exceptions, gloo/NCCL checks)
_LAST_WORDS = re.compile(r"what\(\)|terminate called|Error|error|enforce fail|Aborted")


def last_words(log: str) -> str:
    """The last line of a rank's output that says why it died ('' when none does)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if _LAST_WORDS.search(line):
            return line.removeprefix("what():").strip()
    return ""
