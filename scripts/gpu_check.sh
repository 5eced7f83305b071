#!/usr/bin/env bash
# The GPU check, one prepared script for a CUDA machine (<= 8 minutes): 2 peers of the small-gpu
# preset (~88M parameters, bf16 autocast, compiled, fused AdamW) train on loopback for DURATION
# seconds (default 150), then 2 bare torch loops run as many steps; then one peer alone for 60 s
# against one bare loop. Prints inner tokens/s per peer, each peer's wall-time split (inner steps,
# data, round boundaries), MFU and the overhead of `p2pdiloco join` over the bare loop; writes
# results.json/.md into OUT, and every peer's metrics.jsonl under OUT/runs/ (the `boundary` records:
# the training thread's time at each round boundary).
#
#   bash scripts/gpu_check.sh                      # OUT=runs/gpu-check DURATION=150
#   PYTHON=python3 DURATION=120 bash scripts/gpu_check.sh
#
# PYTHON must have a CUDA torch and hivemind==1.1.12 (carry its wheel to an offline machine).
# The data: the preset's built-in Shakespeare BPE, prepared from ~/.cache/p2pdiloco/shakespeare.txt
# (carry it: no download on a GPU box), or DATA=DIR (a prepared directory) or DATA=file.txt (bytes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    PY=.venv/bin/python
  else
    PY=python3
  fi
fi
"$PY" - <<'PYCHECK'
import sys
try:
    import torch
    import hivemind  # noqa: F401
except ImportError as e:
    sys.exit(f"gpu_check: {e}: install torch (CUDA) and hivemind==1.1.12 for this python")
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device here")
print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, hivemind {hivemind.__version__}")
PYCHECK
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" scripts/bench.py gpu --out "${OUT:-runs/gpu-check}" --duration "${DURATION:-150}" --data "${DATA:-}"
