"""Functions run inside ranks by test_multiproc (importable by name; importing this module imports no torch)."""

from __future__ import annotations

import os
import sys


def environment_and_modules(rank: int, world_size: int, name: str) -> tuple[str | None, bool, int]:
    """What a rank sees: the variable ``name``, whether timm was already imported when the task began
    (the fork server's preload), and the process id."""
    return os.environ.get(name), "timm" in sys.modules, os.getpid()
