# Sourced by demo.sh and test.sh: create or reuse a local virtual environment and install the project's
# own dependency list (pyproject.toml, with the test extra) at the versions of a lock (regenerate with
# ./scripts/lock.sh). Reinstalls only when pyproject.toml or the lock changes. torch and torchvision are
# resolved together by pip.
#   BNSURGEON_ENV=latest (default)  ./.venv        from constraints.txt (the newest releases, as locked)
#   BNSURGEON_ENV=floor             ./.venv-floor  from constraints-floor.txt (the oldest releases supported)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${BNSURGEON_ENV:-latest}" in
  latest) VENV="$ROOT/.venv"; LOCK_FILE="$ROOT/constraints.txt" ;;
  floor) VENV="$ROOT/.venv-floor"; LOCK_FILE="$ROOT/constraints-floor.txt" ;;
  *) echo "BNSURGEON_ENV=${BNSURGEON_ENV} is not an environment: use latest or floor" >&2; exit 2 ;;
esac
PYTHON_BIN="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV" >&2
  "$PYTHON_BIN" -m venv "$VENV"
fi
STAMP="$VENV/.bnsurgeon-installed"
WANT="$( { cat "$ROOT/pyproject.toml"; cat "$LOCK_FILE" 2>/dev/null || true; } | sha256sum | cut -d' ' -f1)"
LOCK=()
if [ -f "$LOCK_FILE" ]; then LOCK=(-c "$LOCK_FILE"); fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "installing bnsurgeon and its dependencies into $VENV (first run downloads torch)" >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${LOCK[@]}" -e "$ROOT[test]"
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
