"""Workers for the torch.compile and activation-checkpointing tests (importable by spawned ranks).

The model is timm's ``test_efficientnet`` (13 BatchNormAct2d with in-place SiLU, ~100k
parameters) in float64, BN in train mode and everything else in eval (as in _ddp_cases).
Rank r trains on its slice of each global batch; parameter gradients are summed over the
ranks by hand (no DDP, so nothing but the sync layers is compiled or checkpointed), which
makes two SGD steps equal to one process of plain BN on the whole batch.
"""

from __future__ import annotations

import torch
from torch import nn

SPLIT = [3, 2]
STEPS = 2
LR = 0.05


def graph_model() -> nn.Module:
    import timm
    from _ddp_cases import only_bn_trains

    torch.manual_seed(0)
    return only_bn_trains(timm.create_model("test_efficientnet", pretrained=False, num_classes=4).double())


def bn_layers(model: nn.Module) -> int:
    from bnsurgeon.core.anatomy import is_bn_like

    return sum(1 for module in model.modules() if is_bn_like(module))


def data(step: int):
    generator = torch.Generator().manual_seed(70 + step)
    x = torch.randn(sum(SPLIT), 3, 32, 32, generator=generator, dtype=torch.float64) * 2 + 0.5
    return x, torch.randn(sum(SPLIT), 4, generator=generator, dtype=torch.float64)


def forward(model: nn.Module, x: torch.Tensor, mode: str) -> torch.Tensor:
    """The model's forward with its blocks checkpointed in ``mode`` (none, reentrant, non-reentrant, timm)."""
    from torch.utils.checkpoint import checkpoint_sequential

    if mode in ("none", "timm"):
        model.set_grad_checkpointing(mode == "timm")
        return model(x)
    x = model.bn1(model.conv_stem(x))
    x = checkpoint_sequential(model.blocks, 2, x, use_reentrant=mode == "reentrant")
    return model.forward_head(model.bn2(model.conv_head(x)))


def train(model: nn.Module, rows: slice, step_fn=None, mode: str = "none", device: str = "cpu") -> dict:
    """STEPS of SGD on the loss sum(out * g) over ``rows``; gradients summed over the ranks if any."""
    import torch.distributed as dist

    run = step_fn if step_fn is not None else (lambda x: forward(model, x, mode))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, g = (t[rows].to(device) for t in data(step))
        optimizer.zero_grad()
        (run(x) * g).sum().backward()
        if dist.is_initialized():
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
        optimizer.step()
    return {name: value.detach().cpu().clone() for name, value in model.state_dict().items()}


def reference() -> dict:
    """One process, plain BN, the whole batch, no checkpointing."""
    return train(graph_model(), slice(None))


def _rows(rank: int) -> slice:
    start = sum(SPLIT[:rank])
    return slice(start, start + SPLIT[rank])


def _count_gathers():
    """Count the sync layers' collectives, every path: the forward gather and the backward sum (a
    gather on CPU, an all_reduce on devices; the CUDA path's own pair in device_path.py). Counting
    the gathers alone saw half of the CUDA path's collectives (26 where there are 52)."""
    from bnsurgeon.runtime import device_path, sync_function

    calls = [0]

    def counted(module, name):
        original = getattr(module, name)

        def counting(*args, **kwargs):
            calls[0] += 1
            return original(*args, **kwargs)

        setattr(module, name, counting)

    for module, name in (
        (sync_function, "all_gather_rows"),
        (sync_function, "all_reduce_sum"),
        (device_path, "all_gather_into"),
        (device_path, "all_reduce_into"),
    ):
        counted(module, name)
    return calls


def checkpoint_rank(rank: int, world_size: int, modes: list[str], device: str = "cpu") -> dict:
    """Per checkpoint mode: the trained state, the sync collectives and the recomputes in STEPS steps."""
    import bnsurgeon
    from bnsurgeon.runtime import device_path, recompute

    calls = _count_gathers()
    take = recompute.StatsStash.take
    device_forward = device_path.forward
    results = {}
    for mode in modes:
        model = bnsurgeon.convert(graph_model(), "sync").model.to(device)
        recomputes = [0]

        def counted_take(stash, *args, unrecognised=mode.endswith("-unrecognised")):
            recomputes[0] += 1
            return None if unrecognised else take(stash, *args)  # None: the stash cannot serve it

        def counted_device_forward(*args):
            recomputes[0] += bool(args[-1])  # ``replay``: a device layer's recompute (it stashes nothing)
            return device_forward(*args)

        recompute.StatsStash.take = counted_take
        device_path.forward = counted_device_forward
        calls[0] = 0
        try:
            state = train(model, _rows(rank), mode=mode.replace("-unrecognised", ""), device=device)
        finally:
            recompute.StatsStash.take = take
            device_path.forward = device_forward
        results[mode] = {
            "state": state,
            "collectives": calls[0],
            "layers": bn_layers(model),
            "recomputes": recomputes[0],
        }
    return results


def compile_rank(rank: int, world_size: int, backend: str, device: str = "cpu") -> dict:
    """Graph breaks of the converted model under dynamo, then STEPS compiled (fullgraph) steps."""
    import bnsurgeon

    model = bnsurgeon.convert(graph_model(), "sync").model.to(device)
    x, _ = data(0)
    explanation = torch._dynamo.explain(model)(x[_rows(rank)].to(device))
    for module in model.modules():  # explain ran the forward: put the counters and running stats back
        if hasattr(module, "num_batches_tracked"):
            module.num_batches_tracked.zero_()
    model.load_state_dict(graph_model().state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    calls = _count_gathers()
    state = train(model, _rows(rank), step_fn=compiled, device=device)
    return {
        "collectives": calls[0],
        "layers": bn_layers(model),
        "breaks": explanation.graph_break_count,
        "graphs": explanation.graph_count,
        "reasons": [str(reason.reason) for reason in explanation.break_reasons],
        "state": state,
    }


def compile_checkpoint_rank(rank: int, world_size: int, backend: str) -> dict:
    """STEPS compiled steps of the model with timm's grad checkpointing on, collectives counted."""
    import bnsurgeon

    model = bnsurgeon.convert(graph_model(), "sync").model
    model.set_grad_checkpointing(True)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    calls = _count_gathers()
    state = train(model, _rows(rank), step_fn=compiled)
    return {
        "state": state,
        "collectives": calls[0],
        "layers": bn_layers(model),
        "checkpointed layers": sum(bn_layers(block) for block in model.blocks),
    }
