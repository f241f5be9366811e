"""The command line: demo, bench launch, the lab generator; JupyterLab serving the labs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import overlapkit as ok

ROOT = Path(__file__).resolve().parents[1]


def run(*args, timeout=300, cwd=ROOT):
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def here(capsys, *args) -> str:
    """``python -m overlapkit ARGS``, run in this process: what it printed (a bench's
    ranks start from this process's warm forkserver; the command itself is run as a
    program by the launch bench's test and the torchrun ones)."""
    from overlapkit.__main__ import main  # noqa: PLC0415

    capsys.readouterr()
    assert main(list(args)) in (0, None)
    return capsys.readouterr().out


def test_demo_prints_its_tables_and_writes_a_timeline_picture(tmp_path):
    out = run("-m", "overlapkit", "demo", "--out", str(tmp_path / "demo.png"))
    assert "1. 4 ranks" in out and "fit: α =" in out
    assert "serial" in out and "overlapped" in out and "overlap_ratio" in out
    assert f"timeline picture: {tmp_path / 'demo.png'}" in out
    png = (tmp_path / "demo.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000


def test_bench_launch_writes_rows_for_cold_warm_and_spawn(tmp_path):
    out_json = tmp_path / "launch.json"
    out_csv = tmp_path / "launch.csv"
    args = ["--world-size", "2", "--reps", "2", "--cold-reps", "1", "--spawn-reps", "1"]
    out = run(
        "-m", "overlapkit", "bench", "launch", *args, "--json", str(out_json), "--csv", str(out_csv)
    )
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["method"] for r in rows] == ["ok.launch cold", "ok.launch warm", "mp.spawn"]
    assert [r["reps"] for r in rows] == [1, 2, 1]
    assert all(r["median_s"] > 0 and r["min_s"] <= r["median_s"] <= r["max_s"] for r in rows)
    warm = rows[1]
    assert warm["x_warm"] == 1.0
    assert "faster than torch.multiprocessing.spawn" in out
    assert out_csv.read_text().splitlines()[0].startswith("method,world_size,reps,median_s")


def test_labgen_check_passes_on_the_committed_labs():
    assert "up to date" in run("-m", "overlapkit.labgen", "generate", "--check")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_make_lab_starts_jupyterlab_serving_the_labs():
    """Runs the real `make lab` recipe on this venv (``-o``: do not reinstall)."""
    port = _free_port()
    venv = Path(sys.prefix)
    jupyter_args = (
        f"--no-browser --port={port} --ServerApp.ip=127.0.0.1 "
        "--IdentityProvider.token=overlapkit-test --ServerApp.port_retries=0"
    )
    cmd = [
        "make",
        "-s",
        "-o",
        str(venv / ".overlapkit-installed"),
        "lab",
        f"VENV={venv}",
        f"JUPYTER_ARGS={jupyter_args}",
    ]
    server = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/api/contents?token=overlapkit-test"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    listing = json.load(response)
                break
            except OSError:
                if server.poll() is not None:
                    pytest.fail(
                        f"make lab exited with {server.returncode}:\n{server.stdout.read()}"
                    )
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        names = {item["name"] for item in listing["content"]}
        assert "00_getting_started.ipynb" in names
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}/lab?token=overlapkit-test", timeout=10
        ) as r:
            assert r.status == 200 and b"JupyterLab" in r.read()
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have died already
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_bench_collectives_reports_busbw_ratios_and_model_columns(tmp_path, capsys):
    plain = tmp_path / "plain.json"
    here(capsys, "bench", "collectives", "--sizes", "4K,256K", "--world-sizes", "2",
        "--reps", "2", "--json", str(plain))  # fmt: skip
    rows = json.loads(plain.read_text())["rows"]
    assert [(r["bytes"], r["algorithm"]) for r in rows] == [
        (4096, "naive"), (4096, "ring"), (4096, "builtin"),
        (262144, "naive"), (262144, "ring"), (262144, "builtin"),
    ]  # fmt: skip
    for r in rows:  # busbw = algbw × 2(N−1)/N, and N = 2
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["time_ms"] / 1e3) / 1e9)
    assert [r["x_builtin"] for r in rows if r["algorithm"] == "builtin"] == [1.0, 1.0]

    linked = tmp_path / "linked.json"
    out = here(capsys, "bench", "collectives", "--sizes", "1M", "--world-sizes", "3",
              "--reps", "2", "--link", "100,0.2", "--json", str(linked))  # fmt: skip
    assert "Link(100 µs, 0.2 GB/s): fitted from a ping-pong over it" in out
    data = json.loads(linked.read_text())
    assert [r["algorithm"] for r in data["rows"]] == ["naive", "ring"]
    link = ok.Link(100, 0.2)
    for r in data["rows"]:
        # the machine's own share, measured in the same launch: its row says which sets the
        # pace by the rule the table states (machine at 80% of the link's own cost). Not
        # "under the measured time": where the machine is the limit the two are equal but
        # for noise (12.75 ms against 12.61 ms in a fresh-clone run)
        model = {"naive": ok.costmodel.naive_all_reduce, "ring": ok.costmodel.ring_all_reduce}
        link_only = model[r["algorithm"]](2**20, 3, link.alpha, link.beta) * 1e3
        assert r["machine_ms"] > 0
        assert r["limit"] == ("machine" if r["machine_ms"] >= 0.8 * link_only else "link"), r
        assert r["machine_ms"] < 3 * r["time_ms"], r  # without the link, not much slower
        # the emulated link is a lower bound on the ring: 2(N−1)·(α + S/N·β)
        assert r["bound_ms"] == pytest.approx(4 * (100e-6 + 2**20 / 3 / 0.2e9) * 1e3)
        assert 0 < r["efficiency"] <= 1.0 and r["model_ms"] > 0


def test_bench_ddp_compares_the_wrappers_with_torch_ddp_and_names_the_best(tmp_path, capsys):
    out_json = tmp_path / "ddp.json"
    out = here(capsys, "bench", "ddp", "--layers", "3", "--width", "64", "--batch",
              "16", "--buckets", "0.01,1", "--reps", "2", "--warmup", "1", "--link", "50,1",
              "--json", str(out_json))  # fmt: skip
    data = json.loads(out_json.read_text())
    configs = [(r["config"], r["bucket_mb"]) for r in data["rows"]]
    assert [c for c, _ in configs[:2]] == ["naive", "overlap"]
    assert [c for c in configs if c[0] == "bucketed"] == [("bucketed", 0.01), ("bucketed", 1)]
    assert [c for c in configs if c[0] == "torch"] == [("torch", 0.01), ("torch", 1)]
    for r in data["rows"]:
        assert r["step_ms"] > 0 and r["predicted_ms"] > 0
        assert r["x_naive"] == pytest.approx(r["step_ms"] / data["rows"][0]["step_ms"])
    assert data["meta"]["link"] == "Link(50 µs, 1 GB/s)" and data["meta"]["batch"] == 16
    assert "best bucket size: measured" in out and "best configuration:" in out


def test_bench_pipeline_reports_bubble_hidden_share_and_predictions(tmp_path, capsys):
    out_json = tmp_path / "pipe.json"
    out = here(capsys, "bench", "pipeline", "--layers", "2", "--width", "32",
              "--batch", "8", "--micro", "1,2", "--schedules", "gpipe,1f1b", "--reps", "1",
              "--warmup", "1", "--json", str(out_json))  # fmt: skip
    rows = json.loads(out_json.read_text())["rows"]
    got = [(r["schedule"], r["m"], r["overlap"]) for r in rows]
    assert got == [(s, m, o) for s in ("gpipe", "1f1b") for m in (1, 2) for o in ("off", "on")]
    for r in rows:
        assert r["step_ms"] > 0 and r["predicted_ms"] > 0 and 0 <= r["bubble"] < 1
        assert r["theory"] == pytest.approx(1 / (r["m"] + 1))
        assert r["peak_act"] == (r["m"] if r["schedule"] == "gpipe" else min(2, r["m"]))
        if r["overlap"] == "off":
            assert r["hidden"] == 0  # a blocking send hides nothing
    assert "sized so one transfer costs 30%" in out and "best schedule:" in out
    assert "torch.distributed.pipelining" in out


def test_bench_hybrid_compares_allreduce_starts_on_a_mesh_with_hot_spots(tmp_path, capsys):
    out_json = tmp_path / "hybrid.json"
    out = here(capsys, "bench", "hybrid", "--layers", "2", "--width", "32",
              "--batch", "8", "--micro", "1,2", "--reps", "1", "--warmup", "1", "--json",
              str(out_json), "--png", str(tmp_path / "h.png"), "--trace",
              str(tmp_path / "h.trace.json"))  # fmt: skip
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["micro"], r["config"]) for r in rows] == [
        (m, c) for m in (1, 2) for c in ("flush", "after", "overlap")
    ]
    for r in rows:
        assert r["step_ms"] > 0 and r["predicted_ms"] > 0 and r["limit"] in ("link", "machine")
        assert r["config"] != "flush" or r["dp_hidden"] == 0  # after the flush: nothing hides
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    assert "traceEvents" in json.loads((tmp_path / "h.trace.json").read_text())
    assert "hot spots of the median overlapped step" in out and "against a cool-down" in out


def test_bench_fsdp_compares_prefetch_modes_with_ddp_the_model_and_fully_shard(tmp_path, capsys):
    out_json = tmp_path / "fsdp.json"
    out = here(capsys, "bench", "fsdp", "--units", "3", "--width", "64", "--batch",
              "8", "--reps", "1", "--warmup", "1", "--json", str(out_json), "--png",
              str(tmp_path / "fsdp.png"))  # fmt: skip
    data = json.loads(out_json.read_text())
    rows = {r["config"]: r for r in data["rows"]}
    assert list(rows) == ["fsdp none", "fsdp implicit", "fsdp explicit", "ddp"]
    assert (tmp_path / "fsdp.png").read_bytes()[:4] == b"\x89PNG"
    # without prefetch a unit computes only after its AllGather is over (but for the
    # moment between the wait's return and the communication thread's end mark)
    assert rows["fsdp none"]["x_none"] == 1 and rows["fsdp none"]["fwd_hidden"] < 0.1
    whole = rows["ddp"]["params_mib"]
    unit = (64 * 64 + 64) * 4 / 2**20
    assert whole == pytest.approx(3 * unit)
    for name in ("fsdp none", "fsdp explicit"):  # the shards and at most two whole units
        assert rows[name]["params_mib"] <= whole / 2 + 2 * unit + 1e-9
        assert rows[name]["step_ms"] > 0 and rows[name]["predicted_ms"] > 0
        # the in-step prediction adds what the host's transfers cost: never less
        assert rows[name]["in_step_pred_ms"] > 0
    assert "one unit's AllGather" in out and "explicit prefetch: step" in out
    assert "timed in a step's conditions" in out and "at most 67%" in out
    assert "beside torch's fully_shard" in out or "fully_shard: not compared here" in out
    assert data["meta"]["units"] == 3


def test_bench_tp_sweeps_chunks_of_both_decomposed_matmuls_against_serial(tmp_path, capsys):
    out_json = tmp_path / "tp.json"
    out = here(capsys, "bench", "tp", "--rows", "8", "--width", "32", "--chunks",
              "1,2", "--reps", "1", "--warmup", "1", "--json", str(out_json))  # fmt: skip
    rows = json.loads(out_json.read_text())["rows"]
    got = [(r["op"], r["chunks"]) for r in rows]
    ops = ("AllGather-matmul", "matmul-ReduceScatter")
    assert got == [(op, k) for op in ops for k in ("serial", 1, 2)]
    for r in rows:
        assert r["step_ms"] > 0 and r["predicted_ms"] > 0 and 0 <= r["hidden"] <= 1
        if r["chunks"] == "serial":
            assert r["x_serial"] == 1 and r["hidden"] == 0
    assert "sized so the serial collective's transfer" in out
    assert "AllGather-matmul: best chunks" in out and "the model's best" in out


def test_bench_moe_sweeps_chunk_counts_against_the_serial_layer(tmp_path, capsys):
    out_json = tmp_path / "moe.json"
    out = here(capsys, "bench", "moe", "--tokens", "16", "--d-model", "8",
              "--d-hidden", "16", "--chunks", "2", "--reps", "1", "--warmup", "1",
              "--json", str(out_json))  # fmt: skip
    rows = json.loads(out_json.read_text())["rows"]
    got = [(r["schedule"], r["chunks"]) for r in rows]  # the serial layer always runs
    assert got == [("pipelined", 1), ("pipelined", 2), ("local first", 1), ("local first", 2)]
    assert rows[0]["x_serial"] == 1 and rows[0]["hidden"] == 0
    for r in rows:
        assert r["step_ms"] > 0 and r["predicted_ms"] > 0 and r["host_ms"] >= 0
        assert (r["local_ms"] > 0) == (r["schedule"] == "local first")
    assert "pipelined: best chunk count" in out and "local first: best chunk count" in out
    assert "one expert each" in out


def test_bench_collectives_runs_unchanged_under_torchrun_and_rank_0_alone_reports(tmp_path):
    """torchrun --standalone --nproc-per-node 2 -m overlapkit bench collectives: ok.launch
    runs in place on torchrun's ranks; one table is printed and one JSON file written."""
    out_json = tmp_path / "bench.json"
    out = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "-m", "overlapkit", "bench", "collectives", "--sizes", "64K", "--world-sizes",
              "2,4", "--reps", "2", "--warmup", "1", "--json", str(out_json))  # fmt: skip
    rows = json.loads(out_json.read_text())["rows"]
    assert rows and all(r["world"] == 2 for r in rows)  # torchrun's 2, not the asked 4
    assert "under torchrun: 2 ranks (--world-sizes ignored)" in out
    assert out.count("algorithm") == 1, out  # rank 1 printed nothing


def test_a_labs_core_runs_as_a_script_and_unchanged_under_torchrun():
    alone = run("-m", "overlapkit", "lab", "03")
    assert "ring_all_reduce" in alone and "busbw_gbps" in alone
    out = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "-m", "overlapkit", "lab", "09")  # fmt: skip
    assert out.count("lab 09: synchronous, stale and local SGD") == 1, out  # rank 0 reports
    assert all(mode in out for mode in ("sync", "stale", "local"))


def test_an_unknown_lab_is_refused_with_the_list():
    proc = subprocess.run([sys.executable, "-m", "overlapkit", "lab", "42"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert proc.returncode != 0 and "no lab '42': choose one of 00, 01" in proc.stderr


def test_bench_compression_compares_compressors_with_plain_from_their_own_byte_counts(
    tmp_path, capsys
):
    out_json = tmp_path / "compression.json"
    out = here(capsys, "bench", "compression", "--steps", "6", "--hidden", "32",
              "--configs", "none,topk 1%,powersgd r4", "--json", str(out_json))  # fmt: skip
    assert "one plain AllReduce" in out
    rows = {r["config"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert list(rows) == ["none", "topk 1%", "powersgd r4"]
    assert rows["none"]["x_bytes"] == 1 and rows["none"]["x_step"] == 1
    # lab 13's task (16 outputs), 2640 gradients: plain 2(N−1)/N·4·2640 bytes; top-k 26
    # values and indices; PowerSGD rank 4 on the 32×32, 32×32 and 16×32 matrices, the rest whole
    assert rows["none"]["kib_sent"] == pytest.approx(2640 * 4 / 1024)
    assert rows["topk 1%"]["kib_sent"] == pytest.approx(26 * 12 / 1024)
    assert 0 < rows["powersgd r4"]["x_bytes"] < 0.6
    for r in rows.values():
        assert r["step_ms"] > 0 and r["predicted_ms"] > 0 and r["loss"] > 0
    assert rows["topk 1%"]["pays_below_gbps"] > 0
