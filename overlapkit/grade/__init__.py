"""Score student notebooks: ``python -m overlapkit.grade NOTEBOOK.ipynb|FOLDER [...]``.

For each notebook:

1. Find the lab it was made from (same file name in the kit's ``labs/``, or ``--labs``)
   and read the lab's check cells there: ``ok.grading.check_NAME(fn, ...)``. Those, not
   the student's, are what is run; a check cell the student edited or deleted gives that
   exercise 0, with the reason.
2. Execute the student's cells (without the check cells) in a fresh kernel, with a time
   limit per cell (a hanging cell is interrupted; the launcher then stops its ranks) and
   one for the whole notebook; errors do not stop the run.
3. Take each exercise's function or class out of the kernel with cloudpickle and run the
   lab's original check on it in a fresh Python process (so nothing the notebook did to
   ``ok`` or ``ok.grading`` in its kernel counts), with a time limit.
4. Score: an exercise earns its points (``ok.grading.POINTS``) times the share of the
   check's cases that passed. A notebook that binds ``ok`` or ``grading`` to something
   else than the kit gets 0 for every exercise, with that reason.

Prints JSON (one object per notebook; a list for several), or with ``--format
gradescope`` writes Gradescope's ``results.json``. Exits 0 whenever grading ran,
whatever the score.
"""

from __future__ import annotations

from .cli import main
from .labs import exercises_of
from .notebook import grade_notebook

__all__ = ["grade_notebook", "exercises_of", "main"]
