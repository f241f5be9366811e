"""What a rank's watches send on its channel arrives whole, however many threads write."""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import Connection

from overlapkit.sandbox.sightings import _writer


def test_two_threads_writing_large_messages_at_once_never_interleave_them():
    read_fd, write_fd = os.pipe()
    pipe = (write_fd, (os.fstat(write_fd).st_dev, os.fstat(write_fd).st_ino))
    size = 1 << 20  # far more than a pipe holds: each write goes in pieces
    senders = [_writer(pipe, number) for number in (1, 2)]
    threads = [
        threading.Thread(target=send, args=(0, bytes([65 + i]) * size))
        for i, send in enumerate(senders)
    ]
    for t in threads:
        t.start()  # both block on the full pipe, halfway through their message
    reader = Connection(read_fd, writable=False)
    got = [reader.recv_bytes(size + 64) for _ in threads]
    for t in threads:
        t.join(10)
    reader.close()
    os.close(write_fd)
    bodies = sorted(message[5:] for message in got)  # after the kind and the watch's number
    assert bodies == [b"A" * size, b"B" * size]
