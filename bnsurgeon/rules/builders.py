"""Builders shared by the rule families: each returns a complete module that holds the
source's own tensors. The plain builders restore the exact class recorded at sync/frozen
time (``bnsurgeon_origin``), looked up in a fixed allow-list, never imported by name."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from bnsurgeon.core.anatomy import BNFields, attach_affine, attach_children, attach_stats, qualname, read_fields
from bnsurgeon.rules.base import BuildContext

PLAIN_BN: "dict[str, type[nn.modules.batchnorm._BatchNorm]]" = {
    qualname(c): c for c in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
}
#: input rank seen at a module -> the plain class that accepts it
_BN_FOR_DIMS: "dict[int, type[nn.modules.batchnorm._BatchNorm]]" = {
    2: nn.BatchNorm1d,
    3: nn.BatchNorm1d,
    4: nn.BatchNorm2d,
    5: nn.BatchNorm3d,
}
DIMS_OF_PLAIN = {qualname(nn.BatchNorm1d): 3, qualname(nn.BatchNorm2d): 4, qualname(nn.BatchNorm3d): 5}


def short_name(origin: str) -> str:
    return origin.rsplit(".", 1)[-1]


def is_frozen_origin(origin: str) -> bool:
    return "Frozen" in origin.rsplit(".", 1)[-1]


def to_sync(module: nn.Module, context: BuildContext) -> nn.Module:
    from bnsurgeon.runtime import SyncBatchNorm

    return SyncBatchNorm.from_module(module, process_group=context.process_group)


def to_sync_act(module: nn.Module, context: BuildContext) -> nn.Module:
    from bnsurgeon.runtime import SyncBatchNormAct

    return SyncBatchNormAct.from_module(module, process_group=context.process_group)


def to_frozen(module: nn.Module, context: BuildContext) -> nn.Module:
    """bnsurgeon's FrozenBatchNorm; a layer thawed from a frozen class goes back to that class."""
    from bnsurgeon.runtime import FrozenBatchNorm

    return _refrozen(module, context) or FrozenBatchNorm.from_module(module)


def to_frozen_act(module: nn.Module, context: BuildContext) -> nn.Module:
    from bnsurgeon.runtime import FrozenBatchNormAct

    return _refrozen(module, context) or FrozenBatchNormAct.from_module(module)


def _refrozen(module: nn.Module, context: BuildContext) -> nn.Module | None:
    """A layer that ``--frozen unfreeze`` thawed from torchvision/timm FrozenBatchNorm2d (its
    recorded origin) becomes that class again, holding what it learned while thawed."""
    origin = getattr(module, "bnsurgeon_origin", None)
    if origin is None or not is_frozen_origin(origin) or origin.startswith("bnsurgeon."):
        return None
    new = refreeze(module, origin)
    if new is not None:
        context.inexact = True  # x*scale+shift arithmetic: eval is close, not bitwise
        context.notes.append(f"refrozen into its original class {origin.rsplit('.', 1)[-1]}")
    return new


def _with_tensors(new: nn.Module, fields: BNFields) -> nn.Module:
    attach_affine(new, fields, as_parameters=True)
    if fields.track_running_stats:
        attach_stats(new, fields, with_counter=True)
    return new


def to_plain(module: nn.Module, context: BuildContext) -> nn.Module:
    """BatchNorm1d/2d/3d as recorded; BatchNorm2d (with a note) when the origin is unknown."""
    if type(module) in PLAIN_BN.values():
        return context.keep(module, "already plain")
    fields = read_fields(module)
    cls = PLAIN_BN.get(fields.origin)
    if cls is None and context.input_dims in _BN_FOR_DIMS:
        cls = _BN_FOR_DIMS[context.input_dims]
        context.notes.append(
            f"{short_name(fields.origin)} has no dimensionality; {cls.__name__} from the "
            f"{context.input_dims}-d input the check input gave it"
        )
    if cls is None:
        cls = nn.BatchNorm2d
        if not is_frozen_origin(fields.origin):
            context.notes.append(
                f"original BN dimensionality unknown (from {fields.origin}); chose BatchNorm2d "
                "(same arithmetic for any input rank, only its input-rank check differs)"
            )
    momentum = fields.momentum if fields.momentum is not None or not is_frozen_origin(fields.origin) else 0.1
    new = cls(fields.num_features, fields.eps, momentum, fields.affine, fields.track_running_stats, device="meta")
    return _with_tensors(new, fields)


def to_plain_act(module: nn.Module, context: BuildContext) -> nn.Module:
    """timm's BatchNormAct2d, keeping the source's act and drop modules."""
    from timm.layers import BatchNormAct2d

    if type(module) is BatchNormAct2d:
        return context.keep(module, "already plain")
    fields = read_fields(module)
    new = BatchNormAct2d(
        fields.num_features,
        fields.eps,
        fields.momentum,  # type: ignore[arg-type]  # timm types momentum as float; None (cumulative) works
        fields.affine,
        fields.track_running_stats,
        apply_act=False,
        device="meta",
    )
    _with_tensors(new, fields)
    attach_children(new, fields)
    return new


def _fold(module: nn.Module, context: BuildContext, *, keep_act: bool) -> nn.Module:
    from bnsurgeon.rules.fold import Unfoldable, fold_into, fused_replacement

    if context.producer is None:
        return context.keep(module, context.fold_reason or "no Conv/Linear producer found")
    fields = read_fields(module)
    try:
        context.replaces[id(context.producer)] = fold_into(context.producer, fields)
    except Unfoldable as problem:  # exact in float64, not in the producer's dtype: the BN stays, with why
        return context.keep(module, str(problem))
    return fused_replacement(fields, keep_act=keep_act)


def to_fused(module: nn.Module, context: BuildContext) -> nn.Module:
    """Folded into its producer's weight and bias (eval semantics); nothing takes its place."""
    return _fold(module, context, keep_act=False)


def to_fused_act(module: nn.Module, context: BuildContext) -> nn.Module:
    """Folded into its producer; its own drop and act stay in its place."""
    return _fold(module, context, keep_act=True)


def regroup_or_keep(rebuild):
    """A layer that is already sync: rebuilt (same tensors) when a process_group is given, else kept."""

    def build(module: nn.Module, context: BuildContext) -> nn.Module:
        if context.process_group is not None and context.process_group is not getattr(module, "process_group", None):
            return rebuild(module, context)
        return context.keep(module, "already sync")

    return build


def keep_if(kind: str):
    """Builder for a target the module already is."""

    def build(module: nn.Module, context: BuildContext) -> nn.Module:
        return context.keep(module, f"already {kind}")

    return build


def thaw_or_keep(unfreeze):
    """Frozen sources under --to sync/plain.

    A module bnsurgeon froze (its origin is a trainable class) always goes back; a
    module frozen in the source model stays frozen unless --frozen unfreeze.
    """

    def build(module: nn.Module, context: BuildContext) -> nn.Module:
        origin = getattr(module, "bnsurgeon_origin", None)
        if origin is not None and not is_frozen_origin(origin):
            return unfreeze(module, context)
        if context.frozen == "unfreeze":
            return unfreeze(module, context)
        return context.keep(module, "frozen in the source; kept frozen (--frozen unfreeze to train it)")

    return build


#: frozen classes a family registers at run time (transformers' *FrozenBatchNorm2d): origin -> builder
_registered_frozen: dict[str, "Callable[[nn.Module], nn.Module]"] = {}


def register_frozen_origin(origin: str, make: "Callable[[nn.Module], nn.Module]") -> None:
    """Let ``--to frozen`` rebuild a layer thawed from ``origin`` (a frozen class a rule family found) with
    ``make(module)``, which returns that class holding the module's tensors."""
    _registered_frozen[origin] = make


def frozen_origin_classes() -> dict[str, type]:
    """The frozen classes a layer can be thawed from, by qualified name (a fixed allow-list)."""
    from bnsurgeon.runtime import FrozenBatchNorm, FrozenBatchNormAct

    classes: list[type] = [FrozenBatchNorm, FrozenBatchNormAct]
    try:
        from torchvision.ops.misc import FrozenBatchNorm2d

        classes.append(FrozenBatchNorm2d)
    except ImportError:
        pass
    try:
        from timm.layers import FrozenBatchNormAct2d

        classes.append(FrozenBatchNormAct2d)
    except ImportError:
        pass
    return {qualname(cls): cls for cls in classes}


def refreeze(module: nn.Module, origin: str) -> nn.Module | None:
    """``module`` (plain or sync, thawed from a frozen ``origin``) as that frozen class again.

    Holds the module's current tensors, so what was trained while thawed is kept; act and
    drop modules are reused. None when ``origin`` is not a frozen class bnsurgeon knows.
    """
    from bnsurgeon.runtime import FrozenBatchNorm

    if origin in _registered_frozen:
        return _registered_frozen[origin](module)
    cls: Any = frozen_origin_classes().get(origin)  # torchvision's, timm's or bnsurgeon's frozen classes
    if cls is None:
        return None
    if issubclass(cls, FrozenBatchNorm):
        new = cls.from_module(module)
        new.bnsurgeon_origin = None  # frozen in the source, as it was
        return new
    fields = read_fields(module)
    if "Act" in cls.__name__:
        new = cls(fields.num_features, fields.eps, apply_act=False)
        attach_children(new, fields)
    else:
        new = cls(fields.num_features, fields.eps)
    attach_affine(new, fields, as_parameters=False)
    attach_stats(new, fields, with_counter=False)
    return new
