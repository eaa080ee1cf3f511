"""Rule for frozen batch norm: torchvision/timm FrozenBatchNorm2d, timm FrozenBatchNormAct2d,
and bnsurgeon's own frozen classes."""

from __future__ import annotations

from bnsurgeon.rules.base import Rule
from bnsurgeon.rules.builders import (
    keep_if,
    thaw_or_keep,
    to_fused,
    to_fused_act,
    to_plain,
    to_plain_act,
    to_sync,
    to_sync_act,
)


def _frozen_rule(name: str, cls: type, description: str, *, act: bool, exact: bool = True) -> Rule:
    """Frozen stays frozen under --to frozen; --to sync/plain thaw per the frozen policy."""
    sync, plain, fused = (to_sync_act, to_plain_act, to_fused_act) if act else (to_sync, to_plain, to_fused)
    return Rule(
        name=name,
        classes=(cls,),
        targets={"sync": thaw_or_keep(sync), "plain": thaw_or_keep(plain), "frozen": keep_if("frozen"), "fused": fused},
        description=description,
        exact=exact,
    )


def rules() -> list[Rule]:
    from bnsurgeon.runtime import FrozenBatchNorm, FrozenBatchNormAct

    result = [
        _frozen_rule("bnsurgeon-frozen", FrozenBatchNorm, "bnsurgeon FrozenBatchNorm", act=False),
        _frozen_rule("bnsurgeon-frozen-act", FrozenBatchNormAct, "bnsurgeon FrozenBatchNormAct", act=True),
    ]
    return result


#: the modules that define torchvision's and timm's frozen classes: their rules join the default registry once
#: each is imported
TORCHVISION_MODULE = "torchvision.ops.misc"
TIMM_MODULE = "timm.layers.norm_act"
#: detectron2's own FrozenBatchNorm2d (its backbones' frozen stages, FREEZE_AT): never imported by bnsurgeon
DETECTRON2_MODULE = "detectron2.layers.batch_norm"


def _inexact_frozen(name: str, cls: "type | None", description: str, *, act: bool) -> list[Rule]:
    """torchvision's, timm's and detectron2's frozen classes compute x*scale+shift: eval is close, not bitwise."""
    return [] if cls is None else [_frozen_rule(name, cls, description, act=act, exact=False)]


def torchvision_rules() -> list[Rule]:
    try:
        from torchvision.ops.misc import FrozenBatchNorm2d
    except ImportError:
        return []
    return _inexact_frozen(
        "torchvision-frozen",
        FrozenBatchNorm2d,
        "torchvision/timm FrozenBatchNorm2d (x*scale+shift arithmetic)",
        act=False,
    )


def timm_rules() -> list[Rule]:
    try:
        from timm.layers import FrozenBatchNormAct2d
    except ImportError:
        return []
    return _inexact_frozen(
        "timm-frozen-act", FrozenBatchNormAct2d, "timm FrozenBatchNormAct2d (x*scale+shift arithmetic)", act=True
    )


def detectron2_rules() -> list[Rule]:
    """detectron2's FrozenBatchNorm2d (weight, bias and running statistics as buffers, x*scale+shift), once
    detectron2 has imported it: its detection models freeze their first stages with it, beside SyncBN."""
    import sys

    module = sys.modules.get(DETECTRON2_MODULE)
    cls = getattr(module, "FrozenBatchNorm2d", None) if module is not None else None
    return _inexact_frozen(
        "detectron2-frozen",
        cls if isinstance(cls, type) else None,
        "detectron2 FrozenBatchNorm2d (x*scale+shift arithmetic)",
        act=False,
    )
