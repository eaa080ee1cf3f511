#!/usr/bin/env bash
# The whole test suite (CPU only; multi-process tests use gloo on 127.0.0.1).
source "$(dirname "$0")/venv.sh"
cd "$ROOT"
# the package's layering (stages import downward only; contracts in .importlinter)
lint-imports --config "$ROOT/.importlinter" --no-cache
exec python -m pytest "$@"
