"""bnsurgeon's runtime layers: synchronized and frozen batch norm, with and without act.

``SyncBatchNorm`` subclasses ``torch.nn.SyncBatchNorm`` (isinstance checks and state-dict
keys unchanged) and makes the same decisions as torch: eval mode, no process group, or
a world of one -> plain ``F.batch_norm``, bit-identical to the original BN. Training
under a process group of size > 1 -> ``SyncBatchNormFunction``, on CPU (gloo) too. A tensor
subclass with a ``__torch_function__`` (MONAI's MetaTensor) enters a synchronizing call as it
enters ``F.batch_norm`` (``synchronized_batch_norm``), and gets its result back as from it.

The frozen classes normalize with the running statistics through ``F.batch_norm`` in
eval mode, so a frozen model is bit-identical to the source BN model in eval mode.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function_unary

from bnsurgeon.core.anatomy import BNFields, attach_affine, attach_children, attach_stats, read_fields
from bnsurgeon.runtime import replicas
from bnsurgeon.runtime.identity import LayerIdentity, default_name
from bnsurgeon.runtime.outside_compile import outside_compile
from bnsurgeon.runtime.recompute import recomputing
from bnsurgeon.runtime.sync_function import SyncBatchNormFunction, cumulative_factor

_TORCH_TAKES_BIAS = "bias" in inspect.signature(nn.SyncBatchNorm.__init__).parameters


def _describe_group(group) -> str:
    """'the process group of ranks [0, 1]' (or of N ranks when the ranks cannot be listed)."""
    try:
        return f"the process group of ranks {dist.get_process_group_ranks(group)}"
    except Exception:  # not initialized here, or an older torch
        return "a process group other than the default one"


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
    """Synchronized batch norm that also runs on CPU/gloo, and knows the class it came from.

    Takes every constructor argument torch's ``nn.SyncBatchNorm`` takes (``bias`` too,
    also on torch versions whose class lacks it). A ``deepcopy`` (an EMA copy) shares the
    process group; pickling cannot hold a process group, see ``__getstate__``.
    """

    #: qualified name of the class this module was converted from (None if built directly);
    #: not annotated, because TorchScript cannot read a postponed ``Optional[str]`` class annotation
    bnsurgeon_origin = None
    #: True on the copies nn.DataParallel makes each forward (torch's replicate sets it on the copy)
    _is_replica = False
    __jit_unused_properties__ = ["layer_name"]
    __jit_ignored_attributes__ = ["bnsurgeon_origin", "_identity", "_pickled_group", "_adopted_from"]

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
    ) -> None:
        if _TORCH_TAKES_BIAS:
            super().__init__(
                num_features, eps, momentum, affine, track_running_stats, process_group, device, dtype, bias=bias
            )
        else:
            super().__init__(num_features, eps, momentum, affine, track_running_stats, process_group, device, dtype)
            if affine and not bias:
                self.register_parameter("bias", None)
        self._identity = LayerIdentity(default_name(type(self).__name__, num_features), fixed=False)
        self._pickled_group: Optional[str] = None

    @property
    def layer_name(self) -> str:
        """Name in the header of this layer's rows (identity.py): the module path once converted or loaded; for a
        layer built directly or adopted, what the ranks run fixes it at the first synchronized call."""
        return self._identity.name

    @layer_name.setter
    def layer_name(self, name: str) -> None:
        self._identity = LayerIdentity(name)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Any = None) -> nn.Module:
        """bnsurgeon's conversion under torch's name: exact-type rules, act/drop and hooks kept, in place.

        Like torch's, it converts ``module``'s children in place and returns the (possibly
        new) root; unlike torch's, it returns bnsurgeon's layers, which train on CPU too,
        and refuses BN subclasses no rule claims instead of converting them silently.
        """
        from bnsurgeon.surgery.walk import convert

        return convert(module, "sync", process_group=process_group, inplace=True).model

    @classmethod
    def adopt(cls, module: nn.Module, name: Optional[str] = None) -> "SyncBatchNorm":
        """``module``, a torch ``nn.SyncBatchNorm`` (or a subclass converted as torch's), made this class in place.

        The same object: its Parameters (an optimizer built before keeps training them), buffers,
        ``state_dict`` keys, hooks, ``requires_grad`` and training flag are untouched, and
        ``isinstance(module, nn.SyncBatchNorm)`` stays true. It pickles as the class it was built as
        (``__reduce_ex__``), so a whole model saved while it trains loads without bnsurgeon.
        """
        origin = type(module)
        module.__class__ = cls
        module.bnsurgeon_origin = f"{origin.__module__}.{origin.__qualname__}"
        module._adopted_from = origin
        module._pickled_group = None
        if name:
            module._identity = LayerIdentity(name)
        else:  # named by what the ranks run at its first synchronized call, never by when this rank adopted it
            module._identity = LayerIdentity(default_name(cls.__name__, module.num_features), fixed=False)
        return module  # type: ignore[return-value]

    def __reduce_ex__(self, protocol: Any) -> Any:
        """An adopted layer pickles as the class it was built as, with that class's own attributes."""
        origin = self.__dict__.get("_adopted_from")
        if origin is None:
            return super().__reduce_ex__(protocol)
        ours = ("_adopted_from", "_identity", "_pickled_group", "bnsurgeon_origin")
        state = {key: value for key, value in self.__dict__.items() if key not in ours}
        return (object.__new__, (origin,), state)

    def __deepcopy__(self, memo: dict) -> "SyncBatchNorm":
        """A deep copy (timm's ModelEma, swa_utils) shares the process group instead of pickling it."""
        group = self.__dict__.get("process_group")
        if group is not None:
            memo[id(group)] = group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def __getstate__(self) -> dict:
        """Pickling (torch.save of a whole model) drops a subgroup: a ProcessGroup cannot be pickled.

        The unpickled layer remembers which group it had and refuses to train synced until
        one is given again (``bnsurgeon.convert(model, "sync", process_group=..., inplace=True)``),
        rather than silently syncing over the default group. The default group (None) pickles as is.
        """
        state = self.__dict__.copy()
        group = state.get("process_group")
        if group is not None:
            state["process_group"] = None
            state["_pickled_group"] = _describe_group(group)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_pickled_group", None)
        if "_identity" not in self.__dict__:  # pickled by a bnsurgeon without layer identities
            given = state.get("layer_name")
            self._identity = LayerIdentity(given or default_name(type(self).__name__, self.num_features), bool(given))

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    @torch.jit.unused
    def _sync_group(self):
        """The process group to synchronize over, or None when plain BN is what torch would run."""
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1
        group = self.process_group
        if group is None and self.__dict__.get("_pickled_group"):
            from bnsurgeon.core.errors import UsageError

            raise UsageError(
                f"sync batch norm '{self.layer_name}' was pickled while syncing over {self._pickled_group}; "
                "a process group cannot be pickled, so it has none now",
                "give it again: bnsurgeon.convert(model, 'sync', process_group=group, inplace=True)",
            )
        world_size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        return (group, world_size) if world_size > 1 else (None, 1)

    @torch.jit.unused
    def _sync_forward(
        self,
        x: torch.Tensor,
        running_mean: Optional[torch.Tensor],
        running_var: Optional[torch.Tensor],
        factor: float,
        cumulative: bool = False,
    ) -> Optional[torch.Tensor]:
        """The synchronized batch norm, or None when torch would run plain BN (no group, world of one).

        ``cumulative`` (``momentum=None``): the factor is 1 / num_batches_tracked, read on the host only
        on the CPU; on a device it stays a tensor, so the step has no host read and can be captured.
        """
        group, world_size = self._sync_group()
        if world_size <= 1:
            return None
        if not self._identity.fixed:
            self._identity.fix(self, group)
        momentum: Any = factor
        if cumulative and self.num_batches_tracked is not None:
            momentum = cumulative_factor(self.num_batches_tracked, x.dtype)
        return SyncBatchNormFunction.apply(
            x,
            self.weight,
            self.bias,
            running_mean,
            running_var,
            self.eps,
            momentum,
            group,
            world_size,
            self._identity,
        )

    @torch.jit.unused
    def _synchronizes(self) -> bool:
        """Whether a train-mode call synchronizes: a DataParallel replica, or a group of more than one rank."""
        return self._is_replica or self._sync_group()[1] > 1

    @torch.jit.unused
    def _normalize_subclass(self, x: torch.Tensor) -> torch.Tensor:
        """A synchronizing call given a tensor subclass (MONAI's MetaTensor), entered as ``F.batch_norm`` is: through
        the subclass's ``__torch_function__``, which runs ``synchronized_batch_norm`` and wraps its plain result as
        it wraps F.batch_norm's. Outside compiled graphs (below the class). A layer whose first synchronized call
        fixes its name is named here, from its callers' frames rather than the subclass's."""
        group, world_size = self._sync_group()
        if world_size > 1 and not self._identity.fixed:
            self._identity.fix(self, group)
        return handle_torch_function(synchronized_batch_norm, (x,), x, self)

    @torch.jit.unused
    def _compiled_sync(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Under ``torch.compile``: traced batch norm around two collective custom ops (sync_op.py), or None."""
        group, world_size = self._sync_group()
        if world_size <= 1:
            return None
        if x.numel() == 0:
            return self._normalize_eagerly(x)
        from bnsurgeon.runtime import sync_op

        y, mean, var, total, counted = sync_op.sync_batch_norm(
            x,
            self.weight,
            self.bias,
            self.eps,
            "" if group is None else group.group_name,
            world_size,
            self._identity.token,
        )
        if self.track_running_stats:
            sync_op.update_compiled_stats(
                self.running_mean, self.running_var, self.num_batches_tracked, mean, var, total, counted, self.momentum
            )
        return y

    @torch.jit.unused
    def _normalize_eagerly(self, x: torch.Tensor) -> torch.Tensor:
        """An empty batch under ``torch.compile``: the eager layer, outside the graph (a graph break).

        Traced math on zero-element tensors carries no data dependency, so inductor dropped
        and reordered the collectives of a rank whose batch is empty, and the ranks deadlocked
        or mismatched; run eagerly, the layer issues them in program order. With
        ``fullgraph=True`` dynamo refuses the break, quoting the reason given to ``outside_compile`` below
        the class (marked once dynamo is imported: outside_compile.py).
        """
        return self._normalize(x)

    def _replicate_for_data_parallel(self) -> nn.Module:
        """nn.DataParallel's copy of this layer, enrolled with the other copies of this forward (replicas.py)."""
        return replicas.enrol(self, super()._replicate_for_data_parallel(), self.layer_name)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training:  # eval: torch's BN call, with nothing else on the way (host time is the cost)
            stats_missing = self.running_mean is None and self.running_var is None
            momentum = 0.0 if self.momentum is None else self.momentum
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, stats_missing, momentum, self.eps
            )
        if not torch.jit.is_scripting():
            if type(x) is not torch.Tensor and has_torch_function_unary(x) and self._synchronizes():
                return self._normalize_subclass(x)  # MONAI's MetaTensor, torchvision's tv_tensors, ...
        return self._normalize_batch(x)

    def _normalize_batch(self, x: torch.Tensor) -> torch.Tensor:
        """Train mode: by the batch's statistics, synchronized where torch's layer would synchronize."""
        counts = True
        if not torch.jit.is_scripting():
            if self.training and self._is_replica:
                return replicas.normalize_replica(self, x)  # nn.DataParallel: sync across its replicas
            compiling = torch.compiler.is_compiling()
            if self.training and compiling:
                synced = self._compiled_sync(x)
                if synced is not None:
                    return synced
            # a checkpoint recompute counts no batch (recompute.py); compiled without a group the layer is plain BN,
            # which counts every forward as torch's does (and the autograd engine's task id cannot be traced)
            counts = compiling or not recomputing()
        factor = 0.0 if self.momentum is None else self.momentum
        cumulative = False
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            if counts:
                self.num_batches_tracked.add_(1)
            cumulative = self.momentum is None
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        use_buffers = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_buffers else None
        running_var = self.running_var if use_buffers else None

        if bn_training and self.training and not torch.jit.is_scripting():
            synced = self._sync_forward(x, running_mean, running_var, factor, cumulative)
            if synced is not None:
                return synced
        if cumulative and self.num_batches_tracked is not None:  # plain BN, as torch's: a float factor
            factor = 1.0 / float(self.num_batches_tracked)
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
            fields.num_features,
            fields.eps,
            fields.momentum,
            fields.affine,
            fields.track_running_stats,
            process_group or fields.process_group,
            device="meta",
        )

    @staticmethod
    def _adopt(new: nn.Module, fields: BNFields) -> None:
        attach_affine(new, fields, as_parameters=True)
        if fields.track_running_stats:
            attach_stats(new, fields, with_counter=True)
        new.bnsurgeon_origin = fields.origin


def synchronized_batch_norm(input: torch.Tensor, layer: SyncBatchNorm) -> torch.Tensor:
    """``layer``'s synchronized train-mode batch norm of a tensor subclass's ``input``: the function the subclass's
    ``__torch_function__`` runs, as it runs ``F.batch_norm``, and whose plain result it wraps as it wraps that one
    (MONAI's MetaTensor with its metadata; torchvision's tv_tensors as a plain tensor). The layer sees a plain alias
    of the input (its strides, attached to autograd), so no allocation or collective inside meets the subclass's own
    methods (a MetaTensor's ``new_empty`` takes no int size). Made with the subclass's ``__torch_function__`` off,
    not by ``as_subclass``, which torch 2.4 refuses under any dispatch mode (a FLOP counter)."""
    with torch._C.DisableTorchFunctionSubclass():
        plain = torch.ops.aten.alias.default(input)
    return layer._normalize_batch(plain)


outside_compile(
    SyncBatchNorm,
    "_normalize_eagerly",
    "bnsurgeon: a sync batch norm layer whose local batch is empty runs eagerly (traced, its collectives "
    "would carry no data dependency and inductor would drop and reorder them); compile without "
    "fullgraph=True, or give every rank at least one sample",
)
outside_compile(
    SyncBatchNorm,
    "_normalize_subclass",
    "bnsurgeon: a sync batch norm layer given a tensor subclass (MONAI's MetaTensor, torchvision's tv_tensors) "
    "runs eagerly, entered through the subclass's __torch_function__ as F.batch_norm is, which dynamo cannot trace "
    "around the layer's collectives; compile without fullgraph=True, or give the model a plain tensor "
    "(x.as_subclass(torch.Tensor))",
)


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
        *,
        bias: bool = True,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, process_group, device, dtype, bias=bias
        )
        _norm_act_children(self, act_layer, act_kwargs, apply_act, inplace, drop_layer)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(self._normalize(input)))

    @classmethod
    def _empty(cls, fields: BNFields, process_group: Any) -> "SyncBatchNormAct":
        return cls(
            fields.num_features,
            fields.eps,
            fields.momentum,
            fields.affine,
            fields.track_running_stats,
            apply_act=False,
            process_group=process_group or fields.process_group,
            device="meta",
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

    bnsurgeon_origin = None  # qualified name of the source class (None if built directly)
    __jit_ignored_attributes__ = ["bnsurgeon_origin"]

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        affine: bool = True,
        momentum: Optional[float] = 0.1,
        track_count: bool = False,
        device=None,
        dtype=None,
    ) -> None:
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

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "num_batches_tracked"
        if "num_batches_tracked" not in self._buffers and key in state_dict:
            del state_dict[key]
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

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
            from bnsurgeon.core.errors import UsageError

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

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        affine: bool = True,
        momentum: float | None = 0.1,
        track_count: bool = False,
        apply_act: bool = True,
        act_layer: Any = nn.ReLU,
        act_kwargs: dict | None = None,
        inplace: bool = True,
        drop_layer: type[nn.Module] | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_features, eps, affine, momentum, track_count, device, dtype)
        _norm_act_children(self, act_layer, act_kwargs, apply_act, inplace, drop_layer)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(self._normalize(input)))

    @classmethod
    def _empty(cls, fields: BNFields) -> "FrozenBatchNormAct":
        return cls(fields.num_features, fields.eps, fields.affine, fields.momentum, apply_act=False, device="meta")
