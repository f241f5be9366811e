"""Plans as typed data: one grammar for a pipeline's schedule, a fully sharded step (lab 12)
and a hybrid step (lab 14).

A plan is a list of steps, each a small frozen dataclass saying what is done and to which
micro-batch, unit or bucket, as ``torch.distributed.pipelining`` keeps a schedule as
``_Action``s. The labs write plans as text, one string a step. A :class:`Grammar` holds
the written forms of one kind of plan and is the one way between text and steps::

    kind       a step written                   the step
    PIPELINE   "F0", "B3"                       Action("F", 0), Action("B", 3)
    FSDP       "gather 2", "free 2", "finish"   UnitAction("gather", 2), ..., Finish()
    HYBRID     "F 0", "B 1 ready", "reduce 0",  Action("F", 0), Action("B", 1, ready=True),
               "flush", "finish"                Reduce(0), Flush(), Finish()

:meth:`Grammar.parse` reads a plan (a list of strings, or its text), raising
:class:`PlanSyntaxError` that names the step and the forms expected; :meth:`Grammar.show`
and :meth:`Grammar.texts` write it back (``parse(show(p)) == p``); :meth:`Grammar.mark`
writes it with one step in brackets, for a check's ✘ line to point at. Whether a plan that
reads well can *run* (a unit whole before it computes, a bucket reduced once) is each
runner's rule, not the grammar's: it knows the words, not the numbers in range.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

# --------------------------------------------------------------------------- the steps


@dataclass(frozen=True)
class Action:
    """A stage's compute step: ``op`` "F" (forward) or "B" (backward) of micro-batch
    ``micro``. ``ready`` (a hybrid plan's "B k ready"): that backward launches the stage's
    AllReduces as it fills each bucket."""

    op: str
    micro: int
    ready: bool = False

    def __str__(self) -> str:
        return write(self)

    __repr__ = __str__


@dataclass(frozen=True)
class UnitAction:
    """A fully sharded step's action on unit ``unit``: "gather", "wait", "forward",
    "backward", "free" or "reduce"."""

    op: str
    unit: int

    def __str__(self) -> str:
        return write(self)


@dataclass(frozen=True)
class Reduce:
    """Launch gradient bucket ``bucket``'s AllReduce now (a hybrid plan)."""

    bucket: int

    def __str__(self) -> str:
        return write(self)


@dataclass(frozen=True)
class Flush:
    """Wait until the whole pipeline has drained (a hybrid plan)."""

    def __str__(self) -> str:
        return write(self)


@dataclass(frozen=True)
class Finish:
    """Wait for every gradient reduction: the step's end (the optimizer steps next)."""

    def __str__(self) -> str:
        return write(self)


# --------------------------------------------------------------------------- the grammar


class PlanSyntaxError(ValueError):
    """A step that is written in none of its grammar's forms: ``index`` (0-based, None for
    a step read alone), its ``text``, and the forms ``expected``."""

    def __init__(self, index: int | None, text, expected: str):
        self.index, self.text, self.expected = index, text, expected
        where = f"{text!r}" if index is None else f"plan[{index}] {text!r}"
        super().__init__(f"{where}: expected {expected}")

    def __reduce__(self):  # pickled whole (a rank's error travels to the caller)
        return type(self), (self.index, self.text, self.expected)


@dataclass(frozen=True)
class Form:
    """One written form: ``template`` with ``{field}`` for each number (``"gather {unit}"``),
    the step's class, and the fields every step of this form has (``op="gather"``).
    ``shown``: listed among the forms expected (a form read only so that its runner can
    name what is wrong with it is not)."""

    template: str
    kind: type
    fixed: tuple = ()
    shown: bool = True

    def pattern(self) -> re.Pattern:
        parts = re.split(r"\{(\w+)\}", self.template)
        regex = "".join(re.escape(p) if i % 2 == 0 else rf"(?P<{p}>-?\d+)"
                        for i, p in enumerate(parts))  # fmt: skip
        return re.compile(regex)

    def fits(self, step) -> bool:
        return type(step) is self.kind and all(getattr(step, k) == v for k, v in self.fixed)


class Grammar:
    """The written forms of one kind of plan. ``letters``: how a number's field is shown in
    the forms expected (``{"unit": "K"}`` shows "gather K"); ``sep``: between the steps of
    a plan written on one line."""

    def __init__(self, name: str, forms: list[Form], letters: dict[str, str], sep: str):
        self.name, self.forms, self.letters, self.sep = name, tuple(forms), letters, sep
        self._patterns = [(f, f.pattern()) for f in self.forms]

    def __repr__(self) -> str:
        return f"plans.{self.name}"

    # ------------------------------------------------------------ reading
    def expected(self, joined: str = "or") -> str:
        """The forms, shown: ``'gather K', 'wait K', … or 'finish'`` (``joined`` "," lists
        them all with commas)."""
        shown = [repr(re.sub(r"\{(\w+)\}", lambda m: self.letters[m[1]], f.template))
                 for f in self.forms if f.shown]  # fmt: skip
        if joined == ",":
            return ", ".join(shown)
        return f"{', '.join(shown[:-1])} {joined} {shown[-1]}" if len(shown) > 1 else shown[0]

    def parse_step(self, text, index: int | None = None):
        """One step from its text (words apart by any spaces); a step of this grammar's
        kinds passes as it is."""
        if any(f.fits(text) for f in self.forms):
            return text
        if isinstance(text, str):
            words = " ".join(text.split())
            for form, pattern in self._patterns:
                found = pattern.fullmatch(words)
                if found:
                    numbers = {k: int(v) for k, v in found.groupdict().items()}
                    return form.kind(**dict(form.fixed), **numbers)
        raise PlanSyntaxError(index, text, self.expected())

    def parse(self, plan) -> list:
        """Every step of ``plan``: a list of steps or strings, or the text :meth:`show`
        writes. Raises :class:`PlanSyntaxError` at the first step in no form."""
        if isinstance(plan, str):
            plan = plan.split() if self.sep == " " else [t for t in plan.split(",") if t.strip()]
        return [self.parse_step(step, i) for i, step in enumerate(plan)]

    # ------------------------------------------------------------ writing
    def show_step(self, step) -> str:
        form = next((f for f in self.forms if f.fits(step)), None)
        if form is None:
            raise ValueError(f"{step!r} has no form in {self!r}")
        return form.template.format(**{f.name: getattr(step, f.name) for f in fields(step)})

    def texts(self, plan) -> list[str]:
        """The plan as the labs write it: one string a step."""
        return [self.show_step(step) for step in plan]

    def show(self, plan) -> str:
        """The plan on one line (:meth:`parse` reads it back)."""
        return self.sep.join(self.texts(plan))

    def mark(self, plan, at: int, around: int = 4) -> str:
        """The plan on one line with step ``at`` (0-based) in brackets, ``around`` steps
        either side of it and "…" for the rest: where a check found the first broken rule.
        Steps that are not of this grammar (a learner's text) are written as they are;
        ``at == len(plan)`` marks the place after the last step."""
        plan = list(plan)
        shown = [self._written(step) for step in plan] + ([""] if at == len(plan) else [])
        shown[at] = f"[{shown[at]}]" if shown[at] else "[ ]"
        lo, hi = max(0, at - around), min(len(shown), at + around + 1)
        return (
            ("… " if lo else "") + self.sep.join(shown[lo:hi]) + (" …" if hi < len(shown) else "")
        )

    def _written(self, step) -> str:
        if isinstance(step, str):
            return step
        return self.show_step(step) if any(f.fits(step) for f in self.forms) else repr(step)


def _compute(template: str, op: str, ready: bool = False, shown: bool = True) -> Form:
    return Form(template, Action, (("op", op), ("ready", ready)), shown)


PIPELINE = Grammar("PIPELINE", [_compute("F{micro}", "F"), _compute("B{micro}", "B")],
                   {"micro": "k"}, " ")  # fmt: skip

_UNIT_OPS = ("gather", "wait", "forward", "backward", "free", "reduce")
FSDP = Grammar(
    "FSDP",
    [
        *(Form(f"{op} {{unit}}", UnitAction, (("op", op),)) for op in _UNIT_OPS),
        Form("finish", Finish),
    ],
    {"unit": "K"},
    ", ",
)

HYBRID = Grammar(
    "HYBRID",
    [_compute("F {micro}", "F"), _compute("B {micro}", "B"), _compute("B {micro} ready", "B", True),
     # read so that its runner can say that only a backward launches AllReduces
     _compute("F {micro} ready", "F", True, shown=False),
     Form("reduce {bucket}", Reduce), Form("flush", Flush), Form("finish", Finish)],
    {"micro": "k", "bucket": "b"},
    ", ",
)  # fmt: skip

GRAMMARS = (PIPELINE, FSDP, HYBRID)


def write(step) -> str:
    """A step in the first grammar that has a form for it (a forward or backward as the
    pipeline writes it, "F0"; one with ``ready`` as a hybrid plan does)."""
    grammar = next((g for g in GRAMMARS if any(f.fits(step) for f in g.forms)), None)
    return grammar.show_step(step) if grammar is not None else repr(step)


# --------------------------------------------------------------------------- schedules


def format_schedule(schedule) -> str:
    """One line per stage: ``stage 0: F0 F1 B0 F2 B1 …``."""
    return "\n".join(f"stage {s}: {PIPELINE.show(acts)}" for s, acts in enumerate(schedule))


def parse_schedule(schedule) -> list[list[Action]]:
    """Each stage's actions from :func:`format_schedule`'s text, or from one list of
    strings (or actions) per stage."""
    if not isinstance(schedule, str):
        return [PIPELINE.parse(stage) for stage in schedule]
    out = []
    for s, line in enumerate(schedule.splitlines()):
        head, _, rest = line.partition(":")
        if head.split() != ["stage", str(s)]:
            raise PlanSyntaxError(s, line, f"'stage {s}: ' and stage {s}'s actions")
        out.append(PIPELINE.parse(rest))
    return out


# --------------------------------------------------------------------------- verdicts


class Problem(str):
    """A broken rule in words (a ``str``) and the step it broke at: ``at``, 0-based, or
    None where no one step did (a plan that ends too soon)."""

    at: int | None

    def __new__(cls, text: str, at: int | None = None):
        self = super().__new__(cls, text)
        self.at = at
        return self
