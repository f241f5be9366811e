"""The mistakes that recur across labs, each worded once: an operation never waited for,
and a collective not the kit's where the lab's messages must cross the emulated link.

Each returns the ✘ line's text (after ``what: `` where a check names its case); what to
do about it is the lab's own (``advice``), since each lab teaches its own way out.
"""

from __future__ import annotations

#: what to do about an operation never waited for, as the labs say it
WAIT_FOR_EVERY_ONE = "wait for every one before using what it delivers (and before returning)"
WAIT_BEFORE_READING = (
    "call .wait() on every handle before reading what it delivers, and before returning"
)
WAIT_BEFORE_READING_THE_TENSOR = (
    "call .wait() on every handle before reading the tensor it delivers, and before returning"
)


def never_waited(what: str, rank: int, unwaited: list[str], advice: str, read: str = "") -> str:
    """A rank left ``unwaited`` operations (their descriptions) unwaited; ``read``: what it
    read meanwhile, when that says more."""
    return (
        f"{what}: rank {rank} never waited for {len(unwaited)} operation(s), e.g. "
        f"{unwaited[0]}{read}: {advice}"
    )


def not_over_the_link(rank: int, called: str, advice: str, counted: str = "") -> str:
    """A rank called ``called`` (not the kit's messages) where the lab's messages cross the
    emulated link: ``advice`` says what to use; ``counted``: what else the kit's messages
    are for here (ends with ", and ")."""
    return (
        f"rank {rank} called {called}: {advice} ({counted}only the kit's messages travel "
        "over the emulated link)"
    )


def bypasses_the_link(rank: int, called: str, use: str, so: str) -> str:
    """A rank called a built-in collective where the lab's AllReduce is the kit's ``use``:
    its bytes never cross the emulated link, ``so`` says what that takes away."""
    return (
        f"rank {rank} called {called}: use {use}. The built-in's bytes bypass the emulated link{so}"
    )
