"""Every lab reads the same way: it opens with what you will learn, what you need and the
time; closes with a recap and what comes next; reports no runs but its own; uses the
glossary's terms; and every link it gives (to the book, to another lab) arrives."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: prose that reports other runs than the notebook's own
RUN_LOG = re.compile(
    r"\bfrom \d+ runs\b|\bof the \d+ runs\b|\ba learner saw\b|\bload at\b|\b\d+ runs\b", re.I
)
#: one term per idea: the glossary's word, not these
SYNONYMS = re.compile(r"\bhidden share\b|\bdp hidden\b|\bcards?\b", re.I)


def _markdown(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "markdown"]


def _ids(p: Path) -> str:
    return p.stem[:2]


@pytest.mark.parametrize("solution", SOLUTIONS, ids=_ids)
def test_a_lab_opens_with_what_you_learn_need_and_the_time_and_closes_with_a_recap_and_next(
    solution,
):
    cells = _markdown(solution)
    opening, closing = cells[0], cells[-1]
    for part in ("What you will learn", "What you need", "Time"):
        assert f"**{part}" in opening, f"{solution.name}: the first cell has no **{part}**"
    assert re.search(r"\(estimate\)", opening), (
        f"{solution.name}: the time is not marked an estimate"
    )
    assert "Recap" in closing and "**Next" in closing, (
        f"{solution.name}: no Recap and Next at the end"
    )


@pytest.mark.parametrize("solution", SOLUTIONS, ids=_ids)
def test_a_labs_prose_reports_no_run_but_its_own_and_uses_the_glossarys_terms(solution):
    for i, text in enumerate(_markdown(solution)):
        found = RUN_LOG.search(text) or SYNONYMS.search(text)
        assert found is None, f"{solution.name}, markdown cell {i}: {found.group(0)!r}"


def _slug(heading: str) -> str:
    """The anchor GitHub and MyST (myst_heading_anchors) give a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    lines = page.read_text(encoding="utf-8").splitlines()
    return {_slug(x.lstrip("#")) for x in lines if re.match(r"#{1,6} ", x)}


@pytest.mark.parametrize("solution", SOLUTIONS, ids=_ids)
def test_every_link_in_a_lab_arrives(solution):
    for text in _markdown(solution):
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # the web, and the notebook's own headings
            path, _, anchor = target.partition("#")
            page = (solution.parent / path).resolve()
            assert page.exists(), f"{solution.name} links to {target}: no such file"
            if anchor and page.suffix == ".md":
                assert anchor in _anchors(page), (
                    f"{solution.name} links to {target}: no such heading"
                )


def _minutes(pattern: str, text: str, where: str) -> int:
    found = re.search(pattern, text)
    assert found, f"{where}: no time estimate ({pattern})"
    return int(found.group(1))


@pytest.mark.parametrize("solution", SOLUTIONS, ids=_ids)
def test_a_labs_time_is_one_figure_in_the_lab_the_guide_and_the_readme(solution):
    lab = solution.stem[:2]
    opening = _markdown(solution)[0]
    in_lab = _minutes(r"\*\*Time:\*\* about (\d+) minutes", opening, solution.name)
    guide = (ROOT / "book" / "instructors" / f"lab{lab}.md").read_text(encoding="utf-8")
    in_guide = _minutes(r"\*\*Estimate: (\d+) minutes", guide, f"lab{lab}.md")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    in_readme = _minutes(rf"\n\| {lab} \|[^\n]*\| (\d+) min \|", readme, "README.md's lab map")
    assert in_lab == in_guide == in_readme, (
        f"lab {lab}: {in_lab} min in the lab, {in_guide} in its guide, {in_readme} in the README"
    )
