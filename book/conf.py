"""Sphinx configuration of the course book (built by `make book`: python -m overlapkit.bookgen).

The book is built offline and must read offline: the theme's assets are in its package, and
MathJax is served from the build itself (jupyter-server-mathjax's copy), never from a CDN.
"""

import os
import shutil
from pathlib import Path

import jupyter_server_mathjax

import overlapkit

edition = os.environ.get("OVERLAPKIT_BOOK_EDITION", "students")
project = "overlapkit"
author = "the overlapkit authors"
copyright = "the overlapkit authors; prose CC BY 4.0, code MIT"
release = overlapkit.__version__

extensions = ["myst_nb", "sphinx_design"]
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # the notebooks arrive executed (bookgen); the build never runs one
nb_output_stderr = "show"  # ranks print their lines on stderr: they are part of a lab's output
nb_merge_streams = True
suppress_warnings = ["mystnb.unknown_mime_type"]  # widget views: their text form is shown
exclude_patterns = ["_build", "**.ipynb_checkpoints"]

html_theme = "sphinx_book_theme"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
    "announcement": "Instructors' edition: answers included." if edition == "instructors" else "",
}
html_context = {"default_mode": "light"}  # (the theme's switch still offers dark)
html_static_path = ["_static"]  # (relative to this folder)
html_css_files = ["overlapkit.css"]

# MathJax 2 from jupyter-server-mathjax, copied into the build (see below)
MATHJAX = Path(jupyter_server_mathjax.__file__).parent / "static"
mathjax_path = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"
# the package carries the STIX-Web fonts only (as Jupyter uses them): no image fonts, no others
mathjax2_config = {
    "HTML-CSS": {
        "availableFonts": ["STIX-Web"],
        "preferredFont": "STIX-Web",
        "webFont": "STIX-Web",
        "imageFont": None,
    },
    # MyST marks the page's text "mathjax_ignore" and its math "math": only the math is typeset
    "tex2jax": {
        "inlineMath": [["\\(", "\\)"]],
        "displayMath": [["\\[", "\\]"]],
        "processEscapes": True,
        "ignoreClass": "tex2jax_ignore|mathjax_ignore",
        "processClass": "tex2jax_process|mathjax_process|math|output_area",
    },
}


def _copy_mathjax(app, exception):
    if exception is None and app.builder.format == "html":
        target = Path(app.outdir) / "_static" / "mathjax"
        if not (target / "MathJax.js").exists():
            keep = shutil.ignore_patterns("localization", "*.md")
            shutil.copytree(MATHJAX, target, ignore=keep, dirs_exist_ok=True)


def setup(app):
    app.connect("build-finished", _copy_mathjax)
