"""Run a lab's original check on a student's saved exercise, in a process of its own.

The judge process decides the verdict, so nothing of the student's runs in it:

* it starts isolated (``python -I``: no ``PYTHON*`` variables, no user site-packages), in
  an empty folder of its own, with no folder of the student's on ``sys.path``, and
  imports the kit before it reads anything the notebook left;
* it never unpickles the student's objects: data (a table, a configuration, and what the
  grader's witness saw the notebook measure: ``overlapkit.sandbox.witness``, never notes
  the kernel wrote) is read with PyTorch's
  weights-only loader, functions and classes stay sealed bytes that unpickle
  only on ranks (``overlapkit.sandbox.sealed``), and ranks' results come back as plain
  data (``overlapkit.plaindata``);
* it writes its report to a pipe only it was given, with a secret the grader sent it on
  stdin, and makes itself undumpable (Linux: no other process of this user may read or
  write its memory or its descriptors); the report is never read from an output stream
  where ranks' text or a check's messages could forge it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading

from ..grading.exercises import LIGHT
from ..launcher import PRELOAD
from ..sandbox.witness import NOTES
from ..warmup import SKIP
from .labs import Exercise
from .processes import descendants, end_new_processes


def judge_environment() -> dict[str, str]:
    """The judge's (and so its ranks') environment: the grader's, with torch's plug-ins
    off. ``import torch`` otherwise runs every ``torch.backends`` entry point installed
    (a notebook can install one that rewrites the judge's report; the folder it adds is
    noticed too, :mod:`.tamper`)."""
    return {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}


_RUNNER = r"""
import ctypes, os, sys
try:  # first: PR_SET_DUMPABLE 0, no other process of this user may open our fds or memory
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
except Exception:
    pass
sys.stdout.write("ready\n")  # only now does the grader send the secret
sys.stdout.flush()
secret = sys.stdin.readline().strip()
sys.path[:] = [p for p in sys.path if p not in ("", ".")]  # no folder of the student's
# the ranks' forkserver imports torch while this process does (the launcher finds it
# running with the same preload): ~2 s of every judge's start on an idle core
import multiprocessing
from multiprocessing import forkserver
# (torch's warm-up in it only where the check's ranks build an optimizer: judge.LIGHT)
light = sys.argv[2] in @LIGHT@
preload = ["overlapkit._rank"] if light else @PRELOAD@  # the ranks import the rest
if light:  # and not in each of its ranks either (they inherit this environment)
    os.environ[@SKIP@] = "1"
multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
forkserver.ensure_running()
import json
import overlapkit as ok  # the kit first, before anything the notebook left
from overlapkit import plaindata
from overlapkit.sandbox.sealed import Sealed
plaindata.distrust_from_now()
out = os.fdopen(int(sys.argv[1]), "w")
check, folder = sys.argv[2], sys.argv[3]
names, kwargs, shown = json.loads(sys.argv[4]), json.loads(sys.argv[5]), json.loads(sys.argv[6])
try:  # what the grader's witness saw the notebook measure, as plain data (records)
    from overlapkit.sandbox import records
    with open(os.path.join(folder, @NOTES@), "rb") as f:
        records.restore(plaindata.loads(f.read()))
except Exception:
    pass
objs = []
for n in names:
    data = None
    try:
        with open(os.path.join(folder, n + ".pt"), "rb") as f:
            data = (plaindata.loads(f.read()),)
    except Exception:
        pass
    if data is None:
        with open(os.path.join(folder, n + ".pkl"), "rb") as f:
            data = (Sealed(n, f.read(), shown.get(n)),)
    objs.append(data[0])
report = getattr(ok.grading, check)(*objs, **kwargs)
out.write(json.dumps({"secret": secret, "report": report.to_dict()}) + "\n")
out.close()
"""
for _name, _value in (
    ("@PRELOAD@", PRELOAD),
    ("@LIGHT@", sorted(LIGHT)),
    ("@NOTES@", NOTES),
    ("@SKIP@", SKIP),
):
    _RUNNER = _RUNNER.replace(_name, repr(_value))


def run_check(ex: Exercise, folder: str, limit: float, shown: dict | None = None) -> dict | str:
    """The lab's check on the saved objects, in a fresh isolated process (in an empty folder
    of its own): its report, or why not. ``shown``: the objects' own names, for messages.

    The secret goes to the judge only after it has made itself undumpable (it says "ready"
    first), and the report is the first line on its pipe that carries the secret: lines
    anyone else managed to write there count for nothing. Whatever the judge's ranks
    started, also in sessions of their own, is ended when it is done."""
    secret = secrets.token_hex(16)
    read, write = os.pipe()
    found: list[dict] = []

    def drain():
        with os.fdopen(read, "rb") as pipe:
            for line in pipe:
                try:
                    got = json.loads(line)
                except ValueError:
                    continue
                if isinstance(got, dict) and got.get("secret") == secret:
                    found.append(got)
                    return

    reader = threading.Thread(target=drain, daemon=True)
    before = descendants()
    with tempfile.TemporaryDirectory(prefix="overlapkit-judge-") as home:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _RUNNER, str(write), ex.check, folder,
                 json.dumps(ex.names), json.dumps(ex.kwargs), json.dumps(shown or {})],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(write,), cwd=home, start_new_session=True, env=judge_environment(),
            )  # fmt: skip
        finally:
            os.close(write)
        reader.start()
        # both output streams drained as the judge writes (a check's messages must never
        # fill a pipe nobody reads); stderr's tail kept for "could not run"
        err = bytearray()
        drains = [threading.Thread(target=_drain, args=(stream, keep), daemon=True)
                  for stream, keep in ((proc.stdout, None), (proc.stderr, err))]  # fmt: skip
        try:
            if proc.stdout.readline().strip() == b"ready":
                proc.stdin.write(secret.encode() + b"\n")
                proc.stdin.flush()
        except OSError:
            pass
        for drain_thread in drains:
            drain_thread.start()
        try:
            # done when the report arrives or the pipe closes (the judge ended): the judge
            # is not waited for while it tears torch and its forkserver down (~1 s)
            reader.join(limit)
            if reader.is_alive():
                return f"the check did not finish within {limit:g} s"
        finally:
            _end(proc)
            end_new_processes(before)
            reader.join(5)
            for drain_thread in drains:
                drain_thread.join(5)
    if not found:
        tail = bytes(err).decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return f"the check could not run: {tail[0][:300]}"
    return found[0]["report"]


def _drain(stream, keep: bytearray | None, tail: int = 8192) -> None:
    """Read ``stream`` to its end; keep its last ``tail`` bytes in ``keep`` (if given)."""
    with contextlib.suppress(OSError, ValueError):
        while chunk := stream.read1(65536):
            if keep is not None:
                keep += chunk
                del keep[:-tail]


def _end(proc: subprocess.Popen) -> None:
    """The judge and all it started (its ranks' forkserver, the ranks) are one session."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
