# Sourced by demo.sh and test.sh: create or reuse ./.venv and install the project's
# own dependency list (pyproject.toml, with the test extra) at the versions locked in
# constraints.txt (regenerate it with ./scripts/lock.sh). Reinstalls only when either
# file changes. torch and torchvision are resolved together by pip.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON_BIN="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV" >&2
  "$PYTHON_BIN" -m venv "$VENV"
fi
STAMP="$VENV/.bnsurgeon-installed"
WANT="$( { cat "$ROOT/pyproject.toml"; cat "$ROOT/constraints.txt" 2>/dev/null || true; } | sha256sum | cut -d' ' -f1)"
LOCK=()
if [ -f "$ROOT/constraints.txt" ]; then LOCK=(-c "$ROOT/constraints.txt"); fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "installing bnsurgeon and its dependencies into $VENV (first run downloads torch)" >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${LOCK[@]}" -e "$ROOT[test]"
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
