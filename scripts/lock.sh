#!/usr/bin/env bash
# Re-resolve the project's dependencies and write the versions into constraints.txt, the lock that
# ./scripts/demo.sh and ./scripts/test.sh install from (scripts/venv.sh). Run it after changing the
# dependency lists in pyproject.toml, or to move to newer releases; then run ./scripts/test.sh and
# commit constraints.txt with the change.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FRESH="$(mktemp -d)"
trap 'rm -rf "$FRESH"' EXIT
"${PYTHON:-python3}" -m venv "$FRESH/venv"
"$FRESH/venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[test]"
{
  echo "# The versions ./scripts/test.sh was last run green with (python $("$FRESH/venv/bin/python" -c 'import sys; print(".".join(map(str, sys.version_info[:3])))')); regenerate with ./scripts/lock.sh"
  "$FRESH/venv/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check | LC_ALL=C sort
} > "$ROOT/constraints.txt"
echo "wrote $ROOT/constraints.txt ($(grep -vc '^#' "$ROOT/constraints.txt") pinned packages)"
