"""The kit's own answers, recognised by their code running, whatever name reached them.

Most exercises have a twin in the kit: lab 03's ring is ``ok.ring_all_reduce``, lab 06's
``HookDDP`` is ``ok.OverlapDDP``, lab 00's fit is ``ok.costmodel.fit_alpha_beta`` (and the
checks' own references are answers too). A check that replaced the answer on one module
would miss every other way to it::

    ok.ddp.ring_all_reduce(t)            # another module imported it by name
    class HookDDP(ok.OverlapDDP): pass   # a subclass runs the same methods
    f.__wrapped__, def f(x, g=ok.…): …   # a wrapper's original, a keyword default

All of them run the same *code objects*. So a check watches those (the answer's functions,
its classes' methods, and the functions nested in them) while the learner's function
runs, and fails it when one starts: in the calling thread, in threads started meanwhile
(``_thread``'s too), and in the kit's communication workers (an async op runs its task
under the caller's watch, see ``ordering.worker_code``). A copy compiled anew from the
kit's source is recognised by what its code does (:func:`_key`); a copy edited a little
(unused lines added, names changed, a code object renamed) by how much
of the answer's instructions it holds, in order (:func:`_copy_of`). That takes an answer
long enough that honest work never reads like it (:data:`COPY_MIN_TOKENS`): the short
ones (lab 07's greedy bucket loop, a byte count, a memory formula, lab 09's average) are
written the same way by everyone, our own solutions included, and a copy of those is
not told from the work.

A check names the answers to watch (the checks list them once, with their exercises), by
dotted name under ``overlapkit``: a module (every function and class defined in it), a
class (its methods, properties, static and class methods), or a function; "!name" leaves
one out.

The watch also notes two things an exercise never needs: the learner's code changing the
profiler (``sys.setprofile``, ``threading.setprofile``), and calling an operation of a
torch process group itself (``group.allreduce``, also on a group made outside torch's
registry, which no sequence number counts).

On a check's rank the verdict is not the rank's to give. The watch sends what it sees out
of the process the moment it sees it, on the rank's channel to the caller
(``overlapkit.rankhook.channel``)::

    rank: learner's call ──► watch (profile fn) ──► pipe ──► check: which answers ran?
           an answer by identity: its name      ─┘           judged here, from the pipe:
           a code object that may be a copy: its marshal ─┘   key match, edited copy

so what the rank's code does afterwards to its own report (the lists it returns, the
builtins that build them) takes nothing back. The watch's state is out of that code's
reach, and a watch that was cut off ends the process (:func:`_watch`).

A profile function only sees the threads it was given; so, meanwhile, the answers are
also *disarmed*: each of their functions gets code that refuses to run (it notes the
answer and raises :class:`AnswerRan`) until the learner's call is over. That reaches every
thread of the process (one the watch never saw: ``_thread.start_new_thread``, a pool
started before the check) and every process forked from it, whatever turned the watch off.
Honest work never runs an answer while it is watched (the watch would fail it), so the
refusal takes nothing from it.

Each part has a module of its own: :mod:`.codes` (an answer's name to its code objects),
:mod:`.copies` (a copy told from the work), :mod:`.origins` (whose code a frame runs),
:mod:`.disarm` (the answers refusing to run), :mod:`.watch` (the watch itself),
:mod:`.sightings` (what a rank's watch sends out, and how the check reads it) and
:mod:`.told` (what a learner is told). This module keeps every name the checks and tests
use from here; which answers each check forbids, the checks say (``grading.exercises``).
"""

from __future__ import annotations

# the names the checks, the guard and the tests use from here (each keeps its one home)
from .codes import code_objects  # noqa: F401
from .copies import COPY_MIN_TOKENS, _copy_of, _token_count, _tokens, _tokens_of  # noqa: F401
from .disarm import _disarmed, refused  # noqa: F401
from .origins import _trusted, library  # noqa: F401
from .sightings import code_made_meanwhile, seen_by_watches  # noqa: F401
from .told import CUT, CUT_OFF, GROUP, RECORD, TAMPERED, AnswerRan, cut_off, said  # noqa: F401
from .watch import _raw_threads_watched, between_blocks, hide, running  # noqa: F401
