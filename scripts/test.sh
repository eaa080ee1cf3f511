#!/usr/bin/env bash
# The whole test suite (CPU only; multi-process tests use gloo on 127.0.0.1), after the static checks.
source "$(dirname "$0")/venv.sh"
cd "$ROOT"
# lint (pycodestyle, pyflakes, bugbear, isort) and format, the whole tree; rules in pyproject.toml
ruff check .
ruff format --check .
# types (mypy, configured in pyproject.toml)
mypy
# the package's layering (stages import downward only; contracts in .importlinter)
lint-imports --no-cache "$ROOT/.importlinter"
# the documentation site (docs/, mkdocs.yml): no broken link, anchor or page; offline; into the ignored site/
NO_MKDOCS_2_WARNING=1 PYTHONPATH="$ROOT" mkdocs build --strict --quiet --config-file "$ROOT/mkdocs.yml"
# two workers on the 2 cores; each test file stays on one worker (module fixtures, the doc examples' shared folder)
exec python -m pytest -n "${BNSURGEON_TEST_WORKERS:-2}" --dist loadfile "$@"
