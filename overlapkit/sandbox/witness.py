"""The grader's witness: a lab's measurements, taken outside the student's kernel.

Lab 10's check asks that the table hold numbers its ``measure()`` returned. In a notebook
the check can only read what ``measure()`` noted in the kernel's own memory
(:mod:`overlapkit.sandbox.records`), and code in that kernel can write a note too. Under
the grader the notes come from here instead::

    grader ──starts──▶ witness (own process, undumpable)
      ▲  report socket          ▲ unix socket (path in OVERLAPKIT_WITNESS)
      │  (a socketpair: no      │
      │   path to open)         kernel: measure(config) ──request──▶ witness measures
      └──── one JSON line per measurement ◀──────────────────────────┘ (its own launch)

The kernel may ask for any measurement (that is measuring); it cannot tell the witness
what a measurement gave, nor reach the report socket (a socket is not opened through
/proc) or the witness's memory (undumpable). What the grader's judge reads as the
notebook's notes is the report, so a note forged in the kernel never reaches it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

#: the file, in the grader's folder for a notebook, that holds the witness's notes for
#: the judge (plain data)
NOTES = "__notes__.pt"
#: the environment variable that tells a lab's measuring helper where the witness listens
ENV = "OVERLAPKIT_WITNESS"
REQUEST_LIMIT = 64 * 1024  # bytes of one request: a configuration is a few dozen
START_S = 60.0  # for the witness to listen (it imports the kit, and torch, first)


# ------------------------------------------------------------------ the kernel's side


def address() -> str | None:
    """Where the grader's witness listens, or None (not under the grader)."""
    return os.environ.get(ENV) or None


def ask(kind: str, config: dict, timeout: float = 600.0) -> dict:
    """Have the witness take one measurement of ``kind`` (``"lab10.measure"``) of
    ``config``; returns what it measured. Raises RuntimeError with the witness's reason."""
    path = address()
    if path is None:
        raise RuntimeError(f"no grader's witness here ({ENV} is not set)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(path)
        conn.sendall(json.dumps({"kind": kind, "config": config}).encode() + b"\n")
        reply = _read_line(conn)
    answer = json.loads(reply) if reply else {"error": "the witness closed the connection"}
    if "error" in answer:
        raise RuntimeError(f"the grader's witness could not measure {config}: {answer['error']}")
    return answer["result"]


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) <= REQUEST_LIMIT:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.strip()


# ------------------------------------------------------------------ the grader's side


class Witness:
    """Started by the grader for one notebook: ``env()`` goes to the kernel, ``notes()``
    to the judge, ``close()`` when the notebook is done (also as a context manager).
    ``measures``: the modules whose ``MEASURES`` (kind -> (a configuration's problem or
    None, the measurement, the note it leaves)) say what the witness may measure; the
    kernel names a kind, never a module."""

    def __init__(self, measures: tuple[str, ...]):
        self.folder = tempfile.mkdtemp(prefix="overlapkit-witness-")
        self.path = os.path.join(self.folder, "socket")
        mine, theirs = socket.socketpair()
        self._report, self._lines = mine, []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "overlapkit.sandbox.witness", self.path,
             str(theirs.fileno()), *measures],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.folder, "log"), "wb"),
            start_new_session=True,  # its ranks are ended with it, not with the kernel's
        )  # fmt: skip
        theirs.close()
        self._reader = threading.Thread(target=self._read, name="overlapkit-witness", daemon=True)
        self._ready = threading.Event()
        self._reader.start()
        if not self._ready.wait(START_S):
            self.close()
            raise RuntimeError(f"the grader's witness did not start within {START_S:g} s")

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = self._report.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line == b"ready":
                    self._ready.set()
                else:
                    with contextlib.suppress(ValueError):
                        self._lines.append(json.loads(line))

    def env(self) -> dict:
        return {ENV: self.path}

    def notes(self) -> dict:
        """What the witness measured: kind -> entries, as :data:`.records.NOTES` holds them."""
        out: dict = {}
        for line in list(self._lines):
            if isinstance(line, dict) and isinstance(line.get("kind"), str):
                out.setdefault(line["kind"], []).append(line.get("entry"))
        return out

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, 9)  # the witness and the ranks it launched
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        self._reader.join(5)
        self._report.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> Witness:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------ the witness itself


def _measures(modules) -> dict:
    """kind -> (a configuration's problem or None, the measurement, the note it leaves),
    from the ``MEASURES`` of each module the grader named."""
    out: dict = {}
    for name in modules:
        out.update(importlib.import_module(name).MEASURES)
    return out


def _serve(path: str, report: socket.socket, modules) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    report.sendall(b"ready\n")
    measures = None
    while True:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(30)
            try:
                request = json.loads(_read_line(conn))
                kind, config = request["kind"], request["config"]
                measures = measures or _measures(modules)
                if kind not in measures:
                    raise ValueError(f"no measurement named {kind!r}")
                problem, measure, note_of = measures[kind]
                why = problem(config)
                if why:
                    raise ValueError(why)
                conn.settimeout(None)
                result = measure(config)
                report.sendall(json.dumps({"kind": kind, "entry": note_of(config, result),
                                           "at": time.time()}).encode() + b"\n")  # fmt: skip
                reply = {"result": result}
            except Exception as exc:  # noqa: BLE001 - the kernel is told why, and goes on
                reply = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(reply).encode() + b"\n")


def main(argv: list[str]) -> None:
    # PR_SET_DUMPABLE 0: no process of this user (the kernel) may read or change its memory
    with contextlib.suppress(Exception):  # not Linux: nothing to do
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    _serve(argv[0], socket.socket(fileno=int(argv[1])), argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
