#!/usr/bin/env bash
# The GPU checks in ONE call of at most 8 minutes on one GPU (the device machines have torch + timm;
# nothing is installed here). Every figure lands as JSON under OUTDIR, so one short loan brings all of
# them back:
#   layers.json      module against module: bnsurgeon's SyncBatchNorm vs torch's nn.SyncBatchNorm vs
#                    plain BN, sync paths forced in a world of one, 7 shape/layout cases x 3 precisions,
#                    with the profiler's kernels and collective records per forward + backward
#   graph_step.json  a resnet50 training step captured in a CUDA graph, sync against plain (fp32 and
#                    bf16 autocast), replay checked against eager (loss, gradients, parameters, stats)
#   tests.xml/.json  every CUDA-marked test, run once
#   compiled.json    the sync model under torch.compile (inductor), its collectives counted
#   summary.json     ratios against the goals, every step's exit status and time (steps.jsonl)
#   verify_*.json    torchrun verify on the GPU (float64, float32, bf16-autocast) and -w 2, same model, timed
# A step that fails or passes its time limit is recorded and the next one still runs; the exit
# status is non-zero if anything failed. The speed goals are reported, not enforced.
#
#   PYTHON=python3 scripts/gpu_checks.sh OUTDIR              (a GPU machine: ~5 min, step limits 460 s)
#   scripts/gpu_checks.sh --dry-run OUTDIR                   (CPU, stand-in kernels, tiny sizes: seconds)
#
# The dry run runs the same Python code on CPU (scripts/bench_cuda.py --dry-run) and the test step on
# one file whose CUDA test skips there, so the script cannot rot between GPU loans
# (tests/test_gpu_checks.py runs it).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
DRY=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY=1
  shift
fi
if [ $# -ne 1 ]; then
  echo "usage: scripts/gpu_checks.sh [--dry-run] OUTDIR" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
DEST="$(cd "$1" && pwd)"
: >"$DEST/steps.jsonl"
exec > >(tee "$DEST/log.txt") 2>&1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
status=0
began=$SECONDS

# step NAME LIMIT_S COMMAND...: run it under a time limit (SIGINT first, so pytest and the benchmark
# still write what they have; SIGKILL 15 s later), record its exit status and time in steps.jsonl
step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s, $((SECONDS - began)) s so far): $*"
  local start=$SECONDS rc
  timeout -s INT -k 15 "$limit" "$@"
  rc=$?
  printf '{"step": "%s", "rc": %d, "seconds": %d, "limit_s": %d}\n' "$name" "$rc" $((SECONDS - start)) "$limit" \
    >>"$DEST/steps.jsonl"
  if [ $rc -eq 124 ] || [ $rc -eq 130 ] || [ $rc -eq 137 ]; then
    echo "== $name: STOPPED at its ${limit} s limit"
  fi
  if [ $rc -ne 0 ]; then
    status=1
    echo "== FAILED: $name (exit $rc)"
  fi
}

BENCH=("$PY" scripts/bench_cuda.py --out "$DEST")
# pytest with Ctrl-C restored (a shell started in the background ignores SIGINT, and so would pytest):
# interrupted at its limit, it still writes the junit XML of the tests that ran
PYTEST_CUDA=("$PY" -c 'import signal, sys, pytest
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(pytest.main(sys.argv[1:]))' -q -p no:cacheprovider -m cuda -rs --continue-on-collection-errors
  --junitxml "$DEST/tests.xml" -o junit_family=xunit1)
# the files that hold CUDA-marked tests: collecting only them is faster, and a file that needs a package
# the GPU machine lacks cannot stop them (the CUDA tests need torch, timm and pytest-timeout only)
mapfile -t CUDA_FILES < <(grep -l 'mark\.cuda' tests/test_*.py)

if [ $DRY -eq 1 ]; then
  # one process for the three sections (each is a separate process on a GPU, so that a hang costs
  # only its own limit); the test step on one file: every CUDA test skips on a CPU anyway
  step bench 120 "${BENCH[@]}" --dry-run
  step tests 60 "${PYTEST_CUDA[@]}" tests/test_sync_equivalence.py
else
  step env 20 "$PY" -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__, \
torch.cuda.get_device_name(0), 'GPUs:', torch.cuda.device_count())"
  command -v nvidia-smi >/dev/null && nvidia-smi >"$DEST/nvidia-smi.txt" 2>&1
  step layers 60 "${BENCH[@]}" --sections layers     # ~30 s: 21 cases x 3 layers x 210 calls, 63 profiles
  step graph 80 "${BENCH[@]}" --sections graph       # ~50 s: 12 resnet50 builds, 4 captures, ~200 steps
  # three workers: the two compiling tests (2 ranks each) run side by side; nothing in them is timed
  step tests 170 "${PYTEST_CUDA[@]}" -n 3 --dist load "${CUDA_FILES[@]}" # ~60-120 s
  step verify 150 env PYTHON="$PY" bash scripts/gpu_verify.sh "$DEST" # ~60 s: torchrun verify on the GPU vs -w 2
  step compiled 120 "${BENCH[@]}" --sections compiled # ~60-100 s: resnet50 fwd + bwd through inductor
fi
step summary 10 "$PY" scripts/bench_cuda.py --summarize "$DEST"
echo "== gpu_checks: $((SECONDS - began)) s in all, exit $status; JSON in $DEST"
exit $status
