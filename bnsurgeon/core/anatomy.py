"""Read the state of any BatchNorm-family module into one neutral record.

Every converter reads a module through ``read_fields`` and writes the result through
``attach_affine`` / ``attach_stats``, so that Parameter identity, buffer identity (and
hence values, device and dtype) survive every conversion the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn


def qualname(cls: type) -> str:
    """``module.Class`` name used in reports and checkpoint metadata."""
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class BNFields:
    """What a BatchNorm-family module holds, independent of its class."""

    num_features: int
    eps: float
    momentum: float | None
    affine: bool
    track_running_stats: bool
    weight: "torch.Tensor | None"
    bias: "torch.Tensor | None"
    running_mean: "torch.Tensor | None"
    running_var: "torch.Tensor | None"
    num_batches_tracked: "torch.Tensor | None"
    act: "nn.Module | None"
    drop: "nn.Module | None"
    origin: str
    process_group: Any = None


def _tensor(module: "nn.Module", name: str) -> "torch.Tensor | None":
    if name in module._parameters:
        return module._parameters[name]
    return module._buffers.get(name)


def read_fields(module: "nn.Module") -> BNFields:
    """Read a BN, BN+act, sync or frozen BN module without copying any tensor."""
    weight = _tensor(module, "weight")
    running_mean = _tensor(module, "running_mean")
    num_features = getattr(module, "num_features", None)
    if num_features is None:
        ref = running_mean if running_mean is not None else weight
        if ref is None:
            raise TypeError(f"{type(module).__name__} has neither running statistics nor a weight: not BN-like")
        num_features = int(ref.shape[0])
    return BNFields(
        num_features=int(num_features),
        eps=float(getattr(module, "eps")),  # noqa: B009  (typed: Module.__getattr__ is Tensor | Module)
        momentum=getattr(module, "momentum", 0.1),
        affine=bool(getattr(module, "affine", weight is not None)),
        track_running_stats=bool(getattr(module, "track_running_stats", running_mean is not None)),
        weight=weight,
        bias=_tensor(module, "bias"),
        running_mean=running_mean,
        running_var=_tensor(module, "running_var"),
        num_batches_tracked=_tensor(module, "num_batches_tracked"),
        act=module._modules.get("act"),
        drop=module._modules.get("drop"),
        origin=getattr(module, "bnsurgeon_origin", None) or qualname(type(module)),
        process_group=getattr(module, "process_group", None),
    )


def attach_affine(target: "nn.Module", fields: BNFields, *, as_parameters: bool) -> None:
    """Give ``target`` the source's weight/bias: the same Parameter objects when possible.

    A frozen source stores them as buffers; they become Parameters sharing the same
    storage. A frozen target stores buffers: detached views of the same storage.
    """
    from torch import nn

    for name in ("weight", "bias"):
        value = getattr(fields, name)
        if as_parameters:
            if value is not None and not isinstance(value, nn.Parameter):
                value = nn.Parameter(value, requires_grad=True)
            target._parameters[name] = value
            target._buffers.pop(name, None)
        else:
            if isinstance(value, nn.Parameter):
                value = value.detach()
            target._parameters.pop(name, None)
            target._buffers[name] = value


def attach_stats(target: "nn.Module", fields: BNFields, *, with_counter: bool) -> None:
    """Give ``target`` the source's running statistics (same tensor objects)."""
    target._buffers["running_mean"] = fields.running_mean
    target._buffers["running_var"] = fields.running_var
    if with_counter:
        counter = fields.num_batches_tracked
        if counter is None and fields.running_mean is not None:
            import torch

            counter = torch.tensor(0, dtype=torch.long, device=fields.running_mean.device)
        target._buffers["num_batches_tracked"] = counter
    elif "num_batches_tracked" in target._buffers:
        del target._buffers["num_batches_tracked"]


def attach_children(target: "nn.Module", fields: BNFields) -> None:
    """Give ``target`` the source's own act and drop modules (identity, hooks and state survive)."""
    if fields.act is not None:
        target.act = fields.act
    if fields.drop is not None:
        target.drop = fields.drop


def is_bn_like(module: "nn.Module") -> bool:
    """A _BatchNorm subclass, or anything holding running_mean and running_var buffers."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.instancenorm import _InstanceNorm

    if isinstance(module, _InstanceNorm):
        return False
    if isinstance(module, _BatchNorm):
        return True
    return "running_mean" in module._buffers and "running_var" in module._buffers


def is_uninitialized_lazy(module: "nn.Module") -> bool:
    from torch.nn.modules.lazy import LazyModuleMixin

    return isinstance(module, LazyModuleMixin) and module.has_uninitialized_params()
