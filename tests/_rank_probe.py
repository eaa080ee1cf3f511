"""Functions run inside ranks by test_multiproc (importable by name; importing this module imports no torch)."""

from __future__ import annotations

import os
import sys


def environment_and_modules(rank: int, world_size: int, name: str) -> tuple[str | None, bool, int]:
    """What a rank sees: the variable ``name``, whether timm was already imported when the task began
    (the fork server's preload), and the process id."""
    return os.environ.get(name), "timm" in sys.modules, os.getpid()


def sleeping(rank: int, world_size: int, seconds: float, marker: str) -> int:
    """Say that the task began (rank 0 touches ``marker``), then sleep: a rank busy when Ctrl-C comes."""
    import time
    from pathlib import Path

    if rank == 0:
        Path(marker).touch()
    time.sleep(seconds)
    return rank
