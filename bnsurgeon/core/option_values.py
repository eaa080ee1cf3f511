"""Option values checked as the command line reads them, before anything runs: importing nothing heavy, so the
CLI can judge them while Click parses (a pre-commit hook's probe with no SOURCE is refused for them)."""

from __future__ import annotations

import math

from bnsurgeon.core.errors import UsageError

#: verify starts one process per rank
MAX_WORLD_SIZE = 64


def check_world_sizes(world_sizes: "tuple[int, ...] | list[int]") -> None:
    """Each --world-size is 2 to MAX_WORLD_SIZE ranks (UsageError otherwise)."""
    if any(w < 2 for w in world_sizes):
        raise UsageError(f"--world-size must be at least 2 (got {min(world_sizes)})", "use 2 or 3 on a CPU machine")
    if any(w > MAX_WORLD_SIZE for w in world_sizes):  # one process each: 100000 would be a fork bomb
        raise UsageError(
            f"--world-size {max(world_sizes)} is more ranks than verify starts (at most {MAX_WORLD_SIZE}; "
            "each is a process on this machine)",
            "use 2 or 3 on a CPU machine",
        )


def check_atol(atol: float | None) -> None:
    """--atol is a finite number >= 0 (inf would pass any difference)."""
    if atol is not None and not (math.isfinite(atol) and atol >= 0):
        raise UsageError(f"--atol {atol} is not a tolerance", "pass a finite number >= 0, e.g. --atol 1e-5")
