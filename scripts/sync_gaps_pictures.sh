#!/usr/bin/env bash
# The "Do I need sync BN?" pictures of the README and docs/training-scripts.md: scripts/sync_gaps_demo.py (resnet18,
# synthetic images, 2 CPU gloo ranks) at 2, 8 and 32 images per rank under `bnsurgeon run --stats`, each run's
# mean-gap chart cut out of its HTML page into docs/images/sync-gaps-b{2,8,32}.svg, and its verdict printed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
source scripts/venv.sh
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p docs/images
for per_rank in 2 8 32; do
  port="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$port" \
    -m bnsurgeon run -q --stats "$work/gaps-b$per_rank.json" --stats-steps 4 scripts/sync_gaps_demo.py "$per_rank"
  python - "$work/gaps-b$per_rank" "docs/images/sync-gaps-b$per_rank.svg" <<'PY'
import json, sys
page = open(sys.argv[1] + ".html", encoding="utf-8").read()
start = page.index("<svg")
open(sys.argv[2], "w", encoding="utf-8").write(page[start : page.index("</svg>", start) + len("</svg>")] + "\n")
print(json.load(open(sys.argv[1] + ".json"))["verdict"]["line"])
PY
done
