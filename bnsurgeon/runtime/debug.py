"""Debug switch that turns a rank mismatch at a sync layer into an error instead of a hang.

With ``BNSURGEON_SYNC_DEBUG=1`` (or ``set_sync_debug(True)``) every sync layer first
all-gathers (its name, its call count) and raises ``DistributedMismatchError`` naming
the layer on each rank when they differ. Off by default; when off, the cost is one
boolean test per forward.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..errors import DistributedMismatchError
from .collectives import all_gather_rows

_NAME_BYTES = 120
_enabled = os.environ.get("BNSURGEON_SYNC_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def enabled() -> bool:
    return _enabled


def set_sync_debug(flag: bool) -> None:
    """Turn the per-layer rank check on or off for this process."""
    global _enabled
    _enabled = bool(flag)


def _encode(name: str, call: int, device: torch.device) -> torch.Tensor:
    raw = name.encode("utf-8")[:_NAME_BYTES]
    row = torch.zeros(_NAME_BYTES + 2, dtype=torch.int64)
    row[0] = call
    row[1] = len(raw)
    row[2 : 2 + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
    return row.to(device)


def _decode(row: torch.Tensor) -> tuple[str, int]:
    values = row.tolist()
    length = values[1]
    return bytes(values[2 : 2 + length]).decode("utf-8", errors="replace"), values[0]


def check_same_layer(layer: tuple[str, int], world_size: int, group, device: torch.device) -> None:
    """Raise on every rank if the ranks of ``group`` are not at the same layer and call."""
    name, call = layer
    row = _encode(name, call, device)
    rows = all_gather_rows(row, world_size, group)
    if torch.equal(rows, rows[:1].expand_as(rows)):
        return
    seen = []
    for group_rank in range(world_size):
        rank = dist.get_global_rank(group, group_rank) if group is not None else group_rank
        layer_name, layer_call = _decode(rows[group_rank])
        seen.append(f"rank {rank}: '{layer_name}' (call {layer_call})")
    raise DistributedMismatchError(
        "sync batch norm ranks are at different layers: " + "; ".join(seen)
        + ". A rank skipped a layer (data-dependent control flow?); every rank must run every sync layer."
    )
