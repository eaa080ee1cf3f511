"""The tests use the library's own multi-rank harness."""

from bnsurgeon.checks.multiproc import free_port, run_world

__all__ = ["free_port", "run_world"]
