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


def _sequenced_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Plain BN whose weight passes through the layer's two collectives (custom ops, so dynamo
    keeps them in one graph, and only (C,) copies are added to plain BN's work)."""
    import torch.nn.functional as F

    if self.training and self.num_batches_tracked is not None:
        self.num_batches_tracked.add_(1)
    factor = 0.0 if self.momentum is None else self.momentum
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
