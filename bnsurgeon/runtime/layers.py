"""bnsurgeon's runtime layers: synchronized and frozen batch norm, with and without act.

``SyncBatchNorm`` subclasses ``torch.nn.SyncBatchNorm`` (isinstance checks and state-dict
keys unchanged) and makes the same decisions as torch: eval mode, no process group, or
a world of one -> plain ``F.batch_norm``, bit-identical to the original BN. Training
under a process group of size > 1 -> ``SyncBatchNormFunction``, on CPU (gloo) too.

The frozen classes normalize with the running statistics through ``F.batch_norm`` in
eval mode, so a frozen model is bit-identical to the source BN model in eval mode.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..fields import BNFields, attach_affine, attach_children, attach_stats, read_fields
from . import debug
from .sync_function import SyncBatchNormFunction


def _norm_act_children(module: nn.Module, act_layer, act_kwargs, apply_act: bool, inplace: bool, drop_layer) -> None:
    """Build ``drop`` and ``act`` exactly as timm's BatchNormAct2d does."""
    module.drop = drop_layer() if drop_layer is not None else nn.Identity()
    act = None
    if apply_act and act_layer is not None:
        from timm.layers import create_act_layer

        kwargs = dict(act_kwargs or {})
        kwargs.setdefault("inplace", inplace)
        act = create_act_layer(act_layer, **kwargs)
    module.act = nn.Identity() if act is None else act


class SyncBatchNorm(nn.SyncBatchNorm):
    """Synchronized batch norm that also runs on CPU/gloo, and knows the class it came from."""

    #: qualified name of the class this module was converted from (None if built directly)
    bnsurgeon_origin: str | None = None
    #: module path used by the debug rank check; set by surgery
    layer_name: str = ""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, process_group, device, dtype)
        self._sync_calls = 0

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _sync_group(self):
        """The process group to synchronize over, or None when plain BN is what torch would run."""
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1
        group = self.process_group
        world_size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        return (group, world_size) if world_size > 1 else (None, 1)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        use_buffers = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_buffers else None
        running_var = self.running_var if use_buffers else None

        if bn_training and self.training:
            group, world_size = self._sync_group()
            if world_size > 1:
                layer = None
                if debug.enabled():
                    self._sync_calls += 1
                    layer = (self.layer_name or f"{type(self).__name__}({self.num_features})", self._sync_calls)
                return SyncBatchNormFunction.apply(
                    x, self.weight, self.bias, running_mean, running_var,
                    self.eps, factor, group, world_size, layer,
                )
        return F.batch_norm(x, running_mean, running_var, self.weight, self.bias, bn_training, factor, self.eps)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._normalize(input)

    @classmethod
    def from_module(cls, module: nn.Module, process_group: Any = None) -> "SyncBatchNorm":
        """A SyncBatchNorm holding ``module``'s own Parameters and buffers (no copies)."""
        fields = read_fields(module)
        new = cls._empty(fields, process_group)
        cls._adopt(new, fields)
        return new

    @classmethod
    def _empty(cls, fields: BNFields, process_group: Any) -> "SyncBatchNorm":
        return cls(
            fields.num_features, fields.eps, fields.momentum, fields.affine,
            fields.track_running_stats, process_group or fields.process_group, device="meta",
        )

    @staticmethod
    def _adopt(new: nn.Module, fields: BNFields) -> None:
        attach_affine(new, fields, as_parameters=True)
        if fields.track_running_stats:
            attach_stats(new, fields, with_counter=True)
        new.bnsurgeon_origin = fields.origin


class SyncBatchNormAct(SyncBatchNorm):
    """SyncBatchNorm + drop + activation: the synchronized twin of timm's BatchNormAct2d."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        apply_act: bool = True,
        act_layer: Any = nn.ReLU,
        act_kwargs: dict | None = None,
        inplace: bool = True,
        drop_layer: type[nn.Module] | None = None,
        process_group: Any = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, process_group, device, dtype)
        _norm_act_children(self, act_layer, act_kwargs, apply_act, inplace, drop_layer)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(self._normalize(input)))

    @classmethod
    def _empty(cls, fields: BNFields, process_group: Any) -> "SyncBatchNormAct":
        return cls(
            fields.num_features, fields.eps, fields.momentum, fields.affine, fields.track_running_stats,
            apply_act=False, process_group=process_group or fields.process_group, device="meta",
        )

    @staticmethod
    def _adopt(new: nn.Module, fields: BNFields) -> None:
        SyncBatchNorm._adopt(new, fields)
        attach_children(new, fields)


class FrozenBatchNorm(nn.Module):
    """Batch norm with fixed statistics and affine parameters (buffers), any input rank >= 2.

    Unlike torchvision's FrozenBatchNorm2d it normalizes with ``F.batch_norm`` in eval
    mode, so it is bit-identical to the BN it was frozen from, and it keeps the
    ``num_batches_tracked`` counter when the source had one so a round trip loses nothing.
    """

    bnsurgeon_origin: str | None = None

    def __init__(self, num_features: int, eps: float = 1e-5, affine: bool = True, momentum: float | None = 0.1,
                 track_count: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.eps = eps
        self.affine = affine
        self.momentum = momentum  # kept so that unfreezing restores the training setting
        self.track_running_stats = True
        self.register_buffer("weight", torch.ones(num_features, **factory) if affine else None)
        self.register_buffer("bias", torch.zeros(num_features, **factory) if affine else None)
        self.register_buffer("running_mean", torch.zeros(num_features, **factory))
        self.register_buffer("running_var", torch.ones(num_features, **factory))
        if track_count:
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        key = prefix + "num_batches_tracked"
        if "num_batches_tracked" not in self._buffers and key in state_dict:
            del state_dict[key]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._normalize(input)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, affine={self.affine}"

    @classmethod
    def from_module(cls, module: nn.Module) -> "FrozenBatchNorm":
        """A frozen copy-free view of ``module``: its tensors become buffers (shared storage)."""
        fields = read_fields(module)
        if fields.running_mean is None:
            from ..errors import UsageError

            raise UsageError(
                f"{type(module).__name__} has no running statistics (track_running_stats=False), so it cannot be frozen",
                "keep it as batch-statistics BN (--to sync or --to plain)",
            )
        new = cls._empty(fields)
        attach_affine(new, fields, as_parameters=False)
        attach_stats(new, fields, with_counter=fields.num_batches_tracked is not None)
        if isinstance(new, FrozenBatchNormAct):
            attach_children(new, fields)
        new.bnsurgeon_origin = fields.origin
        return new

    @classmethod
    def _empty(cls, fields: BNFields) -> "FrozenBatchNorm":
        return cls(fields.num_features, fields.eps, fields.affine, fields.momentum, device="meta")


class FrozenBatchNormAct(FrozenBatchNorm):
    """FrozenBatchNorm + drop + activation (frozen twin of timm's BatchNormAct2d)."""

    def __init__(self, num_features: int, eps: float = 1e-5, affine: bool = True, momentum: float | None = 0.1,
                 track_count: bool = False, apply_act: bool = True, act_layer: Any = nn.ReLU,
                 act_kwargs: dict | None = None, inplace: bool = True, drop_layer: type[nn.Module] | None = None,
                 device=None, dtype=None) -> None:
        super().__init__(num_features, eps, affine, momentum, track_count, device, dtype)
        _norm_act_children(self, act_layer, act_kwargs, apply_act, inplace, drop_layer)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(self._normalize(input)))

    @classmethod
    def _empty(cls, fields: BNFields) -> "FrozenBatchNormAct":
        return cls(fields.num_features, fields.eps, fields.affine, fields.momentum, apply_act=False, device="meta")
