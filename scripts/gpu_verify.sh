#!/usr/bin/env bash
# verify under torchrun on this machine's GPU against verify -w 2 (bnsurgeon's own CPU ranks), same models, same
# run: one JSON document per form under OUTDIR, and each form's wall time in verify_times.jsonl.
#   PYTHON=python3 scripts/gpu_verify.sh OUTDIR [MODEL]        (MODEL: a timm name, default resnet18)
# Two ranks share the GPU over gloo where there is one (NCCL refuses two ranks on one GPU); with a GPU per rank
# torchrun's ranks take NCCL (--device auto).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
mkdir -p "$1" && DEST="$(cd "$1" && pwd)" || exit 2
MODEL="${2:-resnet18}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$WORK" || exit 2
: >"$DEST/verify_times.jsonl"
status=0
timed() { # NAME COMMAND...: run it, its stdout to DEST/verify_NAME.json, its time and exit status to the jsonl
  local name=$1 start rc
  shift
  start=$EPOCHREALTIME
  "$@" >"$DEST/verify_$name.json"
  rc=$?
  printf '{"form": "%s", "rc": %d, "seconds": %.2f}\n' "$name" "$rc" "$("$PY" -c "import sys; print(float(sys.argv[1]) - float(sys.argv[2]))" "$EPOCHREALTIME" "$start")" \
    | tee -a "$DEST/verify_times.jsonl"
  [ $rc -eq 0 ] || status=1
}
"$PY" -m bnsurgeon convert "$MODEL" -o converted.safetensors -q || exit 1
timed w2 "$PY" -m bnsurgeon verify "$MODEL" converted.safetensors -w 2 --json
DEVICE=auto
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' && DEVICE=cuda
for precision in float64 float32 bf16-autocast; do
  timed "torchrun_$precision" "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m bnsurgeon verify \
    "$MODEL" converted.safetensors --json --device "$DEVICE" --precision "$precision"
done
"$PY" - "$DEST" <<'PYEOF'
import json, pathlib, sys
dest = pathlib.Path(sys.argv[1])
for path in sorted(dest.glob("verify_*.json")):
    try:
        document = json.loads(path.read_text())
    except ValueError:
        print(f"{path.name}: no JSON document")
        continue
    for check in document.get("checks", []):
        if "ranks" in check["name"]:
            print(f"{path.stem:28} {check['name']:22} {check['passed']!s:5} {check['max_abs_diff']:.3g} "
                  f"{check['seconds']:.2f}s  {check['detail'][:150]}")
PYEOF
exit $status
