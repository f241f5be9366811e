"""scripts/gpu_check.sh on a machine without a GPU: ``--list`` names every check and runs
nothing; a plain run skips each check with its reason, writes the report and exits 0, fast;
the budget bounds it; and its verdicts tell the truth (ranks that fell back to the CPU fail,
as recorded by the hook it loads into pytest). Nothing here needs a GPU."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
#: the checks the script must offer (its --list names), besides one per solution notebook
CHECKS = ["link", "compression", "tensor-parallel", "hybrid", "fsdp", "pipeline", "gpu-tests",
          "bench", "demo", "nccl-log", "streams", "nsys"]  # fmt: skip
NOTEBOOKS = sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb"))

no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="this machine has CUDA: a plain run would run the checks"
)


def run(*args, timeout=120, **env):
    """The script, from another folder, with ``env`` added; (completed process, seconds)."""
    mine = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k != "OUT"}
    full = {**mine, "PYTHON": sys.executable, **env}
    start = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT), *args], cwd="/", env=full, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    return done, time.monotonic() - start


def test_list_names_every_check_with_the_gpus_it_needs_and_runs_nothing(tmp_path):
    marker = tmp_path / "python-ran"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ntouch {marker}\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    done, took = run("--list", PYTHON=str(fake), OUT=str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert took < 10, f"--list took {took:.1f} s"
    lines = done.stdout.splitlines()
    names = [line.split()[0] for line in lines]
    assert names == CHECKS + [f"notebook:{nb}" for nb in NOTEBOOKS], names
    for line in lines:
        assert re.search(r"needs \d+ GPUs?", line), line
    assert re.search(r"^hybrid\s+needs 1 GPU \(4 for all of it\)", done.stdout, re.M)
    assert not marker.exists(), "--list ran Python"
    assert not (tmp_path / "out").exists(), "--list wrote something"


def test_every_test_of_test_gpu_paths_belongs_to_one_of_the_scripts_checks():
    """The script runs tests/test_gpu_paths.py one area at a time (-k cuda_<area>): a test
    named outside every area would never run."""
    from tests import test_gpu_paths  # noqa: PLC0415

    script = SCRIPT.read_text()
    areas = ["cuda_link", "cuda_compression", "cuda_tp", "cuda_hybrid", "cuda_fsdp",
             "cuda_pipeline"]  # fmt: skip
    assert "keyword=cuda_$name" in script and "keyword=cuda_tp" in script
    names = [n for n in dir(test_gpu_paths) if n.startswith("test_")]
    assert names
    for name in names:
        assert sum(area in name for area in areas) == 1, name


def test_bad_arguments_are_refused_and_help_explains():
    done, _ = run("--bogus")
    assert done.returncode == 2 and "unknown argument" in done.stderr
    done, _ = run("--help")
    assert done.returncode == 0 and "GPU_CHECK_BUDGET_S" in done.stdout and "--list" in done.stdout


@no_cuda
def test_without_a_gpu_each_check_is_skipped_with_its_reason_and_the_report_written(tmp_path):
    done, took = run(OUT=str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert took < 40, f"the run without a GPU took {took:.1f} s"
    for name in CHECKS + [f"notebook:{nb}" for nb in NOTEBOOKS]:
        assert re.search(rf"^SKIP  {re.escape(name)}\s+no CUDA device here: needs 1 GPU",
                         done.stdout, re.M), name  # fmt: skip
    report = tmp_path / "gpu-check-report.txt"
    assert done.stdout.rstrip().splitlines()[-1] == f"report: {report}"
    text = report.read_text()
    assert "machine: no CUDA device (torch " in text and "nvidia-smi" in text
    total = len(CHECKS) + len(NOTEBOOKS)
    assert f"summary: 0 PASS, 0 FAIL, {total} SKIP of {total} checks (0 GPU(s))" in text
    assert "still running" not in text
    logs = tmp_path / "gpu-check-logs"
    ran = sorted(p.name for p in logs.iterdir() if p.suffix in (".log", ".xml", ".jsonl"))
    assert ran == ["machine.log"], f"something ran without a GPU: {ran}"


def test_the_budget_bounds_the_run_and_what_does_not_fit_is_skipped_saying_so(tmp_path):
    done, took = run(OUT=str(tmp_path), GPU_CHECK_FAKE_GPUS="1", GPU_CHECK_BUDGET_S="1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert took < 40
    for name in CHECKS:
        assert re.search(rf"^SKIP  {name}\s+out of time: -?\d+ s of the 1 s budget left",
                         done.stdout, re.M), done.stdout  # fmt: skip


def test_only_runs_the_checks_it_names(tmp_path):
    done, _ = run(OUT=str(tmp_path), GPU_CHECK_FAKE_GPUS="1", GPU_CHECK_BUDGET_S="1",
                  GPU_CHECK_ONLY="link,notebooks")  # fmt: skip
    assert re.search(r"^SKIP  demo\s+not selected \(GPU_CHECK_ONLY=link,notebooks\)", done.stdout,
                     re.M)  # fmt: skip
    assert re.search(r"^SKIP  link\s+out of time", done.stdout, re.M)
    assert re.search(r"^SKIP  notebook:\S+\s+out of time", done.stdout, re.M)


@no_cuda
def test_ranks_that_fell_back_to_the_cpu_fail_the_check_with_their_log_in_the_report(tmp_path):
    """With two GPUs (pretended), the bench's two ranks should each have had one: run on
    gloo and the CPU, the check fails, says so with the ranks' backend and devices, and the
    report ends with the tail of its log."""
    done, _ = run(OUT=str(tmp_path), GPU_CHECK_FAKE_GPUS="2", GPU_CHECK_ONLY="bench", timeout=200)
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"^FAIL  bench\s+fell back to the CPU: world 2: backend=gloo "
                     r"devices=cpu,cpu", done.stdout, re.M), done.stdout  # fmt: skip
    text = (tmp_path / "gpu-check-report.txt").read_text()
    assert "summary: 0 PASS, 1 FAIL" in text
    assert "=== FAIL bench: the last 40 lines of" in text and "busbw_GBps" in text


def test_the_hook_records_each_ranks_backend_and_device_and_judges_them(tmp_path):
    """The pytest plugin the script loads wraps ok.launch so that each rank writes where it
    ran; the verdicts: ranks on the CPU that could each have had a GPU fail a passing test,
    more ranks than GPUs running gloo do not."""
    run(OUT=str(tmp_path / "out"), GPU_CHECK_FAKE_GPUS="1", GPU_CHECK_BUDGET_S="1")
    logs = tmp_path / "out" / "gpu-check-logs"
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_tiny.py").write_text(textwrap.dedent("""
        import overlapkit as ok

        def value():
            return ok.rank() * 10

        def test_two_ranks():
            assert ok.launch(value, world_size=2, timeout=60) == [0, 10]
        """))  # fmt: skip
    record, xml = tmp_path / "ranks.jsonl", tmp_path / "tiny.xml"
    env = {**os.environ, "PYTHONPATH": f"{logs}:{ROOT}", "GPU_CHECK_RECORD": str(record)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_check_plugin",
         f"--junitxml={xml}", "test_tiny.py"],
        cwd=tests, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = record.read_text().splitlines()
    assert len(lines) == 3, lines  # the caller's, then one per rank
    assert all('"test": "test_tiny.py::test_two_ranks"' in line for line in lines), lines

    def verdict(gpus):
        args = ["pytest", str(xml), "/dev/null", "0", str(record), str(gpus), "60"]
        return subprocess.run([sys.executable, str(logs / "gpu_check_summary.py"), *args],
                              capture_output=True, text=True, timeout=60).stdout  # fmt: skip

    fell = verdict(2)
    assert fell.startswith("FAIL\t1 of 1 test failed; first: test_two_ranks: fell back to the "
                           "CPU: backend=gloo devices=cpu,cpu"), fell  # fmt: skip
    fine = verdict(1)
    assert fine.startswith("PASS\t1 test passed\tbackend=gloo devices=cpu,cpu (2 ranks > 1 GPU: "
                           "gloo on the CPU)"), fine  # fmt: skip


def test_the_nccl_and_streams_runner_refuses_without_cuda_or_a_mode(tmp_path):
    runner = [sys.executable, str(ROOT / "scripts" / "gpu_nccl.py")]
    done = subprocess.run([*runner, "bogus", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2 and "nccl-log" in done.stderr and "streams" in done.stderr
    if not torch.cuda.is_available():
        done = subprocess.run([*runner, "streams", str(tmp_path)], capture_output=True, text=True)
        assert done.returncode == 2 and "no CUDA device here" in done.stderr
