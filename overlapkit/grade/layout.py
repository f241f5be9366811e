"""Where the submissions are: notebooks, folders of them."""

from __future__ import annotations

from pathlib import Path


def _notebooks(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.glob("*.ipynb") if not q.name.startswith("."))
        else:
            out.append(p)
    return out
