"""The sandbox: where a learner's code runs while a check judges it, and what it may not do
there. It plugs into the kit through :class:`overlapkit.RankHook` (modules the ranks
preload, a context around the learner's function on each rank, the rank's channel to the
caller) and through public counts (``ok.p2p.stats()``, ``ok.ordering.issued()``); the
kit's core never imports it.

Threat model: a learner who has read the kit's source and wants a ✔ without doing the
exercise. Inside one process the sandbox raises the cost of cheating; it is not a
security boundary. For graded work, run each submission in a container of its own (the
grader's guide says how); nothing here replaces that.

==================  =========================================================================
module              what it keeps the learner's code from doing
==================  =========================================================================
:mod:`.answers`     running the kit's own answer to the exercise, by any name, on any thread,
                    or a copy of it (compiled anew, renamed, edited): each check's answers;
                    the *watch* (:mod:`.watch`) and its parts: :mod:`.codes` (an answer's
                    code objects), :mod:`.copies` (a copy told from the work), :mod:`.origins`
                    (whose code a frame runs), :mod:`.disarm` (answers that refuse to run),
                    :mod:`.sightings` (what a rank's watch sends out), :mod:`.told` (what the
                    learner is told)
:mod:`.sealed`      running code in the *judge*: a learner's function travels as sealed bytes
                    that unpickle only on a rank; a single-process exercise runs in a process
                    of its own; an audit hook (PEP 578) guards the call; the watches open
                    when it starts go with it to its rank (:mod:`.forwarded`)
:mod:`.nosockets`   opening a channel of its own between ranks (Linux seccomp)
:mod:`.nofiles`     sharing a file with the other ranks (Linux Landlock, 5.13 or later)
:mod:`.witness`     typing in numbers a lab asks to be measured: the grader measures them in
                    a process the kernel cannot reach
:mod:`.records`     the notes a lab's helpers leave of what they measured in a notebook
:mod:`.preload`     (what the checks' ranks inherit from the forkserver)
==================  =========================================================================

Where Linux lacks seccomp or Landlock (macOS, old kernels, some containers) those two layers
are skipped and the check says nothing of it; the rest holds everywhere.

Glossary (one word per thing):

learner
    whoever writes the exercise, in a notebook or a graded submission.
check
    ``ok.grading.check_*``: runs the learner's function on private cases and prints one
    ✔/✘ line per case.
judge
    the grader's process that runs one check on a submission (``python -m
    overlapkit.grade``); no code of the learner's runs in it.
watch
    the profile function that notes the kit's answers starting while a learner's function
    runs, and sends what it sees out of the rank at once.
guard
    the audit hook around a learner's call: it refuses switching the watch off, giving a
    function other code, opening the kit's files.
answer
    kit code that solves an exercise (``ok.ring_all_reduce`` for lab 03's ring); a check
    forbids its own.
"""
