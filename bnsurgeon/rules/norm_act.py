"""Rule for batch norm fused with drop + activation: timm's BatchNormAct2d family."""

from __future__ import annotations

from bnsurgeon.rules.base import Rule
from bnsurgeon.rules.builders import regroup_or_keep, to_frozen_act, to_fused_act, to_plain_act, to_sync_act


def rules() -> list[Rule]:
    from bnsurgeon.runtime import SyncBatchNormAct

    return [
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


#: the module that defines timm's classes: their rule joins the default registry once it is imported
TIMM_MODULE = "timm.layers.norm_act"


def timm_rules() -> list[Rule]:
    """timm's act classes (imports timm; none when timm cannot be imported)."""
    try:
        from timm.layers import BatchNormAct2d
        from timm.layers import SyncBatchNormAct as TimmSyncBatchNormAct
    except ImportError:  # timm is a dependency, but rules must not make it a hard import
        return []
    return [
        Rule(
            name="timm-batchnorm-act",
            classes=(BatchNormAct2d, TimmSyncBatchNormAct),
            targets={"sync": to_sync_act, "plain": to_plain_act, "frozen": to_frozen_act, "fused": to_fused_act},
            description="timm BatchNormAct2d and SyncBatchNormAct (act and drop kept)",
        )
    ]
