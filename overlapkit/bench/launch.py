"""bench launch: how long it takes to start N ranks, ok.launch against torch.multiprocessing.spawn.

Each method runs the same job — join a gloo process group through a FileStore,
return, leave — so the difference is the cost of starting ranks:

* cold  — the first ``ok.launch`` in a fresh Python process (starts the forkserver,
          which imports torch once), measured in new subprocesses;
* warm  — later ``ok.launch`` calls in the same process (fork from the forkserver);
* spawn — ``torch.multiprocessing.spawn``: every rank is a new interpreter that
          imports torch itself.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as tmp
from tqdm.auto import tqdm

from ..launcher import launch
from .table import format_table, write


def _noop():
    return None


def _spawned_rank(rank, world, store_path):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    dist.destroy_process_group()


def time_spawn(world: int, attempts: int = 2) -> float:
    # gloo's full-mesh connect failed once here in ~20 spawn runs ("Connection
    # closed by peer"); a benchmark should report that, not die of it
    for attempt in range(attempts):
        with tempfile.TemporaryDirectory(prefix="overlapkit-spawn-") as d:
            start = time.perf_counter()
            try:
                tmp.spawn(
                    _spawned_rank, args=(world, os.path.join(d, "store")), nprocs=world, join=True
                )
            except Exception as exc:
                if attempt + 1 == attempts:
                    raise
                first_line = str(exc).splitlines()[0][:120]
                print(f"mp.spawn failed ({first_line}); retrying", file=sys.stderr)
                continue
            return time.perf_counter() - start
    raise AssertionError("unreachable")


_COLD_SNIPPET = """
import json, time, overlapkit as ok
start = time.perf_counter()
ok.launch(lambda: None, world_size={world})
print(json.dumps(time.perf_counter() - start))
"""


def time_cold(world: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _COLD_SNIPPET.format(world=world)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def time_warm(world: int) -> float:
    start = time.perf_counter()
    launch(_noop, world_size=world)
    return time.perf_counter() - start


def run(
    world: int = 4,
    reps: int = 10,
    cold_reps: int = 3,
    spawn_reps: int = 3,
    csv_path=None,
    json_path=None,
) -> list[dict]:
    launch(_noop, world_size=world)  # start this process's forkserver: later calls are warm
    samples: dict[str, list[float]] = {"cold": [], "warm": [], "spawn": []}
    # interleave the methods in rounds, so that a noisy minute hurts all of them alike
    plan, rounds, warm_left = [], max(cold_reps, spawn_reps, 1), reps
    for k in range(rounds):
        plan += ["cold"] * (k < cold_reps)
        n = math.ceil(warm_left / (rounds - k))
        plan += ["warm"] * n
        warm_left -= n
        plan += ["spawn"] * (k < spawn_reps)
    timers = {"cold": time_cold, "warm": time_warm, "spawn": time_spawn}
    for method in tqdm(plan, desc=f"launching {world} ranks", unit="launch", leave=False):
        samples[method].append(timers[method](world))
    warm = statistics.median(samples["warm"]) if samples["warm"] else float("nan")
    rows = []
    for method, values in samples.items():
        if not values:
            continue
        med = statistics.median(values)
        rows.append(
            {
                "method": {"cold": "ok.launch cold", "warm": "ok.launch warm", "spawn": "mp.spawn"}[
                    method
                ],
                "world_size": world,
                "reps": len(values),
                "median_s": med,
                "min_s": min(values),
                "max_s": max(values),
                "x_warm": med / warm,
            }
        )
    print(format_table(rows))
    spawn = next((r["median_s"] for r in rows if r["method"] == "mp.spawn"), None)
    if spawn:
        print(
            f"\nwarm ok.launch is {spawn / warm:.0f}x faster than torch.multiprocessing.spawn "
            f"for {world} ranks (same run, medians)"
        )
    write(rows, csv_path, json_path, meta={"bench": "launch", "python": sys.version.split()[0]})
    return rows
