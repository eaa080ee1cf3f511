"""Rule for torch's plain batch norm classes and bnsurgeon's SyncBatchNorm."""

from __future__ import annotations

from bnsurgeon.rules.base import Rule
from bnsurgeon.rules.builders import regroup_or_keep, to_frozen, to_fused, to_plain, to_sync


def rules() -> list[Rule]:
    from torch import nn

    from bnsurgeon.runtime import SyncBatchNorm

    return [
        Rule(
            name="torch-batchnorm",
            classes=(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm),
            targets={"sync": to_sync, "plain": to_plain, "frozen": to_frozen, "fused": to_fused},
            description="torch BatchNorm1d/2d/3d and torch.nn.SyncBatchNorm",
        ),
        Rule(
            name="bnsurgeon-sync",
            classes=(SyncBatchNorm,),
            targets={"sync": regroup_or_keep(to_sync), "plain": to_plain, "frozen": to_frozen, "fused": to_fused},
            description="bnsurgeon SyncBatchNorm (restores its recorded original class)",
        ),
    ]
