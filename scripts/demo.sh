#!/usr/bin/env bash
# The main job, end to end: inspect a timm model, convert it to synchronized BN,
# print the diff report, and load the result back as a training script would.
source "$(dirname "$0")/venv.sh"
cd "$ROOT"
MODEL="${1:-efficientnet_b0}"
mkdir -p out
bnsurgeon inspect "$MODEL"
bnsurgeon convert "$MODEL" -o "out/$MODEL.sync.safetensors" --force
cat "out/$MODEL.sync.safetensors.report.md"
python - "out/$MODEL.sync.safetensors" <<'PY'
import sys, torch, bnsurgeon
model = bnsurgeon.load(sys.argv[1]).eval()
kinds = sorted({type(m).__name__ for m in model.modules() if "BatchNorm" in type(m).__name__})
acts = sorted({type(m.act).__name__ for m in model.modules() if hasattr(m, "act") and "Sync" in type(m).__name__})
print(f"bnsurgeon.load -> BN classes {kinds}, their activations {acts}")
PY
