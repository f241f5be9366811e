"""Score student notebooks: ``python -m overlapkit.grade NOTEBOOK.ipynb|FOLDER [...]``.

For each notebook:

1. Find the lab it was made from (``--lab NN``, else the metadata ``make labs`` stamps in,
   else its file name: :func:`labs.identify`) and read the lab's check cells there:
   ``ok.grading.check_NAME(fn, ...)``. Those, not the student's, are what is run; a check
   call the student changed or deleted gives that exercise 0 with the reason (cells are
   compared by their parsed code: formatting and comments do not matter).
2. Execute the student's cells (without the check cells) in a fresh kernel in a folder of
   its own, with a limit per cell and one for the notebook (:mod:`.kernel`: a kernel that
   ignores the interrupt is ended with its process group; every process it left is ended).
3. Save each exercise's object, and run the lab's original check on it in an isolated
   judge process (:mod:`.judge`), with a limit.
4. Score: an exercise earns its points (``ok.grading.POINTS``) times the share of the
   check's cases that passed.

**Threat model**: a student who has read the kit's source and the lab. Student code never
runs in the process that decides a verdict: the judge starts with ``python -I`` in an empty
folder and imports the kit first; it never unpickles the student's objects (functions stay
sealed bytes that unpickle only on ranks; a single-process exercise is called on a rank of
its own, :mod:`overlapkit.sandbox.sealed`; data is read with PyTorch's weights-only
loader); ranks' values and exceptions come back as plain data
(:mod:`overlapkit.plaindata`); the report travels over a pipe only the judge holds, with a
secret the grader sent it, from a process other processes of the user may not inspect.
Not covered: student code runs as the grader's user, so it *can* rewrite the kit, the
labs or the Python environment; the grader notices that (:mod:`.tamper`) and stops with
exit status 3, but the defence is to run the kernel where it cannot write them (a
container per submission, as Gradescope does, or a user of its own). While the student's
code runs on a check's rank, the rank opens no socket (:mod:`overlapkit.sandbox.nosockets`):
no process group of the student's own carries data past the kit's records. Verdicts that
rest on what a rank reports about itself (its traffic, its timings) are as honest as the
code on that rank; the checks cross-check them where they can (values moved, payloads,
counts on both ends), and files the ranks share stay a channel a rank could use.

Writes JSON (one object per notebook; a list for several), Gradescope's ``results.json``
(one per submission) or a CSV gradebook. Exits 0 whenever grading ran, whatever the
score; 2 on bad input; 3 when a notebook changed the grader's files.
"""

from __future__ import annotations

from .cli import main
from .labs import exercises_of
from .notebook import grade_notebook

__all__ = ["grade_notebook", "exercises_of", "main"]
