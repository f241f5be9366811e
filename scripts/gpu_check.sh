#!/usr/bin/env bash
# Every GPU check of the kit in one bounded run, and a report an instructor can paste back.
#
#   scripts/gpu_check.sh --list   the checks, one per line, with the GPUs each needs; runs nothing
#   scripts/gpu_check.sh          runs them (without CUDA: each one SKIP, with the reason; exit 0)
#
# Each check ends as PASS, FAIL or SKIP with its reason, and says where its ranks ran: a line
# "backend=... devices=..." from the ranks themselves (ok.backend(), ok.device()). A check FAILS
# when it fell back to the CPU: ranks that each could have had a GPU (no more ranks than GPUs)
# whose backend has no NCCL or whose device is the CPU, or a test's tensor that is not on CUDA.
# What needs more GPUs than there are is skipped, saying so. A 1-GPU box is the hosted
# notebooks' case: there ranks run gloo on the CPU and the CUDA parts run in-process on cuda:0.
#
# The checks (in this order; --list shows them):
#   link, compression, tensor-parallel, hybrid, fsdp, pipeline: tests/test_gpu_paths.py, one
#       area at a time (pytest -k cuda_<area>): CUDA tensors on the ranks' own GPUs against a
#       single-process reference;
#   gpu-tests: the other tests marked @pytest.mark.gpu (tests/test_*.py);
#   bench, demo: `python -m overlapkit bench collectives` (short) and `python -m overlapkit demo`;
#   nccl-log, streams, nsys: scripts/gpu_nccl.py: a real NCCL_DEBUG=INFO log (nccl_debug.log in
#       the logs folder), two CUDA streams with events and record_stream, and where Nsight
#       Systems is installed, a report (overlap.nsys-rep) of an AllReduce under matmuls;
#   notebook:NN_name: each solution notebook under nbval, while time is left.
# Each step runs under `timeout`, within what is left of the budget; the whole run ends within
# GPU_CHECK_BUDGET_S seconds (default 570, under ten minutes) and never hangs. No network, no
# make (which runs pip): the kit as installed, run with $PYTHON.
#
# Environment:
#   PYTHON              the interpreter (default .venv/bin/python if it exists, else python,
#                       else python3)
#   OUT                 where the report and the logs go (default: a new temporary folder)
#   GPU_CHECK_BUDGET_S  seconds the whole run may take (default 570)
#   GPU_CHECK_ONLY      comma-separated checks to run (e.g. link,bench; "notebooks": all of
#                       them); the others are reported SKIP
#   GPU_CHECK_FAKE_GPUS the script's own tests: act as if there were this many GPUs
# Exit status: 0 when no check failed (skips included), 1 when one did, 2 on bad usage or when
# $PYTHON cannot import torch.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD

usage() {
    sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
}

LIST=0
case "${1:-}" in
    "") ;;
    --list) LIST=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (try --list or --help)" >&2; exit 2 ;;
esac
if [ $# -gt 1 ]; then
    echo "gpu_check.sh: one argument at most (--list or --help)" >&2
    exit 2
fi

# ------------------------------------------------------------------------------ the checks
# name | GPUs it needs to run at all | GPUs for all of it | its own time limit (s) | what
CHECKS=(
    "link|1|3|120|CUDA ranks over an emulated ok.Link: ring all-reduce (sum, max) and p2p of CUDA tensors, the link's latency paid; on 1 GPU a world of one, and 2 gloo ranks sharing cuda:0 [pytest tests/test_gpu_paths.py -k cuda_link]"
    "compression|1|2|120|ok.compression on CUDA buckets (Half, TopK, PowerSGD) and BucketedDDP with a compressor, against one process [pytest tests/test_gpu_paths.py -k cuda_compression]"
    "tensor-parallel|1|3|150|ok.tensor_parallel on CUDA: column/row-parallel MLP (and sequence parallel), decomposed all_gather_matmul / matmul_reduce_scatter [pytest tests/test_gpu_paths.py -k cuda_tp]"
    "hybrid|1|4|150|ok.hybrid on CUDA: dp x pp meshes 1x1, 2x1, 1x2, 2x2 (overlap, flush) train as one device [pytest tests/test_gpu_paths.py -k cuda_hybrid]"
    "fsdp|1|3|150|ok.fsdp.FullyShardedDP on CUDA: prefetch none/implicit/explicit, ring and built-in, over a link, against one device [pytest tests/test_gpu_paths.py -k cuda_fsdp]"
    "pipeline|1|3|150|the pipeline on CUDA: stages on streams of one GPU (every schedule), and on their own GPUs over a link [pytest tests/test_gpu_paths.py -k cuda_pipeline]"
    "gpu-tests|1|2|240|the other @pytest.mark.gpu tests (tests/test_*.py): NCCL ranks, CUDA streams and timelines, DDP, FSDP, MoE, pipeline [pytest -m gpu]"
    "bench|1|2|120|python -m overlapkit bench collectives --sizes 1MB,16MB --reps 3 on as many ranks as GPUs (2 on one GPU: gloo on the CPU)"
    "demo|1|4|180|python -m overlapkit demo: 4 ranks, a ping-pong and a timeline picture on 2"
    "nccl-log|1|2|120|NCCL_DEBUG=INFO of two all_reduces on as many NCCL ranks as GPUs (up to 8), kept as nccl_debug.log in the logs folder, to read as lab 10 reads the shipped one [scripts/gpu_nccl.py nccl-log]"
    "streams|1|1|60|two CUDA streams ordered by events, a tensor kept for the side stream by record_stream, against one stream [scripts/gpu_nccl.py streams]"
    "nsys|1|1|120|where Nsight Systems is installed: overlap.nsys-rep of an all_reduce on its own stream under matmuls, one NCCL rank [nsys profile scripts/gpu_nccl.py overlap]"
)
for nb in solutions/*.ipynb; do
    [ -e "$nb" ] || continue
    CHECKS+=("notebook:$(basename "$nb" .ipynb)|1|1|150|$nb under nbval, if time is left")
done

needs_text() {  # needs_text MIN FULL
    local s="needs $1 GPU"
    [ "$1" -gt 1 ] && s+="s"
    if [ "$2" -gt "$1" ]; then s+=" ($2 for all of it)"; fi
    printf '%s' "$s"
}

if [ "$LIST" = 1 ]; then
    for entry in "${CHECKS[@]}"; do
        IFS='|' read -r name min full _ what <<<"$entry"
        printf '%-35s %-29s %s\n' "$name" "$(needs_text "$min" "$full")" "$what"
    done
    exit 0
fi

# ------------------------------------------------------------------------------ set-up
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
elif command -v python >/dev/null 2>&1; then
    PY=python
else
    PY=python3
fi
BUDGET_S=${GPU_CHECK_BUDGET_S:-570}
case "$BUDGET_S" in '' | *[!0-9]*) echo "GPU_CHECK_BUDGET_S must be whole seconds" >&2; exit 2 ;; esac
RESERVE_S=15  # kept for the report at the end
MIN_STEP_S=20 # a step with less than this left is skipped, not started
START=$SECONDS
if [ -n "${OUT:-}" ]; then
    DIR=$OUT
else
    DIR=$(mktemp -d "${TMPDIR:-/tmp}/overlapkit-gpu-check.XXXXXX") || exit 2
fi
LOGS=$DIR/gpu-check-logs
REPORT=$DIR/gpu-check-report.txt
mkdir -p "$LOGS" || exit 2
export PYTHONPATH="$LOGS:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# no network (pip); the notebooks' kernels keep their connection files in $LOGS
export MPLBACKEND=Agg PYTHONDONTWRITEBYTECODE=1 PIP_NO_INDEX=1
export JUPYTER_RUNTIME_DIR=$LOGS/jupyter-runtime

left() { echo $((BUDGET_S - (SECONDS - START) - RESERVE_S)); }

# the pytest plugin (and IPython start-up file) that makes every ok.launch report, from each
# rank, its backend and device: one JSON line per rank in $GPU_CHECK_RECORD
cat >"$LOGS/gpu_check_plugin.py" <<'PYEOF'
"""scripts/gpu_check.sh's hook: every ``ok.launch`` of a test (or notebook) records, from
each of its ranks, ``ok.backend()`` and ``ok.device()`` (a JSON line per rank, and one from
the caller, in $GPU_CHECK_RECORD). Nothing else changes: the rank then runs the function."""
import json
import os

_now = {"test": os.environ.get("GPU_CHECK_TEST"), "launch": 0}


def _write(path, record):
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except OSError:
        pass


def _reporting(fn, test, launch, path):
    def reporting_rank(*args, **kwargs):
        try:
            import overlapkit as kit

            _write(path, {"test": test, "launch": launch, "rank": kit.rank(),
                          "world": kit.world_size(), "backend": str(kit.backend()),
                          "device": str(kit.device())})
        except Exception:  # never the test's failure
            pass
        return fn(*args, **kwargs)

    return reporting_rank


def install():
    path = os.environ.get("GPU_CHECK_RECORD")
    if not path:
        return
    import overlapkit

    original = overlapkit.launch
    if getattr(original, "gpu_check", False):
        return

    def launch(fn, *args, **kwargs):
        test = _now["test"]
        if test is not None and callable(fn):
            _now["launch"] += 1
            _write(path, {"test": test, "launch": _now["launch"], "caller": True,
                          "world": kwargs.get("world_size"),
                          "asked": str(kwargs.get("backend", "auto"))})
            fn = _reporting(fn, test, _now["launch"], path)
        return original(fn, *args, **kwargs)

    launch.gpu_check = True
    overlapkit.launch = launch


def pytest_configure(config):
    install()


def pytest_runtest_logstart(nodeid, location):
    _now["test"] = nodeid
PYEOF
mkdir -p "$LOGS/ipython/profile_default/startup"
cat >"$LOGS/ipython/profile_default/startup/00-gpu-check.py" <<'PYEOF'
try:  # scripts/gpu_check.sh: report each ok.launch's backend and devices (never an error)
    import gpu_check_plugin

    gpu_check_plugin.install()
except Exception:
    pass
PYEOF

# verdicts from a step's junit XML / log and its ranks' records
cat >"$LOGS/gpu_check_summary.py" <<'PYEOF'
"""scripts/gpu_check.sh's verdicts. Prints "VERDICT<TAB>reason<TAB>backend/devices", then one
line per test. Usage: pytest XML LOG RC RECORD GPUS LIMIT | run LOG RC GPUS LIMIT"""
import json
import re
import sys
import xml.etree.ElementTree as ET

STOPPED = (124, 137)


def fell_back(world, gpus, asked, backends, devices):
    """Ranks that could each have had a GPU but ran without NCCL or on the CPU."""
    if world is None or world > gpus or asked not in ("auto", "nccl", "None"):
        return False
    return any("nccl" not in b for b in backends) or any(
        not d.startswith("cuda") for d in devices
    )


def launches(record):
    """test -> launch -> {"world", "asked", "ranks": {rank: (backend, device)}}"""
    out = {}
    try:
        lines = open(record, encoding="utf-8").read().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        one = out.setdefault(r["test"], {}).setdefault(
            r["launch"], {"world": r.get("world"), "asked": "auto", "ranks": {}}
        )
        if r.get("caller"):
            one["world"], one["asked"] = r.get("world"), r.get("asked", "auto")
        else:
            one["ranks"][r["rank"]] = (r["backend"], r["device"])
            one["world"] = one["world"] or r.get("world")
    return out


def describe(one, gpus):
    ranks = one["ranks"]
    world = one["world"]
    if not ranks:
        return f"(world {world}: its ranks never reported)", False
    backends = sorted({b for b, _ in ranks.values()})
    devices = [ranks[r][1] for r in sorted(ranks)]
    text = f"backend={','.join(backends)} devices={','.join(devices)}"
    if world is not None and world > gpus:
        text += f" ({world} ranks > {gpus} GPU{'s' if gpus != 1 else ''}: gloo on the CPU)"
    return text, fell_back(world, gpus, one["asked"], backends, devices)


def cases_from_xml(path):
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        if classname.endswith(".ipynb"):  # nbval's cells
            nodeid = f"{classname.removesuffix('.ipynb').replace('.', '/')}.ipynb::{name}"
        else:
            nodeid = f"{classname.replace('.', '/')}.py::{name}" if classname else name
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        skipped = case.find("skipped")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if skipped is not None:
            reason = skipped.get("message", "").removeprefix("Skipped: ")
            yield nodeid, "SKIP", reason, props
        elif bad is not None:
            text = (bad.get("message") or bad.text or "").strip().splitlines()
            yield nodeid, "FAIL", (text[0] if text else "failed")[:300], props
        else:
            yield nodeid, "PASS", "", props


VERDICT = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def cases_from_log(path):
    """pytest -v's lines: what finished before the step was stopped, and what was running."""
    try:
        lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    except OSError:
        return
    started = None
    for line in lines:
        m = VERDICT.match(line)
        if m:
            word = {"PASSED": "PASS", "SKIPPED": "SKIP", "XFAIL": "PASS"}.get(m[2], "FAIL")
            yield m[1], word, "" if word != "FAIL" else m[2].lower(), {}
            started = None
        elif re.match(r"^\S+::\S+\s*$", line):
            started = line.strip()
    if started:
        yield started, "FAIL", "still running when the step was stopped", {}


def pytest_verdict(xml, log, rc, record, gpus, limit, whole=None):
    """``whole``: the name every launch of the step was recorded under (a notebook's, whose
    cells are its tests): those launches judge the step; only failing cells are listed."""
    try:
        cases = list(cases_from_xml(xml))
    except (OSError, ET.ParseError):
        cases = list(cases_from_log(log))
    ran = launches(record)
    lines, seen, failed, passed, skipped = [], [], [], 0, []
    if whole is not None:
        where = [describe(one, gpus) for _, one in sorted(ran.get(whole, {}).items())]
        seen = list(dict.fromkeys(t for t, _ in where))
        fell = [t for t, fb in where if fb]
        if fell:
            failed.append("fell back to the CPU: " + "; ".join(fell))
    for nodeid, verdict, reason, props in cases:
        where = [describe(one, gpus) for _, one in sorted(ran.get(nodeid, {}).items())]
        texts = list(dict.fromkeys(t for t, _ in where))
        if props.get("backend_devices"):
            texts.append(props["backend_devices"])
        if verdict == "PASS" and any(fb for _, fb in where):
            verdict = "FAIL"
            reason = "fell back to the CPU: " + "; ".join(t for t, fb in where if fb)
        line = f"{verdict}  {nodeid}"
        if reason:
            line += f": {reason}"
        if texts and verdict != "SKIP":
            line += "  [" + "; ".join(texts) + "]"
        if whole is None or verdict == "FAIL":
            lines.append(line)
        seen += [t for t in texts if t not in seen]
        if verdict == "FAIL":
            failed.append(f"{nodeid.split('::')[-1]}: {reason}")
        elif verdict == "PASS":
            passed += 1
        else:
            skipped.append(reason)
    devices = "; ".join(seen[:4]) + (f"; … ({len(seen) - 4} more)" if len(seen) > 4 else "")
    unit = "cell" if whole is not None else "test"
    if rc in STOPPED:
        why = f"stopped at its time limit ({limit} s)"
        why += f"; {len(failed)} failed: {failed[0]}" if failed else ""
        return "FAIL", why, devices, lines
    if failed and failed[0].startswith("fell back"):
        return "FAIL", failed[0], devices, lines
    if failed:
        why = f"{len(failed)} of {len(cases)} {unit}{'s' * (len(cases) != 1)} failed; " \
            f"first: {failed[0]}"
        return "FAIL", why, devices, lines
    if rc not in (0, 5) or (rc == 5 and not cases):
        what = {2: "was interrupted or could not start", 3: "hit an internal error",
                4: "was misused", 5: "collected no test"}.get(rc, f"exited {rc}")
        return "FAIL", f"pytest {what} (see the log)", devices, lines
    if passed:
        why = f"{passed} {unit}{'s' * (passed != 1)} passed"
        why += f", {len(skipped)} skipped" if skipped else ""
        return "PASS", why, devices, lines
    reasons = list(dict.fromkeys(skipped))
    return "SKIP", "every test skipped: " + " | ".join(reasons[:3]), devices, lines


WHERE = re.compile(r"^backend=(\S+) devices=(\S+) \(world (\d+)\)")


def run_verdict(log, rc, gpus, limit):
    try:
        text = open(log, encoding="utf-8", errors="replace").read()
    except OSError:
        text = ""
    seen, fell = [], []
    for line in text.splitlines():
        m = WHERE.match(line)
        if not m:
            continue
        backends, devices, world = m[1].split(","), m[2].split(","), int(m[3])
        note = ""
        if world > gpus:
            note = f" ({world} ranks > {gpus} GPU{'s' if gpus != 1 else ''}: gloo on the CPU)"
        seen.append(f"backend={m[1]} devices={m[2]}{note}")
        if fell_back(world, gpus, "auto", backends, devices):
            fell.append(f"world {world}: backend={m[1]} devices={m[2]}")
    devices = "; ".join(seen)
    if rc in STOPPED:
        return "FAIL", f"stopped at its time limit ({limit} s)", devices, []
    if rc != 0:
        last = [ln for ln in text.splitlines() if re.search(r"Error|error|Traceback", ln)]
        return "FAIL", f"exited {rc}: {(last[-1] if last else 'see the log').strip()[:200]}", \
            devices, []
    if not seen:
        return "FAIL", "printed no backend/devices line", devices, []
    if fell:
        return "FAIL", "fell back to the CPU: " + "; ".join(fell), devices, []
    return "PASS", "ran to the end", devices, []


def main(argv):
    if argv[0] == "pytest":
        xml, log, rc, record, gpus, limit, *whole = argv[1:]
        result = pytest_verdict(xml, log, int(rc), record, int(gpus), limit, *whole)
    else:
        log, rc, gpus, limit = argv[1:]
        result = run_verdict(log, int(rc), int(gpus), limit)
    verdict, reason, devices, lines = result
    print(f"{verdict}\t{reason}\t{devices or '-'}")
    for line in lines:
        print(line)


main(sys.argv[1:])
PYEOF

# bench and demo: where their ranks run (one line per world size), then the command itself
cat >"$LOGS/gpu_check_run.py" <<'PYEOF'
"""scripts/gpu_check.sh: print "backend=... devices=... (world N)" for each world size in
argv[1] (from ranks launched as the command's will be), then run `python -m overlapkit
ARGS...` (argv[2:]) in this process."""
import sys

import overlapkit as ok
from overlapkit.__main__ import main


def where():
    return str(ok.backend()), str(ok.device())


for world in (int(w) for w in sys.argv[1].split(",")):
    got = ok.launch(where, world_size=world, timeout=120, quiet=True)
    backends = ",".join(sorted({b for b, _ in got}))
    print(f"backend={backends} devices={','.join(d for _, d in got)} (world {world})", flush=True)
sys.exit(main(sys.argv[2:]))
PYEOF

# ------------------------------------------------------------------------------ the machine
declare -A M=()
probe_log=$LOGS/machine.log
timeout -k 5 90 "$PY" - >"$probe_log" 2>&1 <<'PYEOF'
import importlib.util
import os
import platform

print(f"python={platform.python_version()} ({os.path.realpath(__import__('sys').executable)})")
print(f"cpus={os.cpu_count()}")
mods = ("pytest", "nbval", "psutil", "cloudpickle", "matplotlib", "overlapkit", "pytest_timeout")
print("missing=" + " ".join(m for m in mods if importlib.util.find_spec(m) is None))
try:
    import torch
except Exception as exc:  # noqa: BLE001
    print(f"error=cannot import torch: {exc}")
    raise SystemExit(0) from None
print(f"torch={torch.__version__}")
print(f"cuda_build={torch.version.cuda or 'none (a CPU build)'}")
n = 0
try:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
except Exception as exc:  # noqa: BLE001
    print(f"cuda_error={exc}")
print(f"gpus={n}")
if n:
    names = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        names.append(f"cuda:{i} {p.name} ({p.total_memory / 2**30:.0f} GiB)")
    print("names=" + "; ".join(names))
    try:
        v = torch.cuda.nccl.version()
        print("nccl=" + (".".join(map(str, v)) if isinstance(v, tuple) else str(v)))
    except Exception as exc:  # noqa: BLE001
        print(f"nccl=unknown ({exc})")
dist = torch.distributed
print(f"nccl_available={dist.is_available() and dist.is_nccl_available()}")
PYEOF
probe_rc=$?
while IFS= read -r line; do
    case "$line" in *=*) M["${line%%=*}"]=${line#*=} ;; esac
done <"$probe_log"
if [ "$probe_rc" -ne 0 ] || [ -n "${M[error]:-}" ] || [ -z "${M[torch]:-}" ]; then
    echo "gpu_check.sh: $PY cannot tell about the machine (exit $probe_rc):" >&2
    tail -n 20 "$probe_log" >&2
    exit 2
fi
GPUS=${M[gpus]:-0}
FAKE=""
if [ -n "${GPU_CHECK_FAKE_GPUS:-}" ]; then
    GPUS=$GPU_CHECK_FAKE_GPUS
    FAKE=" (GPU_CHECK_FAKE_GPUS=$GPUS: acting as if there were $GPUS; ${M[gpus]:-0} really)"
fi
DRIVER="nvidia-smi: not found"
if command -v nvidia-smi >/dev/null 2>&1; then
    DRIVER=$(timeout -k 2 20 nvidia-smi --query-gpu=index,name,driver_version,memory.total \
        --format=csv,noheader 2>&1 | sed 's/^/    /') || DRIVER="nvidia-smi failed: $DRIVER"
    DRIVER=$'nvidia-smi:\n'"$DRIVER"
fi
KIT="not a git checkout"
if command -v git >/dev/null 2>&1 && git rev-parse --git-dir >/dev/null 2>&1; then
    KIT="git $(git rev-parse --short HEAD 2>/dev/null)"
    if [ -n "$(git status --porcelain 2>/dev/null | head -n 1)" ]; then KIT+=" + local changes"; fi
fi
if [ "${M[gpus]:-0}" -gt 0 ]; then
    MACHINE="${M[gpus]} GPU(s): ${M[names]:-?}; torch ${M[torch]}, CUDA ${M[cuda_build]}, NCCL ${M[nccl]:-?}"
else
    MACHINE="no CUDA device (torch ${M[torch]}, CUDA build ${M[cuda_build]}${M[cuda_error]:+; ${M[cuda_error]}})"
fi
MACHINE+="; ${M[cpus]:-?} CPUs; Python ${M[python]:-?}$FAKE"
MISSING=" ${M[missing]:-} "

# ------------------------------------------------------------------------------ running
R_VERDICT=() R_NAME=() R_REASON=() R_DEVICES=() R_SECS=() R_DETAIL=() R_LOG=()

record() {  # record VERDICT NAME REASON DEVICES SECONDS DETAIL LOG: a check's result
    R_VERDICT+=("$1") R_NAME+=("$2") R_REASON+=("$3") R_DEVICES+=("$4") R_SECS+=("$5")
    R_DETAIL+=("$6") R_LOG+=("$7")
    printf '%-4s  %-35s %s\n' "$1" "$2" "$3"
    if [ "$4" != "-" ] && [ -n "$4" ]; then printf '      %s\n' "$4"; fi
    if [ -n "$6" ]; then printf '%s\n' "$6" | sed 's/^/        /'; fi
    write_report
}

write_report() {  # the report as it stands (rewritten after every check)
    local i n_pass=0 n_fail=0 n_skip=0
    {
        echo "overlapkit GPU check — $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname 2>/dev/null)"
        echo "kit: $KIT; scripts/gpu_check.sh with $PY"
        echo "machine: $MACHINE"
        printf '%s\n' "$DRIVER"
        [ -n "${MISSING// /}" ] && echo "python modules not installed:${MISSING% }"
        echo "budget: ${BUDGET_S} s; $((SECONDS - START)) s so far; logs: $LOGS"
        echo
        for i in "${!R_VERDICT[@]}"; do
            printf '%-4s  %-35s %s  [%s s]\n' "${R_VERDICT[$i]}" "${R_NAME[$i]}" \
                "${R_REASON[$i]}" "${R_SECS[$i]}"
            if [ "${R_DEVICES[$i]}" != "-" ] && [ -n "${R_DEVICES[$i]}" ]; then
                printf '      %s\n' "${R_DEVICES[$i]}"
            fi
            if [ -n "${R_DETAIL[$i]}" ]; then printf '%s\n' "${R_DETAIL[$i]}" | sed 's/^/        /'; fi
            case "${R_VERDICT[$i]}" in
                PASS) n_pass=$((n_pass + 1)) ;;
                FAIL) n_fail=$((n_fail + 1)) ;;
                *) n_skip=$((n_skip + 1)) ;;
            esac
        done
        echo
        echo "summary: $n_pass PASS, $n_fail FAIL, $n_skip SKIP of ${#CHECKS[@]} checks ($GPUS GPU(s))$([ "$DONE" = 1 ] || echo ' — still running')"
        for i in "${!R_VERDICT[@]}"; do
            if [ "${R_VERDICT[$i]}" = FAIL ] && [ -n "${R_LOG[$i]}" ] && [ -f "${R_LOG[$i]}" ]; then
                echo
                echo "=== FAIL ${R_NAME[$i]}: the last 40 lines of ${R_LOG[$i]} ==="
                tail -n 40 "${R_LOG[$i]}"
            fi
        done
    } >"$REPORT" 2>/dev/null
}

selected() {  # selected NAME: in GPU_CHECK_ONLY (or no selection)
    [ -z "${GPU_CHECK_ONLY:-}" ] && return 0
    local want
    IFS=',' read -ra want <<<"$GPU_CHECK_ONLY"
    for w in "${want[@]}"; do
        if [ "$w" = "$1" ] || { [ "$w" = notebooks ] && [ "${1#notebook:}" != "$1" ]; }; then
            return 0
        fi
    done
    return 1
}

summarise() {  # summarise NAME SECS LOG ARGS...: record the verdict gpu_check_summary.py gives
    local name=$1 secs=$2 log=$3 out first verdict reason devices detail
    shift 3
    out=$(timeout -k 2 30 "$PY" "$LOGS/gpu_check_summary.py" "$@" 2>&1) || true
    first=${out%%$'\n'*}
    IFS=$'\t' read -r verdict reason devices <<<"$first"
    case "$verdict" in
        PASS | FAIL | SKIP) ;;
        *) verdict=FAIL reason="could not read its results: ${first:0:200}" devices=- ;;
    esac
    detail=""
    if [ "$out" != "$first" ]; then detail=${out#*$'\n'}; fi
    record "$verdict" "$name" "$reason" "$devices" "$secs" "$detail" "$log"
}

DONE=0
echo "overlapkit GPU check: $MACHINE"
echo "budget ${BUDGET_S} s; logs in $LOGS"
echo
if [ "$GPUS" -eq 0 ]; then
    NO_GPU="no CUDA device here"
fi
PYTEST_COMMON=(-m pytest -v -p no:cacheprovider -p gpu_check_plugin -rfEs --tb=short -m gpu)
GPU_FILES=()
for f in tests/test_*.py; do
    case "$f" in tests/test_gpu_paths.py | tests/test_gpu_check.py) continue ;; esac
    grep -q "pytest.mark.gpu" "$f" && GPU_FILES+=("$f")
done

for entry in "${CHECKS[@]}"; do
    IFS='|' read -r name min full cap _ <<<"$entry"
    slug=$(printf '%s' "$name" | tr -c 'A-Za-z0-9._-' '_')
    log=$LOGS/$slug.log
    if ! selected "$name"; then
        record SKIP "$name" "not selected (GPU_CHECK_ONLY=$GPU_CHECK_ONLY)" - 0 "" ""
        continue
    fi
    if [ "$GPUS" -lt "$min" ]; then
        reason="${NO_GPU:-only $GPUS GPU(s) here}: $(needs_text "$min" "$full")"
        record SKIP "$name" "$reason" - 0 "" ""
        continue
    fi
    budget_left=$(left)
    if [ "$budget_left" -lt "$MIN_STEP_S" ] || { [ "${name#notebook:}" != "$name" ] && [ "$budget_left" -lt 60 ]; }; then
        record SKIP "$name" "out of time: ${budget_left} s of the ${BUDGET_S} s budget left" - 0 "" ""
        continue
    fi
    limit=$((cap < budget_left ? cap : budget_left))
    began=$SECONDS
    record_file=$LOGS/$slug.ranks.jsonl
    xml=$LOGS/$slug.xml
    rm -f "$record_file" "$xml"
    printf '....  %-35s running (limit %s s)\n' "$name" "$limit"
    case "$name" in
        link | compression | tensor-parallel | hybrid | fsdp | pipeline | gpu-tests)
            if [[ "$MISSING" == *" pytest "* ]]; then
                record FAIL "$name" "pytest is not installed for $PY" - 0 "" ""
                continue
            fi
            args=("${PYTEST_COMMON[@]}" "--junitxml=$xml")
            per_test=100
            if [ "$name" = gpu-tests ]; then
                args+=(${GPU_FILES[@]+"${GPU_FILES[@]}"})
                per_test=120
            else
                keyword=cuda_$name
                [ "$name" = tensor-parallel ] && keyword=cuda_tp
                args+=(tests/test_gpu_paths.py -k "$keyword")
            fi
            # a test that hangs fails alone (pytest-timeout), not the whole step
            if [[ "$MISSING" != *" pytest_timeout "* ]]; then args+=("--timeout=$per_test"); fi
            GPU_CHECK_RECORD=$record_file timeout -k 5 "$limit" "$PY" "${args[@]}" \
                </dev/null >"$log" 2>&1
            rc=$?
            summarise "$name" $((SECONDS - began)) "$log" pytest "$xml" "$log" "$rc" \
                "$record_file" "$GPUS" "$limit"
            ;;
        bench)
            world=$((GPUS < 2 ? 2 : (GPUS > 8 ? 8 : GPUS)))
            timeout -k 5 "$limit" "$PY" "$LOGS/gpu_check_run.py" "$world" bench collectives \
                --sizes 1MB,16MB --world-sizes "$world" --reps 3 --warmup 1 </dev/null >"$log" 2>&1
            rc=$?
            summarise "$name" $((SECONDS - began)) "$log" run "$log" "$rc" "$GPUS" "$limit"
            ;;
        demo)
            timeout -k 5 "$limit" "$PY" "$LOGS/gpu_check_run.py" 4,2 demo \
                --out "$LOGS/demo.png" </dev/null >"$log" 2>&1
            rc=$?
            summarise "$name" $((SECONDS - began)) "$log" run "$log" "$rc" "$GPUS" "$limit"
            ;;
        nccl-log | streams)
            timeout -k 5 "$limit" "$PY" scripts/gpu_nccl.py "$name" "$LOGS" </dev/null >"$log" 2>&1
            rc=$?
            summarise "$name" $((SECONDS - began)) "$log" run "$log" "$rc" "$GPUS" "$limit"
            ;;
        nsys)
            if ! command -v nsys >/dev/null 2>&1; then
                record SKIP "$name" "Nsight Systems (nsys) is not installed here" - 0 "" ""
                continue
            fi
            timeout -k 5 "$limit" nsys profile -t cuda,nvtx,osrt --force-overwrite true \
                -o "$LOGS/overlap" "$PY" scripts/gpu_nccl.py overlap "$LOGS" </dev/null >"$log" 2>&1
            rc=$?
            summarise "$name" $((SECONDS - began)) "$log" run "$log" "$rc" "$GPUS" "$limit"
            ;;
        notebook:*)
            if [[ "$MISSING" == *" nbval "* ]] || [[ "$MISSING" == *" pytest "* ]]; then
                record SKIP "$name" "nbval (or pytest) is not installed for $PY" - 0 "" ""
                continue
            fi
            GPU_CHECK_RECORD=$record_file GPU_CHECK_TEST=$name IPYTHONDIR=$LOGS/ipython \
                timeout -k 5 "$limit" "$PY" -m pytest -v -p no:cacheprovider --nbval \
                --nbval-current-env --nbval-cell-timeout="$limit" --junitxml="$xml" \
                "solutions/${name#notebook:}.ipynb" </dev/null >"$log" 2>&1
            rc=$?
            summarise "$name" $((SECONDS - began)) "$log" pytest "$xml" "$log" "$rc" \
                "$record_file" "$GPUS" "$limit" "$name"
            ;;
    esac
done
DONE=1
write_report

failed=0
for v in ${R_VERDICT[@]+"${R_VERDICT[@]}"}; do
    if [ "$v" = FAIL ]; then failed=1; fi
done
echo
grep '^summary:' "$REPORT"
echo "report: $REPORT"
exit "$failed"
