#!/usr/bin/env bash
# Every GPU check in one run, for the day a GPU machine is at hand:
#   1. the tests marked `gpu` (NCCL ranks, CUDA timelines, ...), which the CPU run skips;
#   2. every solution notebook under nbval, where ok.launch picks NCCL when each rank has a GPU;
#   3. the demo, whose ranks then run on GPUs.
# Usage: make gpu-check   (or: PYTHON=.venv/bin/python bash scripts/gpu_check.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "no CUDA device: this script is for a GPU machine"
print(f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
PYEOF
"$PY" -m pytest -m gpu -rs tests
"$PY" -m pytest --nbval --nbval-current-env --nbval-cell-timeout=300 solutions
"$PY" -m overlapkit demo --out gpu-demo.png
