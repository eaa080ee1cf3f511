#!/usr/bin/env bash
# The whole test suite (CPU only; multi-process tests use gloo on 127.0.0.1).
source "$(dirname "$0")/venv.sh"
cd "$ROOT"
exec python -m pytest "$@"
