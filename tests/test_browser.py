"""The labs in a real browser: JupyterLab on localhost, driven by headless Chromium.

Debian's ``chromium`` (``make browser-deps`` installs it; CI does) through Playwright
for Python with ``executable_path`` — never a browser download. Screenshots go to the
folder the test prints (``OVERLAPKIT_SCREENSHOTS`` to choose it).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
RUN_LIMIT_S = 240  # a whole notebook, run from the browser


def _skip_reason() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: pip install -e '.[test]'"
    if CHROMIUM is None:
        return ("Debian's chromium is not installed: run `make browser-deps` (needs root and "
                "apt), as CI does")  # fmt: skip
    return None


if _skip_reason():
    pytest.skip(_skip_reason(), allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory):
    """JupyterLab on 127.0.0.1 with a temporary root and a random token; stopped after."""
    root = tmp_path_factory.mktemp("lab-root")
    for name in ("07_bucketing.ipynb", "00_getting_started.ipynb"):
        nb = nbformat.read(ROOT / "solutions" / name, as_version=4)
        for cell in nb.cells:  # as a learner opens it: nothing run yet
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        nbformat.write(nb, root / name)
    # the error detector's own test: a notebook whose one cell fails
    broken = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 / 0")])
    broken.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}  # fmt: skip
    nbformat.write(broken, root / "broken.ipynb")
    # a kernel JupyterLab does not know: it asks which one to use, as it sometimes does
    # for any notebook while the kernel list is still loading
    asks = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    asks.metadata["kernelspec"] = {"name": "no-such-kernel", "display_name": "?",
                                   "language": "python"}  # fmt: skip
    nbformat.write(asks, root / "asks_for_a_kernel.ipynb")
    # every cell in the page (no virtual scrolling), no news pop-ups
    settings = root / "settings" / "@jupyterlab"
    for ext, name, body in (
        ("notebook-extension", "tracker", '{"windowingMode": "none"}'),
        ("apputils-extension", "notification", '{"fetchNews": "false", "checkForUpdates": false}'),
    ):
        (settings / ext).mkdir(parents=True, exist_ok=True)
        (settings / ext / f"{name}.jupyterlab-settings").write_text(body)
    port, token = _free_port(), secrets.token_hex(16)
    log = open(root / "jupyter.log", "w")  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--ServerApp.port_retries=0",
           "--LabApp.news_url="] + (["--allow-root"] if os.getuid() == 0 else [])  # fmt: skip
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(root / "settings")}
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env,
                              start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail("JupyterLab did not start:\n" + (root / "jupyter.log").read_text())
                time.sleep(0.5)
        yield url, token, root
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have died already
            os.killpg(server.pid, signal.SIGTERM)  # the server and the kernels it started
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    folder = Path(os.environ.get("OVERLAPKIT_SCREENSHOTS") or tmp_path_factory.mktemp("screens"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots: {folder}")
    return folder


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage"])  # fmt: skip
        yield chromium
        chromium.close()


def _open_and_run_all(browser, jupyter, name: str):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    """Open a notebook, run all its cells from the Run menu, wait until none is running."""
    url, token, _ = jupyter
    # a context and a workspace of its own: no tab of another test restored beside it
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    workspace = name.split(".")[0].replace("_", "-")
    page.goto(f"{url}/lab/workspaces/{workspace}/tree/{name}?reset&token={token}",
              timeout=60_000)  # fmt: skip
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
    # the kernel is ready when the notebook's execution indicator says idle
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                           timeout=60_000)  # fmt: skip
    prompts = page.locator(".jp-CodeCell .jp-InputPrompt")
    with contextlib.suppress(PlaywrightTimeout):  # a kernel dialog may come a moment later
        page.wait_for_selector(".jp-Dialog", timeout=3000)
    for _ in range(3):  # a request sent while the kernel is still connecting can be lost
        _answer_dialogs(page, jupyter[2] / f"{name}-dialog.png")
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        started = time.monotonic() + 20
        while time.monotonic() < started:
            if any(re.search(r"\[(\*|\d+)\]", p) for p in prompts.all_inner_texts()):
                break
            time.sleep(0.5)
        else:
            continue
        break
    cells = page.locator(".jp-Notebook .jp-CodeCell")
    deadline = time.monotonic() + RUN_LIMIT_S
    while time.monotonic() < deadline:
        prompts = page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
        if prompts and all(re.search(r"\[\d+\]", p) for p in prompts):
            break
        time.sleep(1)
    else:
        page.screenshot(path=str(jupyter[2] / f"{name}-timeout.png"), full_page=True)
        pytest.fail(f"{name}: not every cell ran within {RUN_LIMIT_S} s")
    return page, cells


def _answer_dialogs(page, shot: Path) -> None:
    """Answer what JupyterLab asks on opening as a learner would (which kernel: the
    preferred one, "Select"); fail, with its text and a screenshot, on any other dialog."""
    asked = set()
    for _ in range(10):
        dialog = page.locator(".jp-Dialog")
        if not dialog.count():
            return
        text = dialog.first.inner_text()
        if text not in asked:
            print(f"JupyterLab asked: {text!r}")
            asked.add(text)
        if "Select Kernel" not in text:
            page.screenshot(path=str(shot))
            pytest.fail(f"JupyterLab asked: {text!r} (screenshot {shot})")
        select = dialog.first.get_by_role("button", name="Select", exact=True)
        (select if select.count() else dialog.first.locator(".jp-mod-accept")).first.click()
        page.wait_for_timeout(1000)
    page.screenshot(path=str(shot))
    pytest.fail(f"JupyterLab kept asking which kernel to use (screenshot {shot})")


def _error_outputs(page) -> list[str]:
    """Texts of error outputs (tracebacks) and failed widgets in the page."""
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    texts = [t for t in errors.all_inner_texts() if re.search(r"Traceback|Error\b", t)]
    texts += page.get_by_text("Error displaying widget").all_inner_texts()
    return texts


def test_lab07_widget_renders_and_its_slider_moves_the_prediction(browser, jupyter, shots):
    page, _ = _open_and_run_all(browser, jupyter, "07_bucketing.ipynb")
    try:
        _move_the_slider(page, shots)
    finally:
        page.context.close()


def _move_the_slider(page, shots):
    assert not _error_outputs(page), _error_outputs(page)
    widget = page.locator(".widget-vbox").filter(has_text="bucket MiB").last
    widget.scroll_into_view_if_needed()
    label = widget.locator(".widget-html-content").filter(has_text="predicted step").first
    page.wait_for_function("e => e.textContent.includes('ms')", arg=label.element_handle(),
                           timeout=30_000)  # fmt: skip
    before = label.inner_text()
    widget.screenshot(path=str(shots / "lab07_widget_before.png"))
    handle = widget.locator(".widget-slider").first.locator(".noUi-handle").first
    handle.focus()
    for _ in range(12):
        page.keyboard.press("ArrowRight")
    page.wait_for_function("([e, t]) => e.textContent !== t",
                           arg=[label.element_handle(), before], timeout=30_000)  # fmt: skip
    after = label.inner_text()
    widget.screenshot(path=str(shots / "lab07_widget_after.png"))
    assert before != after and "predicted step" in after
    assert not page.get_by_text("Error displaying widget").count()


def test_lab00_runs_in_the_browser_without_an_error_output(browser, jupyter, shots):
    page, cells = _open_and_run_all(browser, jupyter, "00_getting_started.ipynb")
    try:
        page.screenshot(path=str(shots / "lab00_after_run_all.png"), full_page=False)
        assert cells.count() > 5
        errors = _error_outputs(page)
        assert not errors, errors
    finally:
        page.context.close()


def test_the_error_detector_sees_a_failing_cell(browser, jupyter):
    page, _ = _open_and_run_all(browser, jupyter, "broken.ipynb")
    try:
        assert any("ZeroDivisionError" in text for text in _error_outputs(page))
    finally:
        page.context.close()


def test_a_kernel_dialog_is_answered_as_a_learner_would(browser, jupyter):
    page, _ = _open_and_run_all(browser, jupyter, "asks_for_a_kernel.ipynb")
    try:
        assert "42" in page.locator(".jp-OutputArea-output").first.inner_text()
    finally:
        page.context.close()
