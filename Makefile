# overlapkit — the two commands are `make lab` and `make test` (see README.md).
# Everything runs from a virtual environment in .venv, created on first use.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.overlapkit-installed
# extra pip arguments, e.g. PIP_ARGS="--extra-index-url URL" for a CPU-only torch
PIP_ARGS ?=
# extra JupyterLab arguments, e.g. JUPYTER_ARGS="--no-browser --port 8899"
JUPYTER_ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0: one process); 4 on 2 cores, as much of the suite
# waits (kernels, judges, hang limits): a fresh clone's pytest took 1237 s with 3, 1113 s
# with 4, the CPUs then never idle. A notebook's nbval cells stay on one worker, other
# tests go where a worker is free (the scheduler: pytest_xdist_make_scheduler, tests/conftest.py)
PYTEST_WORKERS ?= 4
# JupyterLab refuses to run as root unless told; containers and CI machines often are root
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
LINTED := overlapkit tests solutions

.PHONY: venv lab test soak lint demo bench labs record book gpu-check browser-deps clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check --no-compile $(PIP_ARGS) -e '.[lab,test,book]'
	@# pip byte-compiles what it installs on one core (~50 s of torch's modules here);
	@# compileall uses every core (~29 s). Modules that do not compile on this Python (torch's
	@# tests for newer ones) are left, as pip leaves them: hence `|| true`.
	@$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c \
		'import sysconfig; print(sysconfig.get_path("purelib"))')" > /dev/null || true
	@touch $@

venv: $(STAMP)

## Open the labs in JupyterLab.
lab: $(STAMP)
	$(BIN)/jupyter lab --ServerApp.root_dir=labs $(ROOT_FLAG) $(JUPYTER_ARGS)

## Lint, then every test: library, generator, lab notebooks, the labs in a browser
## (headless Chromium; skipped with the reason where it cannot be installed), nbval.
test: $(STAMP) lint browser-deps
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS) tests --nbval --nbval-current-env --nbval-cell-timeout=300 solutions

## The verdicts that must hold every time, repeated 20 times each (some beside a CPU hog):
## longer than CI allows; the test suite repeats them fewer times.
soak: $(STAMP)
	OVERLAPKIT_SOAK=1 $(BIN)/python -m pytest -n 0 $(PYTEST_ARGS) tests -k "every_time or every_run"

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

## A one-minute tour: ranks, ping-pong, a timeline picture.
demo: $(STAMP)
	$(BIN)/python -m overlapkit demo

bench: $(STAMP)
	$(BIN)/python -m overlapkit bench launch

## Regenerate labs/ from solutions/ (after editing a solution notebook).
labs: $(STAMP)
	$(BIN)/python -m overlapkit.labgen generate solutions labs

## The course book, both editions (build/book/students, build/book/instructors) and every
## figure as SVG and PNG (build/book/figures): executes only the solution notebooks changed
## since they were last executed (the test run leaves them executed in build/executed).
book: $(STAMP)
	$(BIN)/python -m overlapkit.bookgen

## Re-execute solution notebooks and store the outputs that nbval compares.
record: $(STAMP)
	$(BIN)/python -m overlapkit.labgen record solutions/*.ipynb

## Debian's Chromium for the browser tests (apt, when root; otherwise says why they skip).
browser-deps:
	@bash scripts/browser_deps.sh

## Every GPU check (on a machine with CUDA), on the kit as installed: no pip, no network.
gpu-check:
	PYTHON=$(BIN)/python bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
