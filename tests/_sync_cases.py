"""Cases for the sync-vs-plain equivalence tests, run inside spawned gloo ranks.

Each case: a batch X (and an upstream gradient G) split across ranks. Rank r runs
bnsurgeon's sync layer on its slice; the reference runs plain BN on all of X. Two
steps (forward + backward each) so momentum and momentum=None are exercised.
"""

from __future__ import annotations

import torch
from torch import nn

STEPS = 2


def make_plain(case: dict) -> nn.Module:
    """The reference module, with non-trivial parameters and running statistics."""
    channels = case["shape"][1]
    kwargs = dict(
        momentum=case.get("momentum", 0.1), affine=case.get("affine", True), track_running_stats=case.get("trs", True)
    )
    if case.get("act"):
        from timm.layers import BatchNormAct2d

        module = BatchNormAct2d(channels, act_layer=case["act"], inplace=case.get("inplace", True), **kwargs)
    else:
        cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(case["shape"])]
        module = cls(channels, **kwargs)
    generator = torch.Generator().manual_seed(123)
    with torch.no_grad():
        if module.affine:
            module.weight.copy_(torch.rand(channels, generator=generator) + 0.5)
            module.bias.copy_(torch.rand(channels, generator=generator) - 0.5)
        if module.running_mean is not None:
            module.running_mean.copy_(torch.randn(channels, generator=generator))
            module.running_var.copy_(torch.rand(channels, generator=generator) + 0.5)
    return module


def batch(case: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(case["shape"], generator=generator) * case.get("scale", 2.0) + case.get("offset", 0.5)
    g = torch.randn(case["shape"], generator=generator)
    if case.get("round_to"):  # the float32 reference sees the low-precision model's input values
        x = x.to(getattr(torch, case["round_to"])).float()
    return x, g


def _layout(x: torch.Tensor, case: dict) -> torch.Tensor:
    if case.get("memory") == "channels_last":
        return x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    return x


def _dtype(case: dict) -> torch.dtype:
    return getattr(torch, case.get("dtype", "float32"))


def _run(module: nn.Module, case: dict, rows: slice) -> dict:
    device = torch.device(case.get("device", "cpu"))
    module = module.to(device)
    if case.get("model_dtype"):  # the whole model cast, weights and running stats included
        module = module.to(getattr(torch, case["model_dtype"]))
    out: dict = {"y": [], "dx": [], "layout_kept": True}
    for step in range(STEPS):
        x, g = batch(case, step)
        g = g.to(device)
        x = _layout(x[rows].to(device=device, dtype=_dtype(case)), case).requires_grad_()
        with torch.autocast(
            device.type, dtype=getattr(torch, case.get("autocast", "bfloat16")), enabled="autocast" in case
        ):
            y = module(x)
        if case.get("memory") == "channels_last" and x.numel():
            out["layout_kept"] &= y.is_contiguous(memory_format=_memory_format(x))
        (y.float() * g[rows]).sum().backward()
        if case.get("memory") == "channels_last" and x.numel():
            out["layout_kept"] &= x.grad.is_contiguous(memory_format=_memory_format(x))
        out["y"].append(y.detach().float().cpu())
        out["dx"].append(x.grad.float().cpu())
    out["weight_grad"] = None if module.weight is None else module.weight.grad.float().cpu()
    out["bias_grad"] = None if module.bias is None else module.bias.grad.float().cpu()
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        value = getattr(module, name, None)
        out[name] = None if value is None else (value.float() if value.is_floating_point() else value).cpu().clone()
    return out


def _memory_format(x: torch.Tensor):
    return torch.channels_last if x.dim() == 4 else torch.channels_last_3d


def reference(case: dict) -> dict:
    """Plain BN on the whole batch; for a low-precision model, in float32 on the same rounded values."""
    if case.get("model_dtype"):
        low = getattr(torch, case["model_dtype"])
        rounded = make_plain(case).to(low).float()
        return _run(rounded, dict(case, model_dtype=None, dtype="float32", round_to=case["model_dtype"]), slice(None))
    plain_case = {k: v for k, v in case.items() if k != "autocast"}  # the reference is plain BN without autocast
    return _run(make_plain(case), plain_case, slice(None))


def sync_rank(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Worker: every case on this rank's slice with bnsurgeon's sync layer."""
    from bnsurgeon import convert

    results = []
    for case in cases:
        splits = case["splits"][world_size]
        start = sum(splits[:rank])
        model = convert(nn.Sequential(make_plain(case)), "sync").model
        results.append(_run(model[0], case, slice(start, start + splits[rank])))
    return results


def subgroup_rank(rank: int, world_size: int, case: dict) -> dict:
    """Worker: ranks {0,1} and {2,3} each sync within their pair only."""
    import torch.distributed as dist

    from bnsurgeon import convert

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = rank // 2
    model = convert(nn.Sequential(make_plain(case)), "sync", process_group=groups[pair]).model
    pair_case = pair_variant(case, pair)
    splits = case["splits"][2]
    start = sum(splits[: rank % 2])
    return _run(model[0], pair_case, slice(start, start + splits[rank % 2]))


def pair_variant(case: dict, pair: int) -> dict:
    """Different data per pair, so statistics leaking across pairs would show."""
    return dict(case, offset=case.get("offset", 0.5) + 3.0 * pair, scale=case.get("scale", 2.0) * (1 + pair))
