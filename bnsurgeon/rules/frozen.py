"""Rule for frozen batch norm: torchvision/timm FrozenBatchNorm2d, timm FrozenBatchNormAct2d,
and bnsurgeon's own frozen classes."""

from __future__ import annotations

from .base import Rule
from .builders import keep_if, thaw_or_keep, to_plain, to_plain_act, to_sync, to_sync_act


def rules() -> list[Rule]:
    from ..runtime import FrozenBatchNorm, FrozenBatchNormAct

    result = [
        Rule(
            name="bnsurgeon-frozen",
            classes=(FrozenBatchNorm,),
            targets={"sync": thaw_or_keep(to_sync), "plain": thaw_or_keep(to_plain), "frozen": keep_if("frozen")},
            description="bnsurgeon FrozenBatchNorm",
        ),
        Rule(
            name="bnsurgeon-frozen-act",
            classes=(FrozenBatchNormAct,),
            targets={"sync": thaw_or_keep(to_sync_act), "plain": thaw_or_keep(to_plain_act), "frozen": keep_if("frozen")},
            description="bnsurgeon FrozenBatchNormAct",
        ),
    ]
    try:
        from torchvision.ops.misc import FrozenBatchNorm2d
    except ImportError:
        FrozenBatchNorm2d = None
    if FrozenBatchNorm2d is not None:
        result.append(
            Rule(
                name="torchvision-frozen",
                classes=(FrozenBatchNorm2d,),
                targets={"sync": thaw_or_keep(to_sync), "plain": thaw_or_keep(to_plain), "frozen": keep_if("frozen")},
                description="torchvision/timm FrozenBatchNorm2d (x*scale+shift arithmetic)",
                exact=False,
            )
        )
    try:
        from timm.layers import FrozenBatchNormAct2d
    except ImportError:
        return result
    result.append(
        Rule(
            name="timm-frozen-act",
            classes=(FrozenBatchNormAct2d,),
            targets={"sync": thaw_or_keep(to_sync_act), "plain": thaw_or_keep(to_plain_act), "frozen": keep_if("frozen")},
            description="timm FrozenBatchNormAct2d (x*scale+shift arithmetic)",
            exact=False,
        )
    )
    return result
