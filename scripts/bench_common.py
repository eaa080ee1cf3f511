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


def add_sequenced_collectives(model: torch.nn.Module, world_size: int) -> int:
    """Put a sync layer's collectives in front of every BatchNorm of ``model``; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            collectives = LayerCollectives(module.num_features, world_size)
            module.register_forward_pre_hook(lambda _, args, c=collectives: (sequenced(args[0], c), *args[1:]))
            count += 1
    return count


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))
