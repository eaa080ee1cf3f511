"""``BNSURGEON_SYNC_DEBUG=1``: a fixed-size layer check before every collective.

The always-on check (``identity.py``) rides in the statistics row and so can only
compare rows of the same size. With the debug switch (or ``set_sync_debug(True)``)
every collective of a sync layer, forward and backward, on every device, is preceded by
an all_gather of the layer's header alone in float64 (the same size for every layer),
compared on the host. That names what the row cannot: ranks at layers of different
widths or statistics dtypes (which gloo otherwise aborts on), and mismatches on devices
with the layer named on every rank instead of a device-side assert. It costs one extra
small collective and a host read per collective; off by default, when off the cost is
one boolean test per forward.
"""

from __future__ import annotations

import os

import torch

from bnsurgeon.runtime.collectives import all_gather_rows
from bnsurgeon.runtime.identity import check_headers

_enabled = os.environ.get("BNSURGEON_SYNC_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def enabled() -> bool:
    return _enabled


def set_sync_debug(flag: bool) -> None:
    """Turn the fixed-size pre-collective layer check on or off for this process."""
    global _enabled
    _enabled = bool(flag)


def check_same_layer(header: torch.Tensor, world_size: int, group, describe) -> None:
    """Raise on every rank if the ranks of ``group`` are not at the same layer, call and phase."""
    rows = all_gather_rows(header.to(torch.float64), world_size, group, describe)
    check_headers(rows, group, on_host=True, layer_name="")
