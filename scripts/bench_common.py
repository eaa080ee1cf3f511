"""The reference both runtime benchmarks compare against: native BN plus exactly the
collectives a bnsurgeon sync layer issues, in the places it issues them.

Any synchronized BN must at least wait for the other ranks' statistics before it can
normalize and for the summed gradient terms before it can form the input gradient, so
native BN behind this stand-in is the floor a sync layer can reach on the same machine.
"""

from __future__ import annotations

import math

import torch

from bnsurgeon.runtime.collectives import all_gather_rows, all_reduce_sum


class LayerCollectives:
    """The two collectives of one sync layer with ``channels`` channels."""

    def __init__(self, channels: int, world_size: int, group=None) -> None:
        self.stats = torch.zeros(2 * channels + 1)  # count, mean, var
        self.grads = torch.zeros(2 * channels)  # sum(dy), sum(dy * xhat)
        self.world_size = world_size
        self.group = group

    def forward_gather(self) -> None:
        all_gather_rows(self.stats, self.world_size, self.group)

    def backward_sum(self) -> None:
        all_reduce_sum(self.grads, self.world_size, self.group)

    def both(self) -> None:
        self.forward_gather()
        self.backward_sum()


class _Sequenced(torch.autograd.Function):
    """Identity that runs the forward collective now and the backward one in backward."""

    @staticmethod
    def forward(ctx, x, collectives: LayerCollectives):
        collectives.forward_gather()
        ctx.collectives = collectives
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.collectives.backward_sum()
        return grad, None


def sequenced(x: torch.Tensor, collectives: LayerCollectives) -> torch.Tensor:
    return _Sequenced.apply(x, collectives)


_LAYERS: dict[int, LayerCollectives] = {}


@torch.library.custom_op("bnsurgeon_bench::gather_then_copy", mutates_args=())
def _gather_then_copy(weight: torch.Tensor, layer: int) -> torch.Tensor:
    """The forward collective of layer ``layer``, then a copy of the (C,) weight that BN reads."""
    _LAYERS[layer].forward_gather()
    return weight.clone()


@_gather_then_copy.register_fake
def _(weight, layer):
    return torch.empty_like(weight)


@torch.library.custom_op("bnsurgeon_bench::sum_then_copy", mutates_args=())
def _sum_then_copy(grad: torch.Tensor, layer: int) -> torch.Tensor:
    """The backward collective of layer ``layer``, then the (C,) weight gradient passed on."""
    _LAYERS[layer].backward_sum()
    return grad.clone()


@_sum_then_copy.register_fake
def _(grad, layer):
    return torch.empty_like(grad)


def _setup(ctx, inputs, output):
    ctx.layer = inputs[1]


def _backward(ctx, grad):
    return _sum_then_copy(grad, ctx.layer), None


_gather_then_copy.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("bnsurgeon_bench::gather_local_stats", mutates_args=())
def _gather_local_stats(mean: torch.Tensor, var: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward collective of layer ``layer``, then (mean, var) unchanged: local statistics
    that the normalization must wait for, as a sync layer's global ones."""
    _LAYERS[layer].forward_gather()
    return mean.clone(), var.clone()


@_gather_local_stats.register_fake
def _(mean, var, layer):
    return torch.empty_like(mean), torch.empty_like(var)


@torch.library.custom_op("bnsurgeon_bench::sum_stat_grads", mutates_args=())
def _sum_stat_grads(grad_mean: torch.Tensor, grad_var: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward collective of layer ``layer``, then the statistics' gradients unchanged."""
    _LAYERS[layer].backward_sum()
    return grad_mean.clone(), grad_var.clone()


@_sum_stat_grads.register_fake
def _(grad_mean, grad_var, layer):
    return torch.empty_like(grad_mean), torch.empty_like(grad_var)


def _stats_backward(ctx, grad_mean, grad_var):
    return (*_sum_stat_grads(grad_mean, grad_var, ctx.layer), None)


_gather_local_stats.register_autograd(
    _stats_backward, setup_context=lambda ctx, inputs, output: setattr(ctx, "layer", inputs[2])
)


def _compiled_sequenced_bn(self, x: torch.Tensor, factor: float) -> torch.Tensor:
    """Plain (local) BN as inductor decomposes it (var_mean, normalize), its statistics passed
    through the two collectives: each collective on the path a sync BN waits on it, in both
    directions. Around ``F.batch_norm`` instead, the collectives would depend on nothing but
    the weight, and inductor hoists them off that path (all forward gathers first, all backward
    sums after the last convolution's backward): no synchronized BN can do that."""
    dims = [0, *range(2, x.dim())]
    var, mean = torch.var_mean(x, dims, correction=0)
    mean, var = _gather_local_stats(mean, var, self._bench_layer)
    if self.running_mean is not None:
        count = x.numel() // x.shape[1]
        with torch.no_grad():
            self.running_mean.lerp_(mean, factor)
            self.running_var.lerp_(var * (count / max(count - 1, 1)), factor)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return (x - mean.view(shape)) * (torch.rsqrt(var + self.eps) * self.weight).view(shape) + self.bias.view(shape)


def _sequenced_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Plain BN with a sync layer's two collectives. Eager: native BN whose weight passes through
    them (custom ops: only (C,) copies are added to plain BN's work). Compiled: see
    ``_compiled_sequenced_bn``."""
    import torch.nn.functional as F

    if self.training and self.num_batches_tracked is not None:
        self.num_batches_tracked.add_(1)
    factor = 0.0 if self.momentum is None else self.momentum
    if self.training and torch.compiler.is_compiling():
        y = _compiled_sequenced_bn(self, x, factor)
    else:
        weight = _gather_then_copy(self.weight, self._bench_layer)
        y = F.batch_norm(x, self.running_mean, self.running_var, weight, self.bias, self.training, factor, self.eps)
    if hasattr(self, "act"):
        y = self.act(self.drop(y))
    return y


def add_sequenced_collectives(model: torch.nn.Module, world_size: int) -> int:
    """Give every (affine) BatchNorm of ``model`` a sync layer's two collectives; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module._bench_layer = len(_LAYERS)
            _LAYERS[module._bench_layer] = LayerCollectives(module.num_features, world_size)
            cls = type(module)
            module.__class__ = type(f"Sequenced{cls.__name__}", (cls,), {"forward": _sequenced_forward})
            count += 1
    return count


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))
