#!/usr/bin/env bash
# Re-resolve the project's dependencies and write the versions into a lock that ./scripts/demo.sh and
# ./scripts/test.sh install from (scripts/venv.sh):
#   ./scripts/lock.sh          constraints.txt: the newest releases pip finds (the "latest" environment)
#   ./scripts/lock.sh floor    constraints-floor.txt: the oldest releases bnsurgeon supports (FLOOR_PINS below,
#                              the floors pyproject.toml declares), everything else resolved against them
# Run it after changing the dependency lists in pyproject.toml, or to move to newer releases; then run
# ./scripts/test.sh and commit the lock with the change.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHICH="${1:-latest}"
#: the floor: torch 2.4 (OpenMMLab's newest prebuilt mmcv stops there; docs/versions.md says why), with the
#: torchvision of the same release and the oldest timm, safetensors, typer and rich that work with them
FLOOR_PINS=(torch==2.4.1 torchvision==0.19.1 timm==1.0.10 safetensors==0.4.3 typer==0.19.2 rich==13.0.0)
case "$WHICH" in
  latest) OUT="$ROOT/constraints.txt"; PINS=() ;;
  floor) OUT="$ROOT/constraints-floor.txt"; PINS=("${FLOOR_PINS[@]}") ;;
  *) echo "usage: $0 [latest|floor]" >&2; exit 2 ;;
esac
FRESH="$(mktemp -d)"
trap 'rm -rf "$FRESH"' EXIT
"${PYTHON:-python3}" -m venv "$FRESH/venv"
"$FRESH/venv/bin/python" -m pip install --quiet --disable-pip-version-check "${PINS[@]}" -e "$ROOT[test]"
{
  echo "# The versions ./scripts/test.sh was last run green with ($WHICH; python $("$FRESH/venv/bin/python" -c 'import sys; print(".".join(map(str, sys.version_info[:3])))')); regenerate with ./scripts/lock.sh $WHICH"
  "$FRESH/venv/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check | LC_ALL=C sort
} > "$OUT"
echo "wrote $OUT ($(grep -vc '^#' "$OUT") pinned packages)"
