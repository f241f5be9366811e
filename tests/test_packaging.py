"""The project's own files agree: pyproject, environment.yml, Makefile, README, CI."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def makefile_recipe(target: str) -> str:
    text = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", text, re.M)
    assert m, f"Makefile has no {target} target"
    return m.group(1)


def test_torch_is_a_range_not_a_pin_and_the_readme_names_its_floor():
    (torch,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    floor = re.fullmatch(r"torch>=(\d+\.\d+)", torch)
    assert floor, torch
    assert f"**PyTorch {floor.group(1)} or later**" in (ROOT / "README.md").read_text()


def test_environment_yml_installs_the_kit_with_its_lab_extras_on_the_same_python():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    python = next(d for d in deps if isinstance(d, str) and d.startswith("python"))
    assert python.removeprefix("python") == PYPROJECT["project"]["requires-python"]
    assert "pip" in deps
    pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    (kit,) = [p for p in pip if p.startswith("-e .")]
    extras = re.search(r"\[(.*)\]", kit).group(1).split(",")
    assert "lab" in extras
    assert set(extras) <= set(PYPROJECT["project"]["optional-dependencies"])
    # conda packages other than python/pip would have to match pyproject too: keep it lean
    assert [d for d in deps if isinstance(d, str)] == [python, "pip"]


def test_readme_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    assert [line.split("#")[0].strip() for line in first_block.strip().splitlines()] == [
        "make lab",
        "make test",
    ]


def test_ci_runs_the_readme_test_command_and_treats_no_tests_as_failure():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
    assert "-eq 5" in ci


def test_make_lab_opens_jupyterlab_on_labs_and_make_test_runs_nbval_on_solutions():
    assert "jupyter lab --ServerApp.root_dir=labs" in makefile_recipe("lab")
    test = makefile_recipe("test")
    assert "pytest" in test and "--nbval" in test and "solutions" in test and "tests" in test


def test_every_solution_notebook_is_marked_ready_in_the_readme_lab_map():
    readme = (ROOT / "README.md").read_text()
    for nb in sorted((ROOT / "solutions").glob("*.ipynb")):
        number = nb.name[:2]
        row = re.search(rf"^\| {number} \|.*$", readme, re.M)
        assert row and row.group(0).rstrip(" |").endswith("ready"), (
            f"lab {number} not 'ready' in README"
        )


def test_python_version_is_supported():
    low = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    assert sys.version_info[:2] >= tuple(int(x) for x in low.split("."))
