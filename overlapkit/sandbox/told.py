"""What the watch notes besides an answer's name, and what a learner is told about what it
saw: the exception a check raises (:class:`AnswerRan`) and its words (:func:`said`)."""

from __future__ import annotations

from .. import plaindata


@plaindata.allow  # raised on a rank, rebuilt by name in the caller
class AnswerRan(RuntimeError):
    """A rank ran the kit's own answer during the learner's function (one text argument,
    so that it travels back from a rank like any exception)."""

    @classmethod
    def on(cls, rank: int, ran: list[str]) -> AnswerRan:
        return cls(f"rank {rank} {said(ran)}")


#: what a watch notes when the learner's function took the watch away
TAMPERED = "sys.setprofile"

#: what a watch notes when the learner's code ran a process group's own operation
GROUP = "torch's {} (called on a process group directly)"


#: what :func:`traffic.recording` notes when the learner's code changed its record
RECORD = "traffic record"
#: what a check notes when a rank's watch was cut off (the rank ended with :data:`CUT`)
CUT_OFF = "watch cut off"


def cut_off(exc: BaseException) -> bool:
    """Whether a launch failed because a rank's watch was cut off (:data:`CUT`)."""
    return getattr(exc, "died", False) and getattr(exc, "exitcode", None) == CUT


def said(ran: list[str]) -> str:
    """What a learner is told about the answers ``ran`` (non-empty)."""
    if CUT_OFF in ran:
        return ("cut off the check's watch (its pipe out of the process closed or replaced, "
                "or its state interfered with), which ended the process: the check cannot see "
                "what ran, so it fails")  # fmt: skip
    if RECORD in ran:
        return ("changed the check's record of its messages (traffic.current()): the check "
                "cannot trust what it saw, so it fails")  # fmt: skip
    if TAMPERED in ran:
        return ("changed the profiler the check watches the kit's answers with "
                "(sys.setprofile / threading.setprofile): the check cannot see what ran, so "
                "it fails")  # fmt: skip
    groups = [r for r in ran if r.startswith("torch's ")]
    if groups:
        return (
            f"called {groups[0]}: a built-in collective or message by another door. Use "
            "ok.p2p for messages (and the kit's ops where the exercise allows them)"
        )
    first, *more = dict.fromkeys(ran)  # the first to start is the one called
    names = first + (f" (and {len(more)} more of the kit's functions)" if more else "")
    return (
        f"ran {names}, the kit's own answer (however it was reached: an alias, a subclass, a "
        "wrapper, a default argument or an edited copy runs the same code): write it yourself"
    )


#: the exit status of a rank whose watch could not send what it saw (its pipe closed or
#: replaced) or was interfered with (its generator closed or thrown into): no verdict
#: about that rank can be trusted, so the check fails
CUT = 87
