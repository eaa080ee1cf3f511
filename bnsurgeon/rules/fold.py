"""The fold arithmetic of the ``fused`` target: a BN's eval affine map merged into its producer's weight
and bias, computed in float64 and refused (``Unfoldable``) where the producer's dtype cannot hold it.

Which BN is folded into which producer is the surgery's decision (``surgery.fusion``); the builders
here only do the fold they are handed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bnsurgeon.core.anatomy import BNFields
from bnsurgeon.core.layout import counted
from bnsurgeon.core.module_copy import shallow_clone

if TYPE_CHECKING:
    import torch
    from torch import nn


def bn_scale_shift(fields: BNFields) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Eval BN as y = x * scale + shift per channel, in float64."""
    import torch

    assert fields.running_var is not None and fields.running_mean is not None, "only BN with running statistics folds"
    var = fields.running_var.detach().double()
    mean = fields.running_mean.detach().double()
    scale = torch.rsqrt(var + fields.eps)
    if fields.weight is not None:
        scale = scale * fields.weight.detach().double()
    shift = -mean * scale
    if fields.bias is not None:
        shift = shift + fields.bias.detach().double()
    return scale, shift


class Unfoldable(ValueError):
    """The fold is exact in float64 but cannot be held in the producer's dtype (the reason is the message);
    the BN stays. Internal: caught by the fused builder, never shown as an error."""


def fold_into(producer: "nn.Module", fields: BNFields) -> "nn.Module":
    """A copy of ``producer`` whose output equals BN(producer(x)) in eval: new weight and bias Parameters.

    The source producer is untouched (copy on write, like every conversion). Raises Unfoldable
    where the folded weights or bias overflow the producer's dtype, or round a whole output
    channel's weights to zero that are not zero in float64 (see ``_dtype_reason``).
    """
    scale, shift = bn_scale_shift(fields)
    return _fold_scale_shift(producer, scale, shift)


def _fold_scale_shift(producer: "nn.Module", scale: "torch.Tensor", shift: "torch.Tensor") -> "nn.Module":
    """Fold y -> y * scale + shift (float64, per output channel) into ``producer``.

    Conv/Linear weights hold output channels on dim 0; transposed convs on dim 1, per group;
    a MixedConv2d's convs each own the next slice of its output channels (concatenated).
    """
    import torch
    from torch import nn

    if is_mixed_conv(producer):
        clone, start = shallow_clone(producer), 0
        for name, conv in producer.named_children():
            width = out_features(conv)
            clone._modules[name] = _fold_scale_shift(conv, scale[start : start + width], shift[start : start + width])
            start += width
        return clone
    weight: torch.Tensor = getattr(producer, "weight")  # noqa: B009  (typed: Module.__getattr__ is Tensor | Module)
    w64 = weight.detach().double()
    if isinstance(producer, nn.modules.conv._ConvTransposeNd):
        groups = producer.groups
        grouped = w64.reshape(groups, weight.shape[0] // groups, *weight.shape[1:])
        view = scale.reshape(groups, 1, weight.shape[1], *([1] * (weight.dim() - 2)))
        folded = (grouped * view).reshape(weight.shape)
    else:
        folded = w64 * scale.reshape(-1, *([1] * (weight.dim() - 1)))
    bias: torch.Tensor | None = getattr(producer, "bias")  # noqa: B009
    b64 = bias.detach().double() if bias is not None else torch.zeros_like(shift)
    new_bias = b64 * scale + shift
    cast_weight = folded.to(weight.dtype)
    cast_bias = new_bias.to(device=weight.device, dtype=bias.dtype if bias is not None else weight.dtype)
    reason = _dtype_reason(
        folded,
        cast_weight,
        new_bias,
        cast_bias,
        channel_dim=1 if isinstance(producer, nn.modules.conv._ConvTransposeNd) else 0,
        groups=getattr(producer, "groups", 1),
    )
    if reason is not None:
        raise Unfoldable(reason)
    clone = shallow_clone(producer)
    clone._parameters["weight"] = nn.Parameter(cast_weight, requires_grad=weight.requires_grad)
    clone._parameters["bias"] = nn.Parameter(
        cast_bias,
        requires_grad=bias.requires_grad if bias is not None else weight.requires_grad,
    )
    return clone


def _dtype_reason(
    weight64: "torch.Tensor",
    weight: "torch.Tensor",
    bias64: "torch.Tensor",
    bias: "torch.Tensor",
    *,
    channel_dim: int = 0,
    groups: int = 1,
) -> str | None:
    """Why the float64 fold cannot be held in the producer's dtype, or None.

    Overflow: a folded weight or bias that is finite in float64 becomes inf (float16's max is
    65504). Underflow: an output channel whose float64 folded weights are not all zero rounds to
    all-zero weights (its input is then lost; float16's smallest subnormal is 6e-8). A channel
    that only loses some of its weights is not caught here: the pre-write check measures it.
    """
    import torch

    if weight.is_meta:  # a model built on the meta device to load a file into: no values to judge
        return None
    name = str(weight.dtype).replace("torch.", "")
    for what, high, low in (("weights", weight64, weight), ("bias", bias64, bias)):
        over = high.isfinite() & ~low.isfinite()
        if bool(over.any()):
            largest = high[over].abs().max().item()
            return (
                f"the fold overflows {name}: folded {what} reach {largest:.3g}, beyond {name}'s max "
                f"{torch.finfo(low.dtype).max:.3g} (a BN scale gamma/sqrt(var+eps) too large for {name}; "
                "convert a float32 copy to fold it)"
            )
    if channel_dim == 1:  # transposed conv: (in, out/groups, ...) per group -> (out, ...)
        shape = weight.shape

        def per_channel(t):
            return t.reshape(groups, shape[0] // groups, shape[1], -1).transpose(1, 2).reshape(groups * shape[1], -1)
    else:

        def per_channel(t):
            return t.reshape(t.shape[0], -1)

    lost = (per_channel(weight64) != 0).any(1) & ~(per_channel(weight) != 0).any(1)
    if bool(lost.any()):
        channels = lost.nonzero().flatten().tolist()
        listed = ", ".join(map(str, channels[:6])) + (", ..." if len(channels) > 6 else "")
        return (
            f"the fold underflows {name}: {counted(len(channels), 'output channel')} ({listed}) would have all-zero "
            f"weights in {name} (a BN scale gamma/sqrt(var+eps) too small for {name}; convert a float32 copy "
            "to fold it)"
        )
    return None


def fused_replacement(fields: BNFields, *, keep_act: bool) -> "nn.Module":
    """What takes a folded BN's place: nothing (Identity), or its own drop and act."""
    from torch import nn

    if not keep_act:
        return nn.Identity()
    from bnsurgeon.runtime.folded import FoldedNormAct

    return FoldedNormAct(fields.drop, fields.act)


def producer_types() -> tuple[type, ...]:
    """Exact classes a BN folds into: torch's conv/linear, and timm's subclasses whose forward
    uses ``self.weight``/``self.bias`` unchanged (SAME padding, the scripting-safe Linear), and
    timm's MixedConv2d (each of its convs owns a slice of the output channels). Other subclasses
    may change the weight (weight standardization, CondConv's expert mixing) and are left."""
    from torch import nn

    torch_types = (
        nn.Conv1d,
        nn.Conv2d,
        nn.Conv3d,
        nn.ConvTranspose1d,
        nn.ConvTranspose2d,
        nn.ConvTranspose3d,
        nn.Linear,
    )
    return torch_types + _timm_producer_types()


def _timm_producer_types() -> tuple[type, ...]:
    try:
        from timm.layers import Linear, MixedConv2d
        from timm.layers.conv2d_same import Conv2dSame, Conv2dSameExport
    except ImportError:  # timm absent or reorganized: torch's classes only
        return ()
    return (Conv2dSame, Conv2dSameExport, Linear, MixedConv2d)


def is_mixed_conv(module: "nn.Module") -> bool:
    return type(module).__name__ == "MixedConv2d" and type(module) in _timm_producer_types()


def out_features(module: "nn.Module") -> int:
    return int(getattr(module, "out_channels", None) or getattr(module, "out_features"))  # noqa: B009
