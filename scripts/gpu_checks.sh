#!/usr/bin/env bash
# The GPU checks in one run, for a machine with an NVIDIA GPU and torch + timm installed (the device
# machines have them; nothing is installed here): every CUDA-marked test, the device-path and DataParallel
# files whole, then the GPU benchmark. Prints a summary line per step; exits non-zero if a step failed.
#   PYTHON=python3 scripts/gpu_checks.sh [--quick]      (--quick: skip the model-level benchmark)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__, torch.cuda.get_device_name(0))"
status=0
step() { echo "== $*"; "$@" || { status=1; echo "== FAILED: $*"; }; }
step "$PY" -m pytest -q -p no:cacheprovider -m cuda tests
step "$PY" -m pytest -q -p no:cacheprovider tests/test_device_path.py tests/test_data_parallel.py tests/test_sync_equivalence.py
if [ "${1:-}" = "--quick" ]; then
  step "$PY" scripts/bench_cuda.py --iters 50 --skip-models
else
  step "$PY" scripts/bench_cuda.py --iters 100 --model-iters 20
fi
exit $status
