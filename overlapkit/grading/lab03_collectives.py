"""Checks for collective exercises (labs 01-03): AllReduce, ReduceScatter, AllGather.

Each check runs the learner's function on several world sizes (3 included) and
sizes ordered from the most telling to the most awkward (divisible by the
world size, then not, then fewer elements than ranks), compares every rank's
result with the truth, and says exactly what differs: world size, size, rank,
chunk and element, expected vs got, the ranks' inputs there, what the wrong
values are made of ("x0 + x2: rank 1's part is missing") and the likely
mistake. With ``from_scratch=True`` it also fails a function that calls a
built-in collective (or the kit's own), or that sends with torch.distributed's
own send/recv instead of ``ok.p2p`` (those bypass the emulated link, so any
timing of them would beat the bound). The learner's ``ok.p2p`` messages go
over a link that costs nothing, so that a send and a receive of different
sizes is an error naming both, never a crashed process. A hanging attempt is
stopped at ``timeout`` and the report says where each rank waited.

With ``made_of=("reduce_scatter", "all_gather")`` (lab 01) the AllReduce must be
built from those collectives (built-ins or the kit's): every call must call each,
and none may call an AllReduce. Their tensor forms need sizes that divide by the
world size; a call whose sizes do not fit is refused before it reaches gloo
(which would stop the process with a fatal check), and a case whose size does
not divide says: pad.

Inputs are drawn afresh on every run, and each rank is sent only its own seed, so no
rank can rebuild another's input. They are integers stored as floats (sums are exact in
any order): for a sum, rank r's values are ±1…4 times 10^r, so every digit of a result
says what one rank contributed, and a result that counts any rank's part zero times, twice
or negated differs from the sum in every element, whatever was drawn.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import secrets

import torch

from ..collectives import chunk_bounds
from ..p2p import Link
from ..sandbox import answers
from . import traffic as recorder
from .cases import count_not_reached
from .common import _learner_line, report_failure, sealed_rank_hint
from .exercises import answers_of
from .lab01_patterns import _HOW, PARTS, collective_calls, made_of_problem, padding_advice
from .lab03_patterns import _pattern_problem
from .report import Report
from .traffic import Traffic, run_recorded

WORLD_SIZES = (2, 3, 4)
#: the learner's ok.p2p messages go over this link in a check: it costs nothing, its
#: headers turn a send/receive size mismatch into an error instead of an abort, and a
#: blocking send waits for its receiver (so send-before-receive deadlocks, as on gloo)
CHECK_LINK = Link(latency_us=0, bandwidth_gbps=1000, rendezvous=True)
#: a correct 4-rank ring takes 0.3 s here; 20 s, so that one the machine's other work slows
#: 60-fold (a test suite beside it on 2 cores) is not called hung
TIMEOUT_S = 20.0


def _sizes(world: int) -> list[int]:
    """Sizes in the order failures are most telling: divisible by the world size (the
    algorithm itself), then not (uneven chunks), then fewer elements than ranks
    (empty chunks)."""
    sizes = [4 * world, 1031, 7, max(1, world - 1), 1]
    return list(dict.fromkeys(sizes))


def _seeds(world: int) -> dict[tuple[int, int], int]:
    """A fresh seed per (rank, case), drawn by the checking process each time it checks:
    each rank is sent its own only (``ok.launch``'s rank_kwargs), so no rank can rebuild
    another's input and skip the communication."""
    return {(r, salt): secrets.randbits(62) for r in range(world)
            for salt in range(len(_sizes(world)))}  # fmt: skip


def _mine(seeds: dict, rank: int, world: int) -> dict:
    return {"seeds": [seeds[(rank, salt)] for salt in range(len(_sizes(world)))]}


def _input(seed: int, numel: int, rank: int, op: str = "sum") -> torch.Tensor:
    """Rank ``rank``'s input of a case (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, (numel,), generator=g).float() * 2 - 1
    if op not in ("sum", "avg") or rank > 5:  # products stay exact with small factors
        return sign * torch.randint(1, 10, (numel,), generator=g).float()
    return sign * torch.randint(1, 5, (numel,), generator=g).float() * 10.0**rank


def _call(fn, op, *tensors):
    return fn(*tensors) if op == "sum" else fn(*tensors, op=op)


def _truth(world, numel, salt, op, seeds):
    stack = torch.stack([_input(seeds[(r, salt)], numel, r, op) for r in range(world)])
    return {
        "sum": stack.sum(0),
        "max": stack.amax(0),
        "min": stack.amin(0),
        "product": stack.prod(0),
        "avg": stack.sum(0) / world,
    }[op]


class CaseError(RuntimeError):
    """A case raised on a rank: says which case, and carries the cases done before it
    (``done``), so the check can still report an earlier, more telling wrong value;
    ``numel``: the case's size, ``error``: what was raised ("Type: text")."""

    done: list = []
    numel: int | None = None
    error: str = ""


def _case(what: str, call, done: list, numel: int | None = None):
    """Run one case: (its return value, handles it left un-waited); an error names the
    case (and messages are counted from it)."""
    from .. import handles, p2p

    p2p.mark_messages("in this call")
    try:
        value = call()
        return value, handles.take_unwaited()
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the case named
        error = CaseError(f"on {what}: {exc}")
        error.done, error.numel, error.error = done, numel, f"{type(exc).__name__}: {exc}"
        raise error from exc


def _messages_since(mark: tuple[int, int]) -> tuple[list, list, list]:
    """The (peer, bytes) messages this rank sent and received since ``mark``, and what
    the sent ones carried."""
    seen = recorder.current()
    if not seen:
        return [], [], []
    return seen.sent[mark[0] :], seen.received[mark[1] :], seen.payloads[mark[0] :]


def _mark() -> tuple[int, int]:
    seen = recorder.current()
    return (len(seen.sent), len(seen.received)) if seen else (0, 0)


def _run_all_reduce(fn, op, made_of=None, seeds=()):
    import overlapkit as ok

    me, world, out = ok.rank(), ok.world_size(), []
    with collective_calls(fn) if made_of else contextlib.nullcontext([]) as calls:
        for salt, numel in enumerate(_sizes(world)):
            t, start, mark = _input(seeds[salt], numel, me, op), len(calls), _mark()
            returned, unwaited = _case(
                f"a tensor of {numel} elements", lambda t=t: _call(fn, op, t), out, numel
            )
            returned = returned if isinstance(returned, torch.Tensor) else None
            out.append((numel, t, returned, unwaited, tuple(calls[start:]),
                        _messages_since(mark)))  # fmt: skip
    return out


def _run_reduce_scatter(fn, op, seeds=()):
    import overlapkit as ok

    me, world, out = ok.rank(), ok.world_size(), []
    for salt, per_rank in enumerate(_sizes(world)):
        output = torch.full((per_rank,), float("nan"))
        inp = _input(seeds[salt], per_rank * world, me, op)
        what = f"an input of {per_rank * world} elements"
        _, unwaited = _case(what, lambda o=output, i=inp: _call(fn, op, o, i), out)
        out.append((per_rank, output, None, unwaited))
    return out


def _run_all_gather(fn, op, seeds=()):
    import overlapkit as ok

    me, world, out = ok.rank(), ok.world_size(), []
    for salt, per_rank in enumerate(_sizes(world)):
        output = torch.full((per_rank * world,), float("nan"))
        inp = _input(seeds[salt], per_rank, me)
        what = f"an output of {per_rank * world} elements"
        _, unwaited = _case(what, lambda o=output, i=inp: fn(o, i), out)
        out.append((per_rank, output, None, unwaited))
    return out


def _first_difference(got: torch.Tensor, want: torch.Tensor, bounds):
    """(index, chunk) of the first element that differs, or None."""
    bad = ~torch.isclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=False)
    if not bad.any():
        return None
    i = int(bad.nonzero()[0])
    chunk = next(c for c, (lo, hi) in enumerate(bounds) if lo <= i < hi)
    return i, chunk


def _kind(numel: int, world: int) -> str:
    if numel < world:
        return "tiny"
    return "even" if numel % world == 0 else "uneven"


def _composition(got: torch.Tensor, parts: list[torch.Tensor]) -> list[int] | None:
    """Multiplicities m (each in -1..2) with got == Σ m[r]·parts[r] on every element, or None;
    the combination closest to all ones first (fewest wrong terms)."""
    combos = sorted(
        itertools.product((-1, 0, 1, 2), repeat=len(parts)), key=lambda m: sum(x != 1 for x in m)
    )
    for m in combos:
        total = sum(k * x for k, x in zip(m, parts, strict=True))
        if torch.equal(got, total):
            return list(m)
    return None


def _explain_composition(m: list[int], rank: int, pattern: str | None = None) -> str:
    terms = " ".join(
        f"{'-' if k < 0 else '+'} {abs(k) if abs(k) > 1 else ''}x{r}".replace("+ ", "+ ", 1)
        for r, k in enumerate(m)
        if k
    ).lstrip("+ ")
    if not terms:
        return "It holds zeros: nothing was reduced into it."
    missing = [r for r, k in enumerate(m) if k == 0]
    doubled = [r for r, k in enumerate(m) if k == 2]
    negative = [r for r, k in enumerate(m) if k < 0]
    everyone = " + ".join(f"x{r}" for r in range(len(m))) if len(m) <= 3 else "x0 + ... + x3"
    said = f"It holds {terms} (xr: rank r's input there), not {everyone}"
    if m == [int(r == rank) for r in range(len(m))]:
        return said + (
            ": this rank's own input, untouched. Nothing was received into this chunk, or "
            "what was received landed in another one: check the index of the chunk you "
            "receive (and add) in each step, (r-k-2) mod N in reduce-scatter, (r-k-1) mod N "
            "in all-gather."
        )
    if pattern == "root":  # lab 02's master-worker: no chunks, no ring
        return said + _root_composition(m, missing, doubled, negative)
    if sum(1 for k in m if k) == 1:
        return said + (
            ": one rank's values only. Either a received chunk replaced the local one "
            "instead of being added to it (reduce-scatter must add: acc[chunk] += "
            "received), or all-gather wrote a chunk into the wrong place (in step k it "
            "sends chunk (r-k) mod N and receives chunk (r-k-1) mod N)."
        )
    notes = []
    if negative:
        notes.append(f"rank(s) {negative} subtracted")
    if missing:
        notes.append(f"rank(s) {missing} missing")
    if doubled:
        notes.append(f"rank(s) {doubled} counted twice")
    return (
        said + f": {', '.join(notes)}. Every rank's values must be added exactly once. In a "
        "ring, check the chunk indices (mod N) sent, (r-k-1), and received and added, "
        "(r-k-2), in each reduce-scatter step, and that all-gather copies a received chunk "
        "into place (it is already the full sum: adding counts it again); in master-worker, "
        "that the root adds its own values and every buffer it received."
    )


def _root_composition(m: list[int], missing, doubled, negative) -> str:
    """What a wrong sum of the master-worker AllReduce (lab 02) is made of, in its terms."""
    own = (
        "In master-worker the root adds every buffer it received to its own values, in "
        "`tensor` (tensor += buffer), then sends that sum back: a buffer copied into "
        "`tensor`, or a sum started from zeros or from a fresh tensor, loses the root's own "
        "input."
    )
    if sum(1 for k in m if k) == 1:
        return ": one rank's values only. " + own
    if missing == [0]:  # the root is rank 0
        return ": rank 0's own values missing (the root's). " + own
    notes = [f"rank(s) {r} {what}" for r, what in ((negative, "subtracted"),
             (missing, "missing"), (doubled, "counted twice")) if r]  # fmt: skip
    return (
        f": {', '.join(notes)}. Every rank's values must be added exactly once: the root "
        "adds its own values and every buffer it received, each received into a buffer "
        "of its own (one buffer shared by all the receives keeps only the last message)."
    )


def _inputs_line(parts: list[torch.Tensor], want, got) -> str:
    def show(t):
        return "[" + ", ".join(f"{v:g}" for v in t.tolist()) + "]"

    ranks = "; ".join(f"x{r} = {show(p)}" for r, p in enumerate(parts))
    return f" Inputs there: {ranks}; expected {show(want)}, got {show(got)}."


def _likely_cause(failing: list[str]) -> str:
    """What the set of failing size kinds (even / uneven / tiny) points to."""
    kinds = set(failing)
    if kinds == {"tiny"}:
        return (
            " Every size with at least one element per rank is right; with fewer elements "
            "than ranks some chunks are empty: both ends of a step must skip an empty chunk "
            "(or both send it), else a receive meets the wrong message or none."
        )
    if "even" not in kinds:
        return (
            " Sizes that divide by the number of ranks are right, the others are not: the "
            "chunks must cover every element (the first numel % N chunks get one more), "
            "not numel // N each."
        )
    return ""


def _first_problem(results, world, expected, op, from_scratch, inputs=None,
                   made_of=None, pattern=None) -> str | None:  # fmt: skip
    """The first thing wrong, said precisely; None if none. ``results``: (rank, cases,
    traffic) triples. Cases are visited in the order of :func:`_sizes` (most telling
    first), ranks in order."""
    if made_of and (problem := made_of_problem(results, world, made_of)):
        return problem
    for rank, _, traffic in results:
        if from_scratch and traffic.collectives:
            called = ", ".join(sorted(set(traffic.collectives)))
            return f"rank {rank} called {called}: build it from send/recv (isend/irecv) only"
        if from_scratch and traffic.direct:
            called = ", ".join(sorted(set(traffic.direct)))
            return (
                f"rank {rank} used {called}: send and receive with ok.p2p "
                "(isend/irecv/send/recv). torch.distributed's own messages bypass the "
                "kit's emulated link, so any timing of them would beat a bound no ring can beat"
            )
    first, failing = None, []  # the first wrong value; the size kinds that went wrong
    for salt in range(max(len(cases) for _, cases, _ in results)):
        for rank, cases, _ in results:
            if salt >= len(cases):
                continue
            numel, got, returned, unwaited = cases[salt][:4]
            if unwaited:
                return (
                    f"{world} ranks, {numel} elements: rank {rank} never waited on "
                    f"{len(unwaited)} handle(s), first {unwaited[0]}. Wait on every handle "
                    "(ok.p2p.wait_all): a receive not waited may never be written into its "
                    "tensor, and a send not waited may never arrive."
                )
            want, bounds, what = expected(world, rank, numel, salt, op)
            diff = _first_difference(got, want, bounds)
            if diff is None:
                continue
            failing.append(_kind(numel, world))
            if first is None:
                first = (rank, salt, numel, got, returned, want, bounds, what, diff)
            break
    if first is None:
        return None
    rank, salt, numel, got, returned, want, bounds, what, (i, chunk) = first
    lo, hi = bounds[chunk]
    message = (
        f"{world} ranks, {what} of {numel} elements: rank {rank}, chunk {chunk} "
        f"(elements {lo}-{hi - 1}) differs first at element {i}: expected "
        f"{want[i].item():g}, got {got[i].item():g}."
    )
    if returned is not None and torch.allclose(returned.reshape(-1).float(), want):
        return message + " You returned the right values: the operation must be in place."
    if op == "sum" and torch.allclose(got * world, want):
        return message + (
            f" That is the sum divided by {world}: you averaged; leave the sum in `tensor`."
        )
    if inputs is not None and torch.equal(got, inputs(world, numel, salt)[rank]) and numel > 1:
        return message + (
            " The whole tensor is exactly this rank's input: nothing was ever written into "
            "`tensor` on this rank. Either the result never reached it (was it sent back, "
            "and received into `tensor`?), or the function worked on a copy: work on a "
            "view, flat = tensor.view(-1) (a .clone(), or a reshape that copies, leaves "
            "`tensor` as it was)."
        )
    if inputs is not None:
        parts = [x[lo:hi] for x in inputs(world, numel, salt)]
        if op == "sum":
            m = _composition(got[lo:hi], parts)
            if m is not None:
                message += " " + _explain_composition(m, rank, pattern)
        if hi - lo <= 8:
            message += _inputs_line(parts, want[lo:hi], got[lo:hi])
    return message + _likely_cause(failing)


_SIZE_MISMATCH = (
    " A send and the receive it met disagree in size: in each step both ends must use the "
    "same chunk (send chunk (r-k-1) mod N to the right, receive (r-k-2) mod N from the left "
    "in reduce-scatter; (r-k) and (r-k-1) in all-gather), and an empty chunk must be skipped "
    "by both ends or by neither."
)


def _explain_failure(text: str) -> str:
    """A rank's error (or a crashed rank's last words) in the exercise's terms."""
    if "posted a receive of" in text or "data size doesn't match" in text:
        return _SIZE_MISMATCH
    return sealed_rank_hint(text)


def _explain_made_of(world: int):
    """_explain_failure, and for a process gloo stopped (a fatal check on sizes, which the
    check's size guard should have caught first): which sizes want padding."""

    def explain(text: str) -> str:
        if "Check failed" not in text:
            return _explain_failure(text)
        uneven = [n for n in _sizes(world) if n % world]
        return (
            " gloo stopped the rank: a collective got tensors whose sizes do not fit "
            f"together. Sizes {', '.join(map(str, uneven))} are not divisible by N = {world}: "
            "pad the tensor with zeros to a multiple of N before reduce_scatter_tensor, and "
            "drop the padding after the AllGather."
        )

    return explain


def _check(name, fn, runner, expected, world_sizes, op, from_scratch, timeout,
           inputs=None, made_of=None, pattern=None) -> Report:  # fmt: skip
    report = Report(name)
    extra = {"made_of": tuple(made_of)} if made_of else {}
    forbid = (answers_of("from_scratch") if from_scratch
              else answers_of("made_of") if made_of else ())  # fmt: skip
    given = expected, inputs
    for world in world_sizes:
        what = f"{name} on {world} ranks"
        seeds = _seeds(world)
        expected = functools.partial(given[0], seeds=seeds)
        inputs = None if given[1] is None else functools.partial(given[1], seeds=seeds)
        try:
            results = run_recorded(runner, fn, op, world_size=world, timeout=timeout,
                                   link=CHECK_LINK, forbid=forbid, payloads=pattern is not None,
                                   rank_kwargs=[_mine(seeds, r, world) for r in range(world)],
                                   **extra)  # fmt: skip
        except CaseError as exc:  # a value wrong before the error says more than the error
            done = [(exc.rank, exc.done, Traffic())]
            problem = _first_problem(done, world, expected, op, False, inputs, made_of, pattern)
            text = f"rank {exc.rank} raised {exc}"
            if made_of and not problem:
                problem = _made_of_failure(exc, world)
            report.fail(f"{what}: " + (problem or text + _explain_failure(str(exc))))
            return _stopped(report, name, world_sizes, world)
        except answers.AnswerRan as exc:
            # lab 01: the kit's whole AllReduce refused to run: say what the parts are
            report.fail(f"{what}: {exc}" + (f". Here {_HOW}, and no AllReduce." if made_of else ""))
            return _stopped(report, name, world_sizes, world)
        except Exception as exc:  # noqa: BLE001 - reported as the learner would want it
            explain = _explain_made_of(world) if made_of else _explain_failure
            report_failure(report, what, exc, timeout, explain)
            return _stopped(report, name, world_sizes, world)
        results = [(rank, cases, seen) for rank, (cases, seen) in enumerate(results)]
        problem = _first_problem(results, world, expected, op, from_scratch, inputs, made_of,
                                 pattern)  # fmt: skip
        problem = problem or _pattern_problem(results, world, pattern, inputs)
        if problem:
            report.fail(problem)
            # one clear reason at a time: fix it, then run the check again
            return _stopped(report, name, world_sizes, world)
        sizes = ", ".join(map(str, sorted(_sizes(world))))
        shape = {"ring": ", each rank sending only to its right neighbour, one chunk a step",
                 "root": ", through rank 0"}.get(pattern, "")  # fmt: skip
        report.ok(f"{world} ranks: correct on every rank for sizes {sizes}{shape}")
    return report


def _stopped(report: Report, name: str, world_sizes, world: int) -> Report:
    """The report of a check stopped at its case on ``world`` ranks: the cases after it
    (the other world sizes) count as failed, "not reached"."""
    later = list(world_sizes)[list(world_sizes).index(world) + 1 :]
    count_not_reached(report, [f"{name} on {w} ranks" for w in later])
    return report


def _made_of_failure(exc: CaseError, world: int) -> str | None:
    """The ✘ text for a case of an AllReduce made of parts that raised: the error, the
    learner's line, and, for a size that does not divide by N, what padding does."""
    if exc.numel is None:
        return None
    message = (
        f"a tensor of {exc.numel} elements: rank {exc.rank} raised {exc.error}{_learner_line(exc)}."
    )
    if exc.numel % world:
        return message + padding_advice(exc.numel, world)
    return message + _explain_failure(exc.error)


def check_all_reduce(fn, op: str = "sum", from_scratch: bool = True, world_sizes=WORLD_SIZES,
                     timeout: float = TIMEOUT_S, name: str | None = None,
                     made_of=None, pattern: str | None = None) -> Report:  # fmt: skip
    """Check an in-place AllReduce ``fn(tensor)`` (or ``fn(tensor, op=op)`` for op != "sum").

    ``made_of``: the collectives it must be built from, e.g. ``("reduce_scatter",
    "all_gather")``; each call must call every one of them (built-in or the kit's) and
    no AllReduce. ``pattern``: the messages it must send, as the lab teaches them:
    ``"ring"`` (each rank only to its right neighbour and from its left, one chunk of about
    S/N a step, 2(N−1) steps) or ``"root"`` (every other rank sends its tensor to rank 0
    and gets the sum back from it)."""
    unknown = set(made_of or ()) - set(PARTS)
    if unknown:
        raise ValueError(f"made_of: unknown part(s) {sorted(unknown)}; known: {sorted(PARTS)}")
    if pattern not in (None, "ring", "root"):
        raise ValueError(f"pattern: 'ring', 'root' or None, got {pattern!r}")

    def expected(world, rank, numel, salt, op, seeds):
        return _truth(world, numel, salt, op, seeds), chunk_bounds(numel, world), "a tensor"

    def inputs(world, numel, salt, seeds):
        return [_input(seeds[(r, salt)], numel, r, op) for r in range(world)]

    name = name or getattr(fn, "__name__", "all_reduce")
    return _check(name, fn, _run_all_reduce, expected, world_sizes, op, from_scratch, timeout,
                  inputs, made_of, pattern)  # fmt: skip


def check_reduce_scatter(fn, op: str = "sum", from_scratch: bool = True,
                         world_sizes=WORLD_SIZES, timeout: float = TIMEOUT_S,
                         name: str | None = None) -> Report:  # fmt: skip
    """Check ``fn(output, input)``: output on rank r = op over ranks of chunk r of input."""

    def expected(world, rank, per_rank, salt, op, seeds):
        full = _truth(world, per_rank * world, salt, op, seeds)
        return full[rank * per_rank : (rank + 1) * per_rank], [(0, per_rank)], "an output"

    name = name or getattr(fn, "__name__", "reduce_scatter")
    return _check(name, fn, _run_reduce_scatter, expected, world_sizes, op, from_scratch, timeout)


def check_all_gather(fn, from_scratch: bool = True, world_sizes=WORLD_SIZES,
                     timeout: float = TIMEOUT_S, name: str | None = None) -> Report:  # fmt: skip
    """Check ``fn(output, input)``: output = every rank's input, concatenated in rank order."""

    def expected(world, rank, per_rank, salt, op, seeds):
        want = torch.cat([_input(seeds[(r, salt)], per_rank, r) for r in range(world)])
        return want, [(r * per_rank, (r + 1) * per_rank) for r in range(world)], "an output"

    name = name or getattr(fn, "__name__", "all_gather")
    return _check(name, fn, _run_all_gather, expected, world_sizes, "sum", from_scratch, timeout)
