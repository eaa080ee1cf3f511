"""``BNSURGEON_DIST_TIMEOUT``: the one place it is read and validated.

Used by ``init_distributed`` (the process group's timeout) and by every collective of
the sync layers (``collectives.py``). Parsed again only when the variable's text
changes, so reading it on every collective costs a dictionary lookup.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

ENV_VAR = "BNSURGEON_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
#: below a second the ranks cannot even meet (the store's connect times out at "0 ms"); above a
#: million seconds (11.6 days) the bound means nothing, and near 1e16 it overflows torch's milliseconds
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 1e6

_cached: tuple[str | None, timedelta] | None = None


def parse_timeout_s(raw: str | None) -> float:
    """Seconds from the variable's text; a clear UsageError for anything but a positive finite number."""
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT_S
    from bnsurgeon.core.errors import UsageError

    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:
        raise UsageError(
            f"{ENV_VAR}={raw[:40]!r} is not a usable timeout",
            f"set {ENV_VAR} to a positive number of seconds from {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:,.0f}, "
            "or unset it",
        )
    return seconds


def dist_timeout_s() -> float:
    """The timeout in seconds that ``BNSURGEON_DIST_TIMEOUT`` asks for (default 600)."""
    return collective_timeout().total_seconds()


def collective_timeout() -> timedelta:
    """The timeout as a timedelta, re-parsed only when the variable changes."""
    global _cached
    raw = os.environ.get(ENV_VAR)
    if _cached is None or _cached[0] != raw:
        _cached = (raw, timedelta(seconds=parse_timeout_s(raw)))
    return _cached[1]
