"""Workers: the compiled path of one sync layer against the eager layer, case by case.

Under ``torch.compile`` a sync layer computes its local statistics, the normalization and
their gradients in traced ops (runtime/sync_op.py), where the eager layer runs its own
kernels. Each case here builds one layer, a copy of it compiled with ``fullgraph=True``,
and runs both on the same per-rank inputs for two steps: outputs, input gradients,
parameter gradients, running statistics and ``num_batches_tracked`` must agree. The eager
layer is itself checked against one process of plain BN on the whole batch
(test_sync_equivalence.py), so this closes the loop for every input kind.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

#: name -> (BN class, per-rank input shapes, dtype, memory format, layer kwargs, autocast dtype or None)
CASES = {
    "2d": (nn.BatchNorm2d, [(3, 4, 5, 5), (2, 4, 5, 5)], torch.float64, None, {}, None),
    "2d-channels-last": (nn.BatchNorm2d, [(3, 4, 5, 5), (2, 4, 5, 5)], torch.float64, torch.channels_last, {}, None),
    "1d-2d-input": (nn.BatchNorm1d, [(5, 6), (3, 6)], torch.float64, None, {}, None),
    "1d-3d-input": (nn.BatchNorm1d, [(2, 6, 7), (4, 6, 7)], torch.float64, None, {}, None),
    "3d": (nn.BatchNorm3d, [(2, 3, 2, 3, 4), (1, 3, 2, 3, 4)], torch.float64, None, {}, None),
    "no-affine": (nn.BatchNorm2d, [(3, 4, 5, 5), (2, 4, 5, 5)], torch.float64, None, {"affine": False}, None),
    "cumulative-momentum": (
        nn.BatchNorm2d,
        [(3, 4, 5, 5), (2, 4, 5, 5)],
        torch.float64,
        None,
        {"momentum": None},
        None,
    ),
    "no-running-stats": (
        nn.BatchNorm2d,
        [(3, 4, 5, 5), (2, 4, 5, 5)],
        torch.float64,
        None,
        {"track_running_stats": False},
        None,
    ),
    "empty-rank": (nn.BatchNorm2d, [(4, 4, 5, 5), (0, 4, 5, 5)], torch.float64, None, {}, None),
    "large-mean": (nn.BatchNorm2d, [(3, 4, 5, 5), (2, 4, 5, 5)], torch.float32, None, {"shift": 1e4}, None),
    "bf16-model": (nn.BatchNorm2d, [(3, 4, 5, 5), (2, 4, 5, 5)], torch.bfloat16, None, {}, None),
    "autocast-bf16": (nn.BatchNorm2d, [(3, 4, 5, 5), (2, 4, 5, 5)], torch.float32, None, {}, torch.bfloat16),
}

STEPS = 2


def _inputs(case: str, rank: int, step: int):
    _, shapes, dtype, memory_format, kwargs, _ = CASES[case]
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + len(case))
    shape = shapes[rank]
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * 3 + 1 + kwargs.get("shift", 0.0)
    g = torch.randn(shape, generator=generator, dtype=torch.float64)
    x, g = x.to(dtype), g.to(dtype)
    if memory_format is not None:
        x = x.contiguous(memory_format=memory_format)
    return x, g


def _layer(case: str) -> nn.Module:
    import bnsurgeon

    cls, shapes, dtype, _, kwargs, _ = CASES[case]
    torch.manual_seed(0)
    bn = cls(shapes[0][1], **{k: v for k, v in kwargs.items() if k != "shift"})
    if bn.affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return bnsurgeon.convert(nn.Sequential(bn), "sync").model.to(dtype).train()


def _run(layer: nn.Module, call, case: str, rank: int) -> list[dict]:
    autocast = CASES[case][5]
    results = []
    for step in range(STEPS):
        x, g = _inputs(case, rank, step)
        x.requires_grad_(True)
        layer.zero_grad()
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            y = call(x)
        (y.float() * g.float()).sum().backward()
        result = {"y": y.detach().clone(), "x.grad": x.grad.clone()}
        for name, parameter in layer.named_parameters():
            result[f"{name}.grad"] = parameter.grad.clone()
        for name, buffer in layer.named_buffers():
            result[name] = buffer.clone()
        results.append(result)
    return results


def compiled_vs_eager_rank(rank: int, world_size: int, cases: list[str], backend: str = "aot_eager") -> dict:
    """Per case: (eager results, compiled results, float64 results or None), on this rank's inputs.

    Below float64 the two paths round differently; the third run, the eager layer in float64
    on the same (exactly representable) inputs, is the truth both are measured against.
    """
    out = {}
    for case in cases:
        eager = _layer(case)
        compiled_layer = copy.deepcopy(eager)
        torch._dynamo.reset()
        # an empty batch runs the eager layer outside the graph (layers.py): a graph break
        compiled = torch.compile(compiled_layer, fullgraph=not case.startswith("empty"), backend=backend)
        results = (_run(eager, eager, case, rank), _run(compiled_layer, compiled, case, rank))
        truth = None
        if CASES[case][2] != torch.float64:
            exact = _layer(case).double()
            truth = _run(exact, lambda x: exact(x.double()), case, rank)
        out[case] = (*results, truth)
    return out


def dynamic_shapes_rank(rank: int, world_size: int, backend: str = "aot_eager") -> float:
    """Conv + sync BN compiled with ``dynamic=True`` against the eager layer over four batch and
    image sizes (ranks differ in batch size): the largest difference in outputs, input and
    weight gradients and running variance."""
    import bnsurgeon

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    eager = bnsurgeon.convert(model, "sync").model.double().train()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, dynamic=True, backend=backend)
    worst = 0.0
    for step, batch in enumerate([3 + rank, 5, 2 + 2 * rank, 7]):
        generator = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(batch, 3, 6 + step, 6 + step, generator=generator, dtype=torch.float64)
        results = []
        for layer, call in ((eager, eager), (compiled_model, compiled)):
            layer.zero_grad()
            inputs = x.clone().requires_grad_(True)
            y = call(inputs)
            (y * y.detach().sin()).sum().backward()
            results.append((y.detach(), inputs.grad, layer[0].weight.grad.clone(), layer[1].running_var.clone()))
        worst = max(worst, *((a - b).abs().max().item() for a, b in zip(*results)))
    return worst
