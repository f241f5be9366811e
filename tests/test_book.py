"""The course book: what each edition shows, and every page opened in Chromium, offline.

The browser test builds both editions from the notebooks this test run executed (nbval's
kernels leave them in build/executed/, see tests/executed_copies.py), so it runs after them
(conftest orders it last) and waits for any still running on another worker.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.server
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest

from overlapkit import bookgen
from overlapkit.labgen import has_exercise, make_lab
from tests import executed_copies
from tests.conftest import EXECUTED

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WAIT_LIMIT_S = 900  # for notebooks still running on other workers


def _with_outputs(nb):
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"out {i}\n")]
    return nb


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem[:2])
def test_the_students_view_of_a_lab_shows_no_answer_nor_a_printout_that_gives_it(solution):
    executed = _with_outputs(nbformat.read(solution, as_version=4))
    view = bookgen.students_view(executed)
    lab = make_lab(nbformat.read(solution, as_version=4), solution.name)
    expected = [
        bookgen.withheld(c.source, "")
        if c.cell_type == "markdown" and bookgen.AFTER_CHECK in c.metadata.get("tags", [])
        else c.source
        for c in lab.cells
    ]
    assert [c.source for c in view.cells] == expected
    for original, shown in zip(executed.cells, view.cells, strict=True):
        if original.cell_type != "code":
            continue
        answer = has_exercise(original.source) or "BEGIN HIDDEN TESTS" in original.source
        answer = answer or "ok.grading." in original.source  # its ✔ lines judged the answer
        # a cell whose printout gives the answer away keeps its figures (these are text)
        answer = answer or bookgen.ANSWER_OUTPUT in original.metadata.get("tags", [])
        assert shown.outputs == ([] if answer else original.outputs), original.source[:80]


def test_text_that_explains_an_answer_is_left_out_of_the_students_book_only():
    text = "The rule: stage $s$ runs $\\min(p - s - 1, m)$ forwards."
    cell = nbformat.v4.new_markdown_cell(text, metadata={"tags": [bookgen.AFTER_CHECK]})
    nb = nbformat.v4.new_notebook(cells=[cell])
    assert bookgen.students_view(nb).cells[0].source == bookgen.WITHHELD
    assert bookgen.instructors_view(nb).cells[0].source == text
    heading = nbformat.v4.new_markdown_cell("## 3. x", metadata={"tags": [bookgen.AFTER_CHECK]})
    with pytest.raises(ValueError, match="heading"):
        bookgen.students_view(nbformat.v4.new_notebook(cells=[heading]))


def test_every_explanation_of_an_answer_is_tagged_where_it_can_be_left_out():
    tagged = [
        (s.stem, i)
        for s in SOLUTIONS
        for i, c in enumerate(nbformat.read(s, as_version=4).cells)
        if bookgen.AFTER_CHECK in c.metadata.get("tags", [])
    ]
    assert len(tagged) >= 2, tagged  # labs 04 and 08 explain their exercises' answers
    for stem, i in tagged:
        nb = nbformat.read(ROOT / "solutions" / f"{stem}.ipynb", as_version=4)
        assert nb.cells[i].cell_type == "markdown", (stem, i)
        bookgen.students_view(nb)  # raises on a tagged heading


def test_the_students_book_keeps_the_words_of_a_link_to_an_instructors_page_not_the_link():
    text = (
        "see [Grading](grading.md#limits), the [instructors' part](instructors/index.md), "
        "[the notes](notes/index.md) and [PyTorch](https://pytorch.org/instructors/x)"
    )
    assert bookgen._unlinked(text) == (
        "see Grading (in the instructors' edition), the instructors' part, "
        "[the notes](notes/index.md) and [PyTorch](https://pytorch.org/instructors/x)"
    )


def test_a_page_shows_paths_inside_the_checkout_not_the_machines_own():
    cell = nbformat.v4.new_code_cell("print(path)")
    text = "/tmp/x/solutions/lab10-traces/a.json\n/home/me/kit/overlapkit/_rank.py:2: Warning\n"
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
    nb = nbformat.v4.new_notebook(cells=[cell])
    shown = bookgen.students_view(nb).cells[0].outputs[0].text
    assert shown == "labs/lab10-traces/a.json\noverlapkit/_rank.py:2: Warning\n"
    assert bookgen.instructors_view(nb).cells[0].outputs[0].text.startswith("solutions/lab10")


def test_the_instructors_view_keeps_the_answers_without_the_test_runs_directives():
    solution = next(s for s in SOLUTIONS if "# NBVAL_IGNORE_OUTPUT" in s.read_text())
    view = bookgen.instructors_view(nbformat.read(solution, as_version=4))
    text = "\n".join(c.source for c in view.cells)
    assert "### BEGIN SOLUTION" in text and "NBVAL_IGNORE_OUTPUT" not in text


def test_a_changed_solution_is_executed_again(tmp_path):
    solution = tmp_path / "00_x.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)")])
    nbformat.write(nb, solution)
    copy_path = tmp_path / "executed" / solution.name
    assert not bookgen.is_current(copy_path, solution)
    bookgen.mark_executed(nb, solution, "test")
    copy_path.parent.mkdir()
    nbformat.write(nb, copy_path)
    assert bookgen.is_current(copy_path, solution)
    solution.write_text(solution.read_text().replace("print(1)", "print(2)"))
    assert not bookgen.is_current(copy_path, solution)


def _tiny_book(tmp_path) -> tuple[Path, Path]:
    book = tmp_path / "book"
    for page in ("intro.md", "glossary.md", "grading.md", "notes/01-collectives.md",
                 "instructors/index.md", "instructors/lab00.md"):  # fmt: skip
        (book / page).parent.mkdir(parents=True, exist_ok=True)
        (book / page).write_text(f"# {page}\n")
    (book / "conf.py").write_text("")
    executed = tmp_path / "executed"
    executed.mkdir()
    nbformat.write(
        _with_outputs(nbformat.read(SOLUTIONS[0], as_version=4)), executed / SOLUTIONS[0].name
    )
    return book, executed


def test_the_students_edition_leaves_out_the_instructors_pages(tmp_path):
    book, executed = _tiny_book(tmp_path)
    bookgen.stage("students", executed, tmp_path / "s", book)
    bookgen.stage("instructors", executed, tmp_path / "i", book)
    assert (
        not (tmp_path / "s/book/instructors").exists()
        and not (tmp_path / "s/book/grading.md").exists()
    )
    assert not (tmp_path / "s/book/conf.py").exists()
    assert "For instructors" not in (tmp_path / "s/index.md").read_text()
    index = (tmp_path / "i/index.md").read_text()
    assert "book/instructors/lab00" in index and "book/grading" in index
    assert f"labs/{SOLUTIONS[0].stem}" in (tmp_path / "s/index.md").read_text()
    lab = (tmp_path / "s/labs" / SOLUTIONS[0].name).read_text()
    assert "### BEGIN SOLUTION" not in lab


def _figure_cell(name: str, alt: str = "two bars"):
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()
    metadata = {"mystnb": {"image": {"alt": alt}}, "overlapkit": {"figure": name}}
    cell = nbformat.v4.new_code_cell("draw()", metadata=metadata)
    cell.outputs = [
        nbformat.v4.new_output("display_data", data={"image/png": png, "image/svg+xml": "<svg/>"})
    ]
    return cell


def test_every_figure_is_exported_as_svg_and_png_with_its_alt_text(tmp_path):
    cell = _figure_cell("ring")
    executed = tmp_path / "executed"
    executed.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), executed / "03_ring.ipynb")
    assert bookgen.export_figures(executed, tmp_path / "figures") == 1
    folder = tmp_path / "figures/lab03"
    assert (folder / "cell00-1.svg").read_text() == "<svg/>"
    assert (folder / "cell00-1.png").read_bytes().startswith(b"\x89PNG")
    assert "two bars" in (folder / "README.md").read_text()


def test_a_notes_page_shows_a_named_lab_figure_with_the_labs_alt_text(tmp_path):
    views = {"07_bucketing": nbformat.v4.new_notebook(cells=[_figure_cell("sweep")])}
    named = bookgen.named_figures(views, tmp_path)
    assert (tmp_path / "sweep.svg").read_text() == "<svg/>"
    page = "Text.\n\n```{figure} figures/sweep.*\n:width: 100%\n\nThe sweep.\n```\n"
    shown = bookgen.with_alt_text(page, named, "notes/02.md")
    assert "```{figure} figures/sweep.*\n:alt: two bars\n:width: 100%\n" in shown


def test_a_notes_figure_no_lab_page_draws_fails_the_build_naming_page_and_figure():
    page = "```{figure} figures/bubble.*\n\nThe bubble.\n```\n"
    with pytest.raises(ValueError, match=r"notes/03\.md shows figure 'bubble'"):
        bookgen.with_alt_text(page, {"sweep": "two bars"}, "notes/03.md")


def test_a_figure_name_given_twice_fails_naming_both_cells(tmp_path):
    views = {
        "07_bucketing": nbformat.v4.new_notebook(cells=[_figure_cell("sweep")]),
        "12_fully_sharded": nbformat.v4.new_notebook(cells=[_figure_cell("sweep")]),
    }
    with pytest.raises(ValueError, match=r"07_bucketing, cell 0 and in 12_fully_sharded, cell 0"):
        bookgen.named_figures(views, tmp_path)


def test_every_figure_the_notes_show_is_named_once_in_a_solution_cell_with_alt_text():
    named = {}
    for solution in SOLUTIONS:
        for i, cell in enumerate(nbformat.read(solution, as_version=4).cells):
            name = cell.metadata.get("overlapkit", {}).get(bookgen.FIGURE_KEY)
            if name:
                assert name not in named, f"{name!r}: {named.get(name)} and {solution.name}"
                assert bookgen._alt(cell), f"{solution.name}, cell {i}: {name!r} has no alt text"
                named[name] = solution.name
    asked = {
        page.name: bookgen._FIGURE.findall(page.read_text(encoding="utf-8"))
        for page in (ROOT / "book/notes").glob("*.md")
    }
    missing = {page: set(names) - set(named) for page, names in asked.items()}
    assert not any(missing.values()), missing
    chapters = [page for page in asked if page != "index.md"]
    assert all(asked[page] for page in chapters), {p: len(asked[p]) for p in chapters}


def test_a_student_notebook_carries_no_figure_name():
    lab = make_lab(nbformat.v4.new_notebook(cells=[_figure_cell("sweep")]))
    assert "overlapkit" not in lab.cells[0].metadata


# ---- the built book, in Chromium ----------------------------------------------------------


def _executed_copies_or_skip() -> None:
    """Wait for this run's notebooks (other workers execute them); without them in this run,
    use copies left by an earlier one when current."""
    running = executed_copies.collected()
    deadline = time.monotonic() + WAIT_LIMIT_S
    while True:
        missing = [s for s in SOLUTIONS if not bookgen.is_current(EXECUTED / s.name, s)]
        failed = [
            s.name for s in missing if executed_copies.failed_marker(EXECUTED, s.name).exists()
        ]
        if not missing:
            return
        if failed:
            pytest.skip(f"no book: {', '.join(failed)} failed under nbval in this run")
        if not {s.name for s in missing} <= running:
            names = ", ".join(s.name for s in missing)
            pytest.skip(f"no current executed copy of {names}: run the tests with "
                        "`--nbval solutions` (as `make test` does) or `make book`")  # fmt: skip
        if time.monotonic() > deadline:
            pytest.fail(f"{len(missing)} notebooks still not executed after {WAIT_LIMIT_S} s")
        time.sleep(2)


def _image_outputs_of(cell) -> int:
    return sum("image/png" in o.get("data", {}) for o in cell.get("outputs", []))


def _image_outputs(nb) -> int:
    return sum(_image_outputs_of(c) for c in nb.cells)


def _built(edition: str, folder: Path) -> Path:
    """One edition of the book, built from this run's executed notebooks."""
    _executed_copies_or_skip()
    cmd = [sys.executable, "-m", "overlapkit.bookgen", "--no-execute", "--edition", edition,
           "--out", str(folder / "book")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return folder / "book" / edition


@contextlib.contextmanager
def _served(site: Path):
    """The built book over HTTP on 127.0.0.1, as a web server would publish it."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


#: the least pages an edition has: its labs and book pages (the instructors': a guide per lab)
LEAST_PAGES = {"students": len(SOLUTIONS) + 3, "instructors": 2 * len(SOLUTIONS) + 3}


@pytest.mark.browser
@pytest.mark.timeout(WAIT_LIMIT_S + 300)
@pytest.mark.parametrize("edition", bookgen.EDITIONS)  # each on a worker of its own
def test_every_page_of_the_book_opens_offline_with_every_figure(edition, tmp_path):
    pytest.importorskip("playwright.sync_api")
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed: run `make browser-deps`, as CI does")
    from playwright.sync_api import sync_playwright

    site = _built(edition, tmp_path)
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage"])  # fmt: skip
        try:
            with _served(site) as url:
                report = _open_every_page(chromium, site, url, edition)
        finally:
            chromium.close()
    print(json.dumps({edition: report}, indent=1))
    assert report["pages"] >= LEAST_PAGES[edition], report


def _open_every_page(chromium, site: Path, url: str, edition: str) -> dict:
    page = chromium.new_page()
    problems: list[str] = []
    outside: list[str] = []
    page.on("pageerror", lambda e: problems.append(f"script error: {e}"))
    page.on(
        "console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None
    )
    # MathJax 2 probes font loading with a face whose source is about:blank, which Chromium
    # refuses (twice: the refusal and the failed load) wherever it typesets; nothing is missing
    probe = ("Access to font at 'about:blank'", "Failed to load resource: net::ERR_FAILED")
    page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(url)
               else (outside.append(r.request.url), r.abort()))  # fmt: skip
    view = bookgen.students_view if edition == "students" else bookgen.instructors_view
    pages = sorted(  # the pages, not the theme's fragments (_static) nor the index pages
        p
        for p in site.rglob("*.html")
        if p.name not in ("genindex.html", "search.html")
        and not p.relative_to(site).parts[0].startswith("_")
    )
    figures = {}
    for html in pages:
        where = html.relative_to(site)
        page.goto(url + where.as_posix(), wait_until="load")
        shown = page.evaluate(
            "() => [...document.querySelectorAll('.cell_output img')]"
            ".filter(i => i.naturalWidth > 0).length"
        )
        if where.parts[0] == "labs":
            executed = view(nbformat.read(EXECUTED / f"{html.stem}.ipynb", as_version=4))
            drawn = _image_outputs(executed)
            assert shown >= drawn, (
                f"{edition}: {where} shows {shown} figures of the {drawn} its notebook draws"
            )
            assert drawn >= 1 or edition == "students", f"{where}: its notebook draws no figure"
            silent = [i for i, c in enumerate(executed.cells) if _image_outputs_of(c) and not
                      c.metadata.get("mystnb", {}).get("image", {}).get("alt")]  # fmt: skip
            assert not silent, f"{where}: the figures of cells {silent} have no alt text"
            figures[html.stem[:2]] = shown
        if where.parts[:2] == ("book", "notes") and where.stem != "index":
            alts = page.evaluate(
                "() => [...document.querySelectorAll('figure img')]"
                ".map(i => i.naturalWidth > 0 ? i.alt : null)"
            )
            assert alts and all(alts), f"{edition}: {where} shows figures {alts} (null: not loaded)"
            figures[f"notes/{where.stem[:2]}"] = len(alts)
        if page.locator("span.math, div.math").count():  # typeset by the book's own MathJax
            page.wait_for_function(
                "() => document.querySelectorAll('.MathJax, .MathJax_Display').length > 0",
                timeout=15_000,
            )
        real = [p for p in problems if not p.startswith(tuple(f"console: {x}" for x in probe))]
        assert not real, f"{edition}: {where}: " + "; ".join(real)
        problems.clear()
        assert not outside, f"{edition}: {where} asked the network for {outside}"
    page.close()
    return {"pages": len(pages), "figures per lab and notes page": figures}


def test_a_widget_becomes_a_line_and_its_state_goes_so_no_page_loads_a_cdn():
    cell = nbformat.v4.new_code_cell("interact(f)")
    view = {"model_id": "abc", "version_major": 2, "version_minor": 0}
    data = {bookgen.WIDGET: view, "text/plain": "interactive(...)"}
    cell.outputs = [nbformat.v4.new_output("display_data", data=data)]
    nb = nbformat.v4.new_notebook(cells=[cell], metadata={"widgets": {"state": {}}})
    for view_of in (bookgen.students_view, bookgen.instructors_view):
        shown = view_of(nb)
        assert "widgets" not in shown.metadata
        assert shown.cells[0].outputs[0].text.startswith("[an interactive widget")
