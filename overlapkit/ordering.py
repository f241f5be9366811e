"""Issue order: how the kit's operations on a group are numbered, announced and run.

Each rank runs its kit collectives one at a time, in the order it issued them
(from any thread), as a CUDA communication stream would; ``async_op=True`` runs
one on the rank's communication worker while the caller goes on. Ranks match
the k-th kit collective of a group with each other's k-th, as NCCL does. Each
one first announces itself to the peers it talks to (its number, collective,
size, dtype, op and issuing thread — a few hundred bytes riding ahead of the
data), so ranks that disagree get a :class:`~overlapkit.p2p.CollectiveMismatchError`
naming both calls, not a hang or garbage (``check=False`` skips the announcement).
A failed collective marks its group broken: later ones on it fail at once, naming
the first failure. The kit's messages travel in streams of their own (see
:mod:`overlapkit.p2p`): a learner's ``dist.all_reduce`` or ``ok.p2p`` messages in
between never pair with them.

The algorithms themselves are in :mod:`overlapkit.collectives`; each hands its body
to :func:`_run`, which issues it here.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import queue
import re
import sys
import threading
import time

import torch
import torch.distributed as dist

from . import handles, inflight, p2p

# --------------------------------------------------------------------------- groups


def _global_rank(group, r: int) -> int:
    """The global rank of position ``r`` in ``group`` (p2p calls address global ranks)."""
    return r if group is None else dist.get_global_rank(group, r)


_rings: dict = {}
p2p.on_forget(_rings.clear)  # a new default group may have other ranks


def _ring(group):
    """(my position, world, global rank of the left and right neighbours) in ``group``
    (looked up once per group: torch's lookups cost more than a small ring step)."""
    key = p2p._group_name(group)
    ring = _rings.get(key)
    if ring is None:
        me, world = dist.get_rank(group), dist.get_world_size(group)
        left, right = _global_rank(group, (me - 1) % world), _global_rank(group, (me + 1) % world)
        ring = _rings[key] = (me, world, left, right)
    return ring


# --------------------------------------------------------------------------- calls


_calls: dict = {}


def _describe_call(name: str, tensor: torch.Tensor, op: str | None, extra: int, thread: str):
    """(signature, description) of a kit collective: what its peers must agree on, and
    how an error names it. Deterministic across processes (unlike ``hash``); remembered
    per call site, since a training loop issues the same calls again and again."""
    key = (name, tensor.numel(), tensor.dtype, op, extra, thread, handles._caller())
    known = _calls.get(key)
    if known is None:
        known = _calls[key] = _new_call(name, tensor, op, extra, thread, key[-1])
    return known


def _new_call(name, tensor, op, extra, thread, site):
    dtype = str(tensor.dtype).removeprefix("torch.")
    # a thread's own name tells which stream of work issued the op (a bucketer, a
    # pipeline stage); Python's automatic "Thread-N" follows creation order, which
    # may differ between correct ranks, so it does not count
    named = "" if re.match(r"Thread-\d+", thread) else thread
    key = f"{name}|{tensor.numel()}|{dtype}|{op}|{extra}|{named}".encode()
    signature = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest()) & ((1 << 52) - 1)
    description = (
        f"{name} of {tensor.numel()} × {dtype}"
        + (f", op {op!r}" if op else "")
        + (f", output of {extra}" if extra >= 0 else "")
        + f", issued at {handles._format_site(site)} in thread {thread!r}"
    )
    return signature, description


# --------------------------------------------------------------------------- issue order


class Handle(handles.Tracked):
    """An asynchronous kit operation: ``wait(timeout=None)`` blocks until done and
    raises its failure (TimeoutError when ``timeout`` seconds pass first);
    ``is_completed()`` polls. On CUDA, ``wait()`` makes the caller's current
    stream wait for the operation, as NCCL's ``Work.wait()`` does."""

    def __init__(self, future: concurrent.futures.Future, what: str, guard=None, device=None,
                 outputs=()):  # fmt: skip
        super().__init__(what)
        self._future = future
        self._guard = guard  # an inflight.Guard over the tensors the op reads and writes
        self._device = device if device is not None and device.type == "cuda" else None
        self._outputs = list(outputs)  # the caller's tensors the op writes

    def _wait(self, timeout_at: float | None) -> None:
        remaining = None if timeout_at is None else max(0.0, timeout_at - time.perf_counter())
        try:
            done_event = self._future.result(remaining)[1]
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"{self.what} (started at {self.site}) had not finished when "
                f"wait(timeout={remaining:.3g}) ran out"
            ) from None
        except BaseException:
            if self._guard is not None:
                self._guard.abandon()
            raise
        if done_event is not None:
            torch.cuda.current_stream(done_event.device).wait_event(done_event)
        if self._guard is not None:
            self._guard.settle()  # the result reaches the caller's tensor, or a RaceError

    def is_completed(self) -> bool:
        done = self._future.done()
        if done and self._future.exception() is None:
            end = self._future.result()[1]
            if end is not None and not end.query():  # the host is done, the GPU not yet
                return False
        if done and self._guard is not None and self._future.exception() is None:
            # a polling loop may read the tensor once this says True, as with NCCL's
            # is_completed(): the result is written back now; a race is raised by wait()
            with contextlib.suppress(inflight.RaceError):
                self._guard.settle()
        return done

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` completed (on the communication worker) when the
        operation ends, as ``torch.distributed``'s ``Work.get_future()``: what a DDP
        comm hook returns, and how a timeline learns the true end of an op. Waiting on
        it counts as waiting on the handle. On CUDA it is a CUDA-aware future, as NCCL's:
        its value is the op's output tensors, set on a stream that waited for the op's end
        event, so the future records its events after the op's GPU work and its callbacks
        (``then()``, DDP's division and copy back into ``.grad``) are ordered after it, not
        only after the host saw it end."""
        cuda = self._device
        future = (
            torch.futures.Future(devices=[cuda]) if cuda is not None else torch.futures.Future()
        )

        def settle(done: concurrent.futures.Future) -> None:
            self._mark_waited()  # whoever holds the torch future waits through it
            exc = done.exception()
            end = None if exc is not None else done.result()[1]
            with contextlib.ExitStack() as on_stream:
                if cuda is not None and end is not None:
                    # this thread's stream on the op's device waits for the op's end before
                    # anything reads its result: the guard's write-back, the callbacks
                    stream = torch.cuda.current_stream(cuda)
                    stream.wait_event(end)
                    on_stream.enter_context(torch.cuda.device(cuda))
                    on_stream.enter_context(torch.cuda.stream(stream))
                if self._guard is not None:
                    try:
                        self._guard.abandon() if exc is not None else self._guard.settle()
                    except inflight.RaceError as race:
                        exc = race
                if exc is not None:
                    future.set_exception(exc)
                else:  # CUDA tensors in the value: the future records its events after them
                    future.set_result(self._outputs if cuda is not None else None)

        self._future.add_done_callback(settle)
        return future


class _Executor:
    """Runs the kit operations of one group on this rank one at a time, in issue order.

    The CPU counterpart of a CUDA communication stream (one per communicator,
    as NCCL has): ops of different groups run independently, so two threads
    that each drive a group of their own never wait for each other. A
    synchronous op runs on the caller's thread once every op issued before it
    on its group has finished; an async one on the group's communication
    worker thread. A kit op issued from inside a running one of the same group
    (on the worker: a callback, a bucketer given to :func:`run_async`) runs at
    once, as part of that one — waiting for its turn there would wait for
    itself. Each op gets the next number of its group, which its messages
    carry and its peers check.
    """

    def __init__(self, name: str):
        self.name = name
        self._cond = threading.Condition()
        self._issued = 0
        self.collectives_issued = 0  # of them, collectives (not run_async's functions)
        self._done = 0
        self._seq = 0
        self._broken: str | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._turn = threading.local()

    def in_turn(self) -> bool:
        return getattr(self._turn, "active", False)

    def _new_op(self, call) -> p2p.Op | None:
        """The op of ``call`` = (group, signature, description, check), numbered in its group."""
        if call is None:
            return None
        group, signature, description, check = call
        self._seq += 1
        op = p2p.Op(group, self._seq, signature, description)
        op.check = check
        return op

    def issue(self, fn, call, device, async_op: bool, what: str, guard=None, outputs=()):
        if self.in_turn():  # nested in a running op: part of its turn
            result = self._execute(fn, call, device, None)
            if not async_op:
                if result[1] is not None:  # the caller's stream reads what the op wrote
                    torch.cuda.current_stream(result[1].device).wait_event(result[1])
                return result[0]
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(result)
            return Handle(future, what, device=device, outputs=outputs)
        with self._cond:
            ticket = self._issued
            self._issued += 1
            self.collectives_issued += call is not None
            if not async_op and self._done != ticket:  # wait for the ops issued before
                self._cond.wait_for(lambda: self._done == ticket)
        if not async_op:
            try:
                result, done = self._execute(fn, call, device, None)
            finally:
                self._advance()
            if done is not None:
                torch.cuda.current_stream(done.device).wait_event(done)
            return result
        ready = None
        if device is not None and device.type == "cuda":
            # ordered after the work queued on the caller's stream at issue, as NCCL is
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        future = concurrent.futures.Future()
        self._ensure_worker()
        self._queue.put((ticket, fn, call, device, ready, future, _profile_to_carry()))
        return Handle(future, what, guard, device, outputs)

    def _execute(self, fn, call, device, ready):
        """Run ``fn`` as the op of ``call``: (result, CUDA event marking its end on the comm
        stream). Ops are numbered here, in the order they run — the same on every rank,
        also for ops issued from inside a running one."""
        with self._cond:
            op = self._new_op(call)
        if self._broken is not None:
            what = op.description if op is not None else "this operation"
            raise RuntimeError(
                f"{what}: not run, because an earlier kit operation on this group "
                f"failed ({self._broken}); its messages may still be in flight, so "
                "nothing later on the group can be trusted"
            )
        was, self._turn.active = self.in_turn(), True
        try:
            with p2p.running(op):
                if device is not None and device.type == "cuda":
                    with _comm_stream(self.name, device, ready) as done:
                        result = _run_op(fn, op)
                    return result, done.event
                return _run_op(fn, op), None
        except BaseException as exc:
            if op is not None:
                self._broken = f"{op.description}: {type(exc).__name__}: {exc}"
            raise
        finally:
            self._turn.active = was

    def _advance(self) -> None:
        with self._cond:
            self._done += 1
            self._cond.notify_all()

    def _ensure_worker(self) -> None:
        with self._cond:
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._loop, name=f"overlapkit-comm-{self.name}", daemon=True
                )
                self._worker.start()

    def _loop(self) -> None:
        while True:
            ticket, fn, call, device, ready, future, profile = self._queue.get()
            with self._cond:
                self._cond.wait_for(lambda t=ticket: self._done == t)
            try:
                if future.set_running_or_notify_cancel():
                    self._turn.active = True
                    try:
                        # Python refuses a profile function while one is being put in place
                        # on this thread (a profile function's clean-up may still run): try
                        # again; the op never runs without the profile it was issued under
                        for attempt in range(_PROFILE_ATTEMPTS):
                            try:
                                sys.setprofile(profile)
                                break
                            except RuntimeError:
                                if attempt == _PROFILE_ATTEMPTS - 1:
                                    raise
                                time.sleep(0.001)
                        # callbacks of the future run here: still within this op's turn
                        future.set_result(self._execute(fn, call, device, ready))
                    except BaseException as exc:  # noqa: BLE001 - delivered to wait()
                        future.set_exception(exc)
                    finally:
                        self._turn.active = False
                        for _ in range(_PROFILE_ATTEMPTS):
                            with contextlib.suppress(RuntimeError):  # (as above) once more
                                sys.setprofile(None)
                                break
            finally:
                # the worker outlives whatever an op did: one that died would leave every
                # later op of its group waiting for ever
                self._advance()


#: how often the worker tries to put an op's profile function in place (1 ms apart)
_PROFILE_ATTEMPTS = 50


def _profile_to_carry():
    """The issuing thread's profile function, when it asks to follow the work it sees to
    the worker (an attribute ``propagates`` that is true): ``sys.setprofile`` is per
    thread, and an async op's task runs on the worker. Others (cProfile's, a debugger's)
    stay with their thread."""
    profile = sys.getprofile()
    return profile if getattr(profile, "propagates", False) else None


def _run_op(fn, op):
    # a collective writes its result in place outside autograd, as the built-ins do; and
    # the communication worker's thread does not share the caller's torch.no_grad()
    with torch.no_grad():
        result = fn()
    if op is not None:
        op.finish()  # its announcements checked, also where no data was waited for
    return result


class _StreamEnd:
    """Where an op's work on the communication stream ends: its CUDA event (None off CUDA)."""

    event = None


@contextlib.contextmanager
def _comm_stream(group_name: str, device, ready):
    """On CUDA, run on the kit's communication stream of the group on ``device``, after
    ``ready``; yields an object whose ``event`` marks the end of the op's work there."""
    done = _StreamEnd()
    stream = comm_stream(group_name, device)
    if ready is not None:
        stream.wait_event(ready)
    else:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield done
        done.event = torch.cuda.Event()
        done.event.record(stream)


_labels = threading.local()


@contextlib.contextmanager
def labelled(label: str):
    """Kit collectives issued inside carry ``label`` in what their peers check and in
    their errors: two ranks that issue same-sized operations in different orders (stage
    1's bucket 0 on one, bucket 1 on the other) are told which each ran, where the size
    alone would let their bytes mix."""
    previous, _labels.label = getattr(_labels, "label", None), label
    try:
        yield
    finally:
        _labels.label = previous


_cuda_streams: dict = {}


def comm_stream(group_name: str, device) -> torch.cuda.Stream:
    """The kit's communication stream of one group on one device, made once: as NCCL
    gives each communicator its own, so that two groups' operations (FSDP's AllGather and
    ReduceScatter, a hybrid's dp and pp) never queue behind each other in an order that
    differs between ranks."""
    key = (group_name, torch.device(device))
    stream = _cuda_streams.get(key)
    if stream is None:
        stream = _cuda_streams[key] = torch.cuda.Stream(key[1])
    return stream


_executors: dict = {}
_executors_lock = threading.Lock()


def _executor(group) -> _Executor:
    name = p2p._group_name(group)
    with _executors_lock:
        if name not in _executors:
            _executors[name] = _Executor(name)
        return _executors[name]


@dataclasses.dataclass(frozen=True)
class Issued:
    """How many kit operations this rank has issued on a group so far (:func:`issued`)."""

    ops: int  # collectives and run_async's functions
    collectives: int  # of them, collectives


def issued(group=None) -> Issued:
    """How many kit operations this rank has issued on ``group`` (default: the default
    group) so far: take it before and after a piece of code for what that code issued."""
    executor = _executor(group)
    return Issued(ops=executor._issued, collectives=executor.collectives_issued)


def worker_code():
    """The code of the communication worker's loop, the frame below every async op's task
    on its thread: for tools that walk a worker's stack, or start one's tracing there."""
    return _Executor._loop.__code__


def _run(name: str, fn, tensor: torch.Tensor, group, async_op: bool, check: bool,
         op: str | None = None, extra: int = -1, operands=()):  # fmt: skip
    """Issue the kit collective ``fn(*operands' tensors)`` (whose body announces it to its
    peers). ``operands``: the caller's (tensor, written?) pairs; an async op guards them
    while in flight (:mod:`overlapkit.inflight`) and works on what the guard gives it."""
    thread = threading.current_thread().name
    label = getattr(_labels, "label", None)
    if label:
        name = f"{name} [{label}]"
    signature, description = _describe_call(name, tensor, op, extra, thread)
    call = (group, signature, description, check)
    what = description.split(",")[0]
    executor = _executor(group)
    tensors = [t for t, _ in operands]
    written = [t for t, w in operands if w]
    if not async_op or executor.in_turn() or not tensors:
        return executor.issue(lambda: fn(*tensors), call, tensor.device, async_op, what,
                              outputs=written)  # fmt: skip
    site = handles._format_site(handles._caller())
    guard = inflight.Guard(what, site, tensors, [w for _, w in operands])

    def guarded():
        guard.started()
        return fn(*guard.working)

    return executor.issue(guarded, call, tensor.device, async_op, what, guard, written)


def run_async(fn, group=None, device=None, outputs=()) -> Handle:
    """Run ``fn()`` on ``group``'s communication worker, in issue order with the kit's
    collectives on that group.

    Kit collectives on ``group`` that ``fn`` calls (synchronously) run at once,
    within its turn: a bucketer that flattens, all-reduces and unflattens can
    be made asynchronous this way. ``wait()`` re-raises what ``fn`` raised. On a CUDA
    ``device``, ``fn`` runs on the group's communication stream after the work queued on
    the caller's stream, and ``wait()`` makes the caller's stream wait for it; ``outputs``
    (the tensors ``fn`` writes) are the value of the handle's future.
    """
    name = getattr(fn, "__name__", "function")
    device = None if device is None else torch.device(device)
    return _executor(group).issue(fn, None, device, True, name, outputs=outputs)


def _announce(group, to: list[int], frm: list[int], device, data_follows: bool) -> None:
    """The op's first messages: who it is, checked against what the peers announced
    (``data_follows``: every peer in ``to`` gets data from this op)."""
    op = p2p.current_op()
    if op.check and _ring(group)[1] > 1:
        p2p.announce_and_check(to, frm, group, device, data_follows)


def _announce_ring(group, device, numel: int) -> None:
    """A ring op talks to its two neighbours: announce to the right, check the left.
    With at least one element per chunk, every step sends to the right."""
    _, world, left, right = _ring(group)
    _announce(group, [right], [left], device, data_follows=numel >= world)
