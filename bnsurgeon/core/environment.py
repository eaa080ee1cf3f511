"""Environment variables bnsurgeon reads: each validated where it is read, a bad value one clear UsageError
(exit 2) naming the variable and what it takes, as ``BNSURGEON_DIST_TIMEOUT`` is (``runtime.timeout``)."""

from __future__ import annotations

import os

from bnsurgeon.core.errors import UsageError


def whole_number(name: str, default: int, *, low: int, high: int, unit: str = "") -> int:
    """``name`` as a whole number from ``low`` to ``high`` (``default`` when unset or blank)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    text = raw.strip()
    # digits only, as the hint says: Python's int() would also take 1_000, +5 and other digits than 0-9
    value = int(text) if text.isascii() and text.isdigit() else None
    if value is None or not low <= value <= high:
        what = f"a whole number{f' of {unit}' if unit else ''} from {low:,} to {high:,}"
        raise UsageError(
            f"{name}={raw[:40]!r} is not usable: it takes {what}",
            f"set {name} to {what} (without separators), or unset it",
        )
    return value
