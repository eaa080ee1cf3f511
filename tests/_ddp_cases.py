"""Workers for the DDP and debug tests (importable by spawned ranks)."""

from __future__ import annotations

import torch
from torch import nn

SPLIT = [3, 5]
STEPS = 3


def tiny_timm_model() -> nn.Module:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("efficientnet_b0", pretrained=False, num_classes=4, drop_rate=0.2, drop_path_rate=0.1)
    # float64: through ~80 layers fp32 roundoff alone reaches ~5e-5 relative, which would
    # hide a real error; in float64 any difference above 1e-5 is a bug, not rounding
    return model.double()


def only_bn_trains(model: nn.Module) -> nn.Module:
    """BN in train mode, everything else in eval, so dropout/drop-path stay out of the comparison."""
    from bnsurgeon.core.anatomy import is_bn_like

    model.train()
    for module in model.modules():
        if not is_bn_like(module):
            module.training = False
    return model


def data(step: int):
    generator = torch.Generator().manual_seed(50 + step)
    x = torch.randn(sum(SPLIT), 3, 32, 32, generator=generator, dtype=torch.float64)
    return x, torch.randn(sum(SPLIT), 4, generator=generator, dtype=torch.float64)


def train(model: nn.Module, rows: slice, scale: float, wrap=None) -> nn.Module:
    net = wrap(model) if wrap else model
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    for step in range(STEPS):
        x, g = data(step)
        loss = (net(x[rows]) * g[rows]).sum() * scale
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def ddp_rank(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    import bnsurgeon

    model = only_bn_trains(bnsurgeon.convert(tiny_timm_model(), "sync").model)
    start = sum(SPLIT[:rank])
    trained = train(model, slice(start, start + SPLIT[rank]), world_size / sum(SPLIT), wrap=DistributedDataParallel)
    return {k: v.detach().clone() for k, v in trained.state_dict().items()}


def skip_layer_rank(rank: int, world_size: int, debug_on: bool) -> str:
    """Rank 1 skips the first sync layer; with the debug switch that must be named, not hang."""
    from bnsurgeon import convert
    from bnsurgeon.runtime import set_sync_debug

    set_sync_debug(debug_on)
    model = convert(nn.Sequential(nn.BatchNorm2d(4), nn.Conv2d(4, 6, 1), nn.BatchNorm2d(6)), "sync").model.train()
    x = torch.randn(2, 4, 3, 3)
    try:
        if rank == 1:
            model[2](model[1](x))
        else:
            model(x)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"
