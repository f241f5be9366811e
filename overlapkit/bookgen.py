"""The course book: the solution notebooks, executed, beside ``book/``'s pages, built by Sphinx.

Two editions from one set of sources::

    solutions/NN_*.ipynb ──execute──► build/executed/NN_*.ipynb (kept while the source is unchanged)
                                         │
          students' view ◄───────────────┴───────────────► instructors' view
          (exercise cells as in labs/,                      (the answers, with their outputs)
           every other output kept)
                  │                                                  │
    build/book-src/students/: index, book/ but instructors/    build/book-src/instructors/: all
                  │        sphinx-build (MyST-NB, nothing executed)  │
                  ▼                                                  ▼
    build/book/students/index.html                  build/book/instructors/index.html
                         build/book/figures/labNN/*.svg|png (+ alt text)

An executed copy records the SHA-256 of the solution it came from, so a changed solution is
executed again and an unchanged one never: the test run's nbval kernels write these copies as
they go (tests/executed_copies.py), so the book built after the tests executes nothing. The
kernel draws every figure as PNG and SVG (the SVG for an instructor's slides).

    python -m overlapkit.bookgen [--edition students|instructors|both] [--no-execute]
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

from overlapkit import __version__
from overlapkit.labgen import _DIRECTIVE, AFTER_CHECK, has_exercise, lab_cell_source

ROOT = Path(__file__).resolve().parent.parent
EDITIONS = ("students", "instructors")
#: pages only the instructors' edition carries (relative to book/)
INSTRUCTORS_ONLY = ("instructors", "grading.md")
KERNEL_CONFIG = 'c.InlineBackend.figure_formats = {"png", "svg"}\n'
META = "overlapkit-book"


def source_key(solution: Path) -> str:
    """What an executed copy must have been executed from: the solution file's SHA-256."""
    return hashlib.sha256(solution.read_bytes()).hexdigest()


def is_current(copy_path: Path, solution: Path) -> bool:
    if not copy_path.exists():
        return False
    nb = json.loads(copy_path.read_text(encoding="utf-8"))
    return nb.get("metadata", {}).get(META, {}).get("source") == source_key(solution)


def mark_executed(nb, solution: Path, by: str) -> None:
    nb.metadata[META] = {"source": source_key(solution), "executed_by": by}


def kernel_env(base: dict | None = None) -> dict:
    """Environment for a kernel that draws figures as PNG and SVG: an IPython profile of its own
    (IPYTHONDIR), so a learner's own profile is neither read nor changed."""
    env = dict(os.environ if base is None else base)
    profile = Path(tempfile.gettempdir()) / "overlapkit-book-ipython"
    config = profile / "profile_default" / "ipython_kernel_config.py"
    if not config.exists() or config.read_text() != KERNEL_CONFIG:
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(KERNEL_CONFIG)
    env["IPYTHONDIR"] = str(profile)
    return env


def _execute_one(solution: Path, target: Path, timeout: int) -> None:
    """(In a process of its own.) Execute ``solution`` and write the executed copy to ``target``."""
    from nbclient import NotebookClient  # noqa: PLC0415

    nb = nbformat.read(solution, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(solution.parent)}})  # fmt: skip
    client.execute()
    mark_executed(nb, solution, "bookgen")
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)


def execute_stale(
    solutions: list[Path], executed: Path, jobs: int = 2, timeout: int = 300
) -> list[str]:
    """Execute every solution whose copy is missing or stale, ``jobs`` at a time; returns the
    names that failed (each with the end of its error)."""
    stale = [s for s in solutions if not is_current(executed / s.name, s)]
    print(
        f"book: {len(solutions) - len(stale)} executed notebooks current, {len(stale)} to execute"
    )
    running: list[tuple[Path, subprocess.Popen, float]] = []
    failed = []
    env = kernel_env()
    queue = list(stale)
    while queue or running:
        while queue and len(running) < jobs:
            s = queue.pop(0)
            cmd = [sys.executable, "-m", "overlapkit.bookgen", "--execute-one", str(s),
                   str(executed / s.name), "--timeout", str(timeout)]  # fmt: skip
            proc = subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            running.append((s, proc, time.perf_counter()))
        time.sleep(0.2)
        for item in list(running):
            s, proc, started = item
            if proc.poll() is None:
                continue
            running.remove(item)
            out = proc.stdout.read()
            took = time.perf_counter() - started
            if proc.returncode:
                failed.append(
                    f"{s.name}: {out.strip().splitlines()[-1] if out.strip() else proc.returncode}"
                )
                print(f"book: {s.name} FAILED after {took:.0f} s")
            else:
                print(f"book: {s.name} executed in {took:.0f} s")
    return failed


WIDGET = "application/vnd.jupyter.widget-view+json"


def without_widgets(nb):
    """A page is read offline, with no kernel behind it: an interactive widget's output
    becomes a line that says so, and the widgets' saved state goes (the book would
    otherwise load the widget manager from a CDN)."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for i, output in enumerate(cell.get("outputs", [])):
            if WIDGET in output.get("data", {}):
                cell.outputs[i] = nbformat.v4.new_output(
                    "stream",
                    name="stdout",
                    text="[an interactive widget: open the notebook and run it to use it]\n",
                )
    return nb


def is_check(source: str) -> bool:
    """A cell that runs a check: its ✔ lines judged the answer, which the learner's page
    does not show."""
    return "ok.grading." in source


#: the tag of a cell whose printed output would give an exercise's answer away (its ✔-like
#: "yours: the same", the values the answer returns): the students' edition keeps its figures
ANSWER_OUTPUT = "answer-output"
#: what the students' edition shows in place of such a cell
WITHHELD = ("*Here the notebook explains the answer to the exercise above, once your check "
            "passes; the book leaves it out, so that it gives no answer away.*")  # fmt: skip


def withheld(source: str, where: str) -> str:
    """The line that stands for a cell tagged :data:`AFTER_CHECK` in the students' edition.
    A heading cannot be withheld (the page's outline would lose it)."""
    if any(line.startswith("#") for line in source.splitlines()):
        raise ValueError(f"{where}: a cell tagged {AFTER_CHECK!r} holds a heading; tag the "
                         "paragraphs after it instead")  # fmt: skip
    return WITHHELD


#: an absolute path into the checkout the notebooks ran in: a page shows it from the checkout
_CHECKOUT_PATH = re.compile(r"(?<![\w.])/[^\s'\"]*?/((?:overlapkit|solutions|labs)/)")


def _figures_only(outputs: list) -> list:
    return [o for o in outputs if "image/png" in o.get("data", {})]


def _relative_paths(nb, folder: str = "solutions"):
    """Paths a cell printed, from the checkout's root; ``folder``: where the notebooks are
    on the page's side (a learner's copy of a lab is in labs/)."""
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                text = _CHECKOUT_PATH.sub(r"\1", output.text)
                output.text = re.sub(r"(?<![\w.])solutions/", f"{folder}/", text)
    return nb


def students_view(nb):
    """The executed solution as a learner may see it: every exercise region as in labs/, its
    cell's outputs dropped (they come from the answer), as are a check's; a cell tagged
    ``answer-output`` keeps its figures only; every other output kept. Text tagged
    ``after-check`` is left out, with a line saying so (:func:`withheld`)."""
    nb = _relative_paths(without_widgets(copy.deepcopy(nb)), folder="labs")
    for i, cell in enumerate(nb.cells):
        answer = has_exercise(cell.source) or "### BEGIN HIDDEN TESTS" in cell.source
        answer = answer or is_check(cell.source)
        cell.source = lab_cell_source(cell.source, cell.cell_type, f"cell {i}")
        if cell.cell_type == "code" and answer:
            cell.outputs = []
            cell.execution_count = None
        elif ANSWER_OUTPUT in cell.metadata.get("tags", []):
            cell.outputs = _figures_only(cell.outputs)
        elif cell.cell_type == "markdown" and AFTER_CHECK in cell.metadata.get("tags", []):
            cell.source = withheld(cell.source, f"cell {i}")
    return nb


def instructors_view(nb):
    """The executed solution with the test run's directives (``# NBVAL_…``) taken out."""
    nb = _relative_paths(without_widgets(copy.deepcopy(nb)))
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source = "\n".join(x for x in cell.source.split("\n") if not _DIRECTIVE.match(x))
    return nb


def _lab_title(nb, fallback: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return fallback


#: the root page's opening paragraph, per edition
_WELCOME = {
    "students": (
        "Fifteen Jupyter labs on how distributed training hides communication behind "
        "computation, with the lecture notes they rest on. Each lab page shows the notebook "
        "as run when this book was built, figures included; the exercises appear as you get "
        "them. Start with the [introduction](book/intro.md), then work the labs in order on "
        "your own machine."
    ),
    "instructors": (
        "The course book with every answer: the labs as solved and run, the lecture notes, and "
        "the instructors' part (a guide per lab with the checks' words, answers and a quiz; a "
        "workshop plan, syllabi, hardware sizing, the grader). Start with the "
        "[introduction](book/intro.md) and [For instructors](book/instructors/index.md), "
        "which says how to hand out the labs and publish the students' edition."
    ),
}


def index_page(edition: str, labs: list[str], pages: set[str]) -> str:
    """The edition's root page: its table of contents."""

    def toc(caption: str, entries: list[str]) -> str:
        present = [e for e in entries if e.endswith("*") or e in pages]
        if not present:
            return ""
        return (
            f"```{{toctree}}\n:caption: {caption}\n:maxdepth: 1\n\n"
            + "\n".join(present)
            + "\n```\n\n"
        )

    title = "overlapkit: the course book" + (
        " (instructors' edition)" if edition == "instructors" else ""
    )
    text = f"# {title}\n\n" + _WELCOME[edition] + "\n\n"
    text += toc("Start here", ["book/intro"])
    text += toc(
        "Lecture notes",
        ["book/notes/index"] + sorted(p for p in pages if p.startswith("book/notes/0")),
    )
    text += toc("Labs", [f"labs/{name}" for name in labs])
    text += toc("Reference", ["book/glossary", "book/api", "book/gpus"])
    if edition == "instructors":
        plans = [f"book/instructors/{p}"
                 for p in ("index", "workshop", "syllabus", "sizing", "problems")]  # fmt: skip
        labs_guides = sorted(p for p in pages if p.startswith("book/instructors/lab"))
        guide = [*plans, *labs_guides, "book/instructors/changelog", "book/grading"]
        text += toc("For instructors", guide)
    return text


#: a Markdown link to a page only the instructors' edition carries
_TO_INSTRUCTORS = re.compile(
    r"\[([^\]]+)\]\((?![a-z]+:)[^)]*?(?:instructors/[^)]*|grading\.md[^)]*)\)"
)


def _unlinked(text: str) -> str:
    """The students' edition keeps the words of a link to an instructors' page, not the link,
    and says where the page is unless the words already do."""

    def words(link: re.Match) -> str:
        said = link[1]
        return said if "instructor" in said.lower() else f"{said} (in the instructors' edition)"

    return _TO_INSTRUCTORS.sub(words, text)


def stage(edition: str, executed: Path, staging: Path, book: Path = ROOT / "book") -> list[str]:
    """Lay out one edition's sources in ``staging`` (emptied first); returns the labs' names."""
    if staging.exists():
        shutil.rmtree(staging)
    target = staging / "book"
    skip = set(INSTRUCTORS_ONLY) if edition == "students" else set()
    ignore = shutil.ignore_patterns("conf.py", "_static", "_build", "__pycache__", *skip)
    shutil.copytree(book, target, ignore=ignore)
    changes = book.parent / "CHANGELOG.md"  # what changed between versions, for instructors
    if edition == "instructors" and changes.exists():
        (target / "instructors").mkdir(exist_ok=True)
        (target / "instructors" / "changelog.md").write_text(changes.read_text(encoding="utf-8"))
    if edition == "students":
        for page in target.rglob("*.md"):
            page.write_text(_unlinked(page.read_text(encoding="utf-8")), encoding="utf-8")
    view = students_view if edition == "students" else instructors_view
    views = {}
    for copy_path in sorted(executed.glob("*.ipynb")):
        views[copy_path.stem] = view(nbformat.read(copy_path, as_version=4))
        (staging / "labs").mkdir(parents=True, exist_ok=True)
        nbformat.write(views[copy_path.stem], staging / "labs" / copy_path.name)
    labs = list(views)
    named = named_figures(views, target / "notes" / "figures")
    for page in (target / "notes").glob("*.md"):
        text = page.read_text(encoding="utf-8")
        page.write_text(with_alt_text(text, named, f"notes/{page.name}"), encoding="utf-8")
    pages = {
        str(p.relative_to(staging).with_suffix(""))
        for p in staging.rglob("*")
        if p.suffix in (".md", ".ipynb")
    }
    (staging / "index.md").write_text(index_page(edition, labs, pages), encoding="utf-8")
    return labs


#: a figure the lecture notes show, named in its lab cell's metadata (``overlapkit.figure``):
#: a notes page asks for it as ```{figure} figures/NAME.*``` and the build writes it there
#: (SVG where the kernel drew one) with the lab's own alt text
FIGURE_KEY = "figure"
_FIGURE = re.compile(r"^```\{figure\} figures/([\w-]+)\.\*\n", re.MULTILINE)


def named_figures(views: dict[str, nbformat.NotebookNode], folder: Path) -> dict[str, str]:
    """Write each named figure of one edition's lab pages into ``folder``; returns name → alt
    text. The notes take a figure from the page as that edition shows it, so a figure the
    students' page leaves out is missing from their notes too (and the build fails)."""
    found: dict[str, tuple[str, str]] = {}  # name -> (alt text, the lab and cell)
    for lab, nb in views.items():
        for i, cell in enumerate(nb.cells):
            name = cell.metadata.get("overlapkit", {}).get(FIGURE_KEY)
            images = [
                o["data"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})
            ]
            if not name or not images:
                continue
            if name in found:
                raise ValueError(
                    f"figure {name!r} is named in {found[name][1]} and in {lab}, cell {i}"
                )
            folder.mkdir(parents=True, exist_ok=True)
            svg = images[0].get("image/svg+xml")
            if svg:
                (folder / f"{name}.svg").write_text(svg if isinstance(svg, str) else "".join(svg))
            else:
                (folder / f"{name}.png").write_bytes(base64.b64decode(images[0]["image/png"]))
            found[name] = (_alt(cell), f"{lab}, cell {i}")
    return {name: alt for name, (alt, _) in found.items()}


def with_alt_text(page: str, named: dict[str, str], where: str) -> str:
    """A notes page with each named figure's alt text filled in from its lab cell."""

    def alt(figure: re.Match) -> str:
        name = figure.group(1)
        if name not in named:
            raise ValueError(
                f"{where} shows figure {name!r}, which no lab page of this edition draws "
                "(a cell's metadata names it: overlapkit.figure)"
            )
        return f"{figure.group(0)}:alt: {named[name]}\n"

    return _FIGURE.sub(alt, page)


def start_sphinx(staging: Path, out: Path, edition: str, conf: Path = ROOT / "book"):
    """Start building one edition (the editions build side by side); a warning is an error:
    a broken link or a missing anchor fails it."""
    title = f"html_title=overlapkit {__version__} ({edition})"
    doctrees = staging.parent / f"{edition}.doctrees"  # outside what gets published
    if out.exists():
        shutil.rmtree(out)  # what is published is this build, nothing left from an earlier one
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-W", "--keep-going",
           "-c", str(conf), "-d", str(doctrees), "-D", title, str(staging), str(out)]  # fmt: skip
    return subprocess.Popen(cmd, env=dict(os.environ, OVERLAPKIT_BOOK_EDITION=edition))


def finish_sphinx(build, out: Path, edition: str) -> None:
    if build.wait():
        raise SystemExit(
            f"book: sphinx could not build the {edition} edition (its messages are above)"
        )
    for info in out.glob(".buildinfo*"):  # Sphinx's own bookkeeping, not a page
        info.unlink()
    for fragment in (out / "_static").glob("*webpack-macros.html"):  # the theme's templates
        fragment.unlink()


def _alt(cell) -> str:
    return cell.metadata.get("mystnb", {}).get("image", {}).get("alt", "")


def export_figures(executed: Path, out: Path) -> int:
    """Every figure of every executed lab as PNG and SVG, one folder per lab, with its alt text
    in the folder's README.md; returns the number of figures."""
    if out.exists():
        shutil.rmtree(out)
    count = 0
    for copy_path in sorted(executed.glob("*.ipynb")):
        nb = nbformat.read(copy_path, as_version=4)
        folder = out / f"lab{copy_path.name[:2]}"
        lines = [f"# Figures of {copy_path.stem}\n"]
        for i, cell in enumerate(nb.cells):
            images = [o for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
            for k, output in enumerate(images):
                stem = f"cell{i:02d}-{k + 1}"
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"{stem}.png").write_bytes(base64.b64decode(output["data"]["image/png"]))
                svg = output["data"].get("image/svg+xml")
                if svg:
                    (folder / f"{stem}.svg").write_text(
                        svg if isinstance(svg, str) else "".join(svg)
                    )
                alt = _alt(cell) or "(no alt text: add cell metadata mystnb.image.alt)"
                lines.append(f"- `{stem}.svg` / `{stem}.png` (cell {i}): {alt}")
                count += 1
        if len(lines) > 1:
            (folder / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m overlapkit.bookgen", description=__doc__.split("\n")[0]
    )
    p.add_argument("--edition", choices=(*EDITIONS, "both"), default="both")
    p.add_argument("--solutions", type=Path, default=ROOT / "solutions")
    p.add_argument("--executed", type=Path, default=ROOT / "build" / "executed")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "book")
    p.add_argument("--no-execute", action="store_true",
                   help="fail where an executed copy is missing or stale")  # fmt: skip
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument(
        "--execute-one", nargs=2, type=Path, metavar=("SOLUTION", "TARGET"), help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    if args.execute_one:
        _execute_one(*args.execute_one, timeout=args.timeout)
        return 0
    solutions = sorted(args.solutions.glob("*.ipynb"))
    if args.no_execute:
        stale = [s.name for s in solutions if not is_current(args.executed / s.name, s)]
        if stale:
            print(f"book: no current executed copy of {', '.join(stale)} in {args.executed} "
                  "(run the tests or `make book`)", file=sys.stderr)  # fmt: skip
            return 1
    else:
        failed = execute_stale(solutions, args.executed, args.jobs, args.timeout)
        if failed:
            print("book: these notebooks failed:\n  " + "\n  ".join(failed), file=sys.stderr)
            return 1
    for stray in set(p.name for p in args.executed.glob("*.ipynb")) - {s.name for s in solutions}:
        (args.executed / stray).unlink()  # a solution removed since: its page goes too
    editions = EDITIONS if args.edition == "both" else (args.edition,)
    started = time.perf_counter()
    builds = {}
    for edition in editions:
        staging = args.out.parent / "book-src" / edition
        labs = stage(edition, args.executed, staging)
        builds[edition] = start_sphinx(staging, args.out / edition, edition)
    for edition, build in builds.items():
        finish_sphinx(build, args.out / edition, edition)
        took = time.perf_counter() - started
        print(f"book: {edition} edition, {len(labs)} labs, in {took:.0f} s: "
              f"{args.out / edition / 'index.html'}")  # fmt: skip
    figures = export_figures(args.executed, args.out / "figures")
    print(f"book: {figures} figures as SVG and PNG in {args.out / 'figures'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
