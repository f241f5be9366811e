#!/usr/bin/env bash
# Every GPU check in one run, one summary line per check (PASS / FAIL / SKIP and why):
#   1. each test marked `gpu` (NCCL ranks, CUDA timelines and streams, the pipeline on two GPUs or
#      on two streams of one GPU, ...), which the CPU run skips;
#   2. each solution notebook under nbval, where ok.launch picks NCCL when every rank can have a GPU
#      of its own (with one GPU, ranks share it over gloo and the CUDA parts still run);
#   3. the demo, and a short `bench collectives`, on the GPUs.
# On a machine without CUDA it says what it would run, reports the GPU checks as skipped and exits 0.
# Usage: make gpu-check   (or: PYTHON=.venv/bin/python bash scripts/gpu_check.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/overlapkit-gpu-check.XXXXXX")
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
"$PY" - <<'PYEOF'
import torch
if torch.cuda.is_available():
    names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
    print(f"{torch.cuda.device_count()} GPU(s): {', '.join(names)}; torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
else:
    print(f"no CUDA device (torch {torch.__version__}): the GPU checks below are skipped")
PYEOF
echo "logs: $LOGS"
SUMMARY=()
FAILED=0

check() {  # check NAME COMMAND...: run it, one line in the summary
    local name=$1 log="$LOGS/$(echo "$1" | tr -c 'A-Za-z0-9._-' '_').log"
    shift
    if "$@" >"$log" 2>&1; then
        SUMMARY+=("PASS  $name")
    else
        SUMMARY+=("FAIL  $name  (log: $log)")
        FAILED=1
    fi
}

# 1. the gpu-marked tests, one line each (pytest's own verdicts, skip reasons included)
# (only the files that hold one: collecting the whole suite costs ~20 s of a core for nothing)
GPU_FILES=$(grep -l "pytest.mark.gpu" tests/test_*.py)
# shellcheck disable=SC2086  # one word per file
"$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$LOGS/gpu-tests.xml" $GPU_FILES \
    >"$LOGS/gpu-tests.log" 2>&1
status=$?
if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then FAILED=1; fi
while IFS= read -r line; do
    SUMMARY+=("$line")
done < <("$PY" - "$LOGS/gpu-tests.xml" "$LOGS/gpu-tests.log" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

xml, log = sys.argv[1:]
try:
    cases = ET.parse(xml).getroot().iter("testcase")
except (OSError, ET.ParseError):
    print(f"FAIL  the gpu tests did not run  (log: {log})")
    cases = []
for case in cases:
    name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
    skipped = case.find("skipped")
    failed = case.find("failure") if case.find("failure") is not None else case.find("error")
    if skipped is not None:
        print(f"SKIP  {name}: {skipped.get('message', '').removeprefix('Skipped: ')}")
    elif failed is not None:
        print(f"FAIL  {name}  (log: {log})")
    else:
        print(f"PASS  {name}")
PYEOF
)

# 2.–3. notebooks, demo and a bench: only where there is a GPU
for nb in solutions/*.ipynb; do
    if [ "$GPUS" -gt 0 ]; then
        check "$nb on CUDA (nbval)" "$PY" -m pytest -q -p no:cacheprovider --nbval \
            --nbval-current-env --nbval-cell-timeout=300 "$nb"
    else
        SUMMARY+=("SKIP  $nb on CUDA: no GPU here (make test runs it on the CPU)")
    fi
done
if [ "$GPUS" -gt 0 ]; then
    check "demo on the GPUs" "$PY" -m overlapkit demo --out "$LOGS/gpu-demo.png"
    check "bench collectives on the GPUs" "$PY" -m overlapkit bench collectives \
        --sizes 1MB,16MB --world-sizes "$(( GPUS < 2 ? 2 : GPUS ))" --reps 3
else
    SUMMARY+=("SKIP  demo on the GPUs: no GPU here")
    SUMMARY+=("SKIP  bench collectives on the GPUs: no GPU here")
fi

echo
echo "summary ($GPUS GPU(s)):"
printf '  %s\n' "${SUMMARY[@]}"
exit "$FAILED"
