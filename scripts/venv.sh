# Sourced by demo.sh and test.sh: create or reuse ./.venv and install the project's
# own dependency list (pyproject.toml, with the test extra). Reinstalls only when
# pyproject.toml changes. torch and torchvision are resolved together by pip.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON_BIN="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV" >&2
  "$PYTHON_BIN" -m venv "$VENV"
fi
STAMP="$VENV/.bnsurgeon-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "installing bnsurgeon and its dependencies into $VENV (first run downloads torch)" >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[test]"
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
