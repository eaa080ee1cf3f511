#!/usr/bin/env bash
# The whole test suite (CPU only; multi-process tests use gloo on 127.0.0.1), after the static checks, in the
# newest releases (./.venv, constraints.txt), then again in the oldest bnsurgeon supports (./.venv-floor,
# constraints-floor.txt: torch 2.4; docs/versions.md), where tests that need a newer torch skip with the reason.
# BNSURGEON_FLOOR=0 leaves the floor out (a quicker local run; CI runs both). Each environment is created or
# reused by scripts/venv.sh. Arguments go to each pytest run. Prints each part's time.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
started=$SECONDS
part() { echo "test.sh: $1 took $((SECONDS - $2)) s" >&2; }

t=$SECONDS
BNSURGEON_ENV=latest source "$ROOT/scripts/venv.sh"
part "the latest environment" "$t"
t=$SECONDS
# lint (pycodestyle, pyflakes, bugbear, isort) and format, the whole tree; rules in pyproject.toml
ruff check .
ruff format --check .
# types (mypy, configured in pyproject.toml)
mypy
# the package's layering (stages import downward only; contracts in .importlinter)
lint-imports --no-cache "$ROOT/.importlinter"
# the documentation site (docs/, mkdocs.yml): no broken link, anchor or page; offline; into the ignored site/
NO_MKDOCS_2_WARNING=1 PYTHONPATH="$ROOT" mkdocs build --strict --quiet --config-file "$ROOT/mkdocs.yml"
part "static checks" "$t"

# two workers on the 2 cores; each test file stays on one worker (module fixtures, the doc examples' shared folder)
t=$SECONDS
"$ROOT/.venv/bin/python" -m pytest -n "${BNSURGEON_TEST_WORKERS:-2}" --dist loadfile "$@"
part "the suite at the latest versions ($("$ROOT/.venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))" "$t"

if [ "${BNSURGEON_FLOOR:-1}" != "0" ]; then
  t=$SECONDS
  (BNSURGEON_ENV=floor source "$ROOT/scripts/venv.sh")
  part "the floor environment" "$t"
  t=$SECONDS
  PATH="$ROOT/.venv-floor/bin:$PATH" "$ROOT/.venv-floor/bin/python" -m pytest -n "${BNSURGEON_TEST_WORKERS:-2}" --dist loadfile "$@"
  part "the suite at the floor ($("$ROOT/.venv-floor/bin/python" -c 'import torch; print("torch", torch.__version__)'))" "$t"
fi
echo "test.sh: all parts took $((SECONDS - started)) s" >&2
