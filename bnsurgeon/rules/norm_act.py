"""Rule for batch norm fused with drop + activation: timm's BatchNormAct2d family."""

from __future__ import annotations

from bnsurgeon.rules.base import Rule
from bnsurgeon.rules.builders import regroup_or_keep, to_frozen_act, to_fused_act, to_plain_act, to_sync_act


def rules() -> list[Rule]:
    from bnsurgeon.runtime import SyncBatchNormAct

    result = [
        Rule(
            name="bnsurgeon-sync-act",
            classes=(SyncBatchNormAct,),
            targets={
                "sync": regroup_or_keep(to_sync_act),
                "plain": to_plain_act,
                "frozen": to_frozen_act,
                "fused": to_fused_act,
            },
            description="bnsurgeon SyncBatchNormAct (act and drop kept)",
        )
    ]
    try:
        from timm.layers import BatchNormAct2d
        from timm.layers import SyncBatchNormAct as TimmSyncBatchNormAct
    except ImportError:  # timm is a dependency, but rules must not make it a hard import
        return result
    result.insert(
        0,
        Rule(
            name="timm-batchnorm-act",
            classes=(BatchNormAct2d, TimmSyncBatchNormAct),
            targets={"sync": to_sync_act, "plain": to_plain_act, "frozen": to_frozen_act, "fused": to_fused_act},
            description="timm BatchNormAct2d and SyncBatchNormAct (act and drop kept)",
        ),
    )
    return result
