"""The eval-equivalence check run before writing: which input, and are the outputs the same."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

from .outputs import flatten_tensors
from .report import CheckResult

if TYPE_CHECKING:
    from torch import nn

CHECK_SEED = 0


@contextmanager
def preserved_modes(*models: "nn.Module"):
    """Restore every module's training flag afterwards (source and result share modules)."""
    saved = [(module, module.training) for model in models for module in model.modules()]
    try:
        yield
    finally:
        for module, training in saved:
            module.training = training


def infer_input_shape(model: "nn.Module", batch: int = 2) -> tuple[int, ...] | None:
    """A plausible input from the first layer with weights (timm models give their own)."""
    from torch import nn

    spatial = {nn.Conv1d: (64,), nn.Conv2d: (64, 64), nn.Conv3d: (16, 16, 16)}
    for module in model.modules():
        for cls, dims in spatial.items():
            if type(module) is cls:
                return (batch, module.in_channels, *dims)
        if type(module) is nn.Linear:
            return (batch, module.in_features)
    return None


CHECK_SIDE = 64


def check_shapes(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Inputs to try for an equivalence check: a small spatial size first, the model's own last.

    The spatial size does not change which BN code runs, and 64x64 is ~6x cheaper than
    224x224; models that need a fixed input size fail on it and get their own.
    """
    if len(shape) >= 3 and any(side > CHECK_SIDE for side in shape[2:]):
        return [(*shape[:2], *(min(side, CHECK_SIDE) for side in shape[2:])), tuple(shape)]
    return [tuple(shape)]


def first_runnable_shape(model: "nn.Module", shape: tuple[int, ...]) -> tuple[int, ...]:
    """The first of ``check_shapes(shape)`` the model accepts in eval mode."""
    import torch

    candidates = check_shapes(shape)
    for candidate in candidates[:-1]:
        try:
            with preserved_modes(model), torch.no_grad():
                model.eval()(torch.zeros(candidate, dtype=next(model.parameters()).dtype))
            return candidate
        except Exception:  # the model needs its own input size
            continue
    return candidates[-1]


def compare_eval(source: "nn.Module", converted: "nn.Module", input_shape: tuple[int, ...], *,
                 exact: bool = True, seed: int = CHECK_SEED) -> CheckResult:
    """Eval outputs of both models on one seeded input: bit for bit, or within fp tolerance."""
    import torch

    reference = next(iter(source.parameters()), None)
    if reference is None:
        reference = next(iter(source.buffers()), None)
    dtype = reference.dtype if reference is not None and reference.is_floating_point() else torch.float32
    device = reference.device if reference is not None else torch.device("cpu")
    x = torch.randn(input_shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)
    with preserved_modes(source, converted), torch.no_grad():
        source.eval()
        converted.eval()
        expected = flatten_tensors(source(x.clone()))
        actual = flatten_tensors(converted(x.clone()))
    diff = 0.0
    passed = len(expected) == len(actual) and len(expected) > 0
    for a, b in zip(expected, actual):
        if a.shape != b.shape:
            passed = False
            continue
        diff = max(diff, (a.float() - b.float()).abs().max().item() if a.numel() else 0.0)
        if exact:
            passed = passed and torch.equal(a, b)
        else:
            scale = a.float().abs().max().item() if a.numel() else 1.0
            passed = passed and torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5 * max(scale, 1.0))
    mode = "bit-identical" if exact else "close (rtol 1e-4; frozen x*scale+shift vs batch_norm arithmetic)"
    return CheckResult(passed, mode, diff, list(input_shape), seed)


def _inexact(source: "nn.Module", converted: "nn.Module") -> bool:
    """True where a module converted from x*scale+shift frozen BN sits: eval is close, not bitwise."""
    from .rules import default_registry

    theirs = dict(converted.named_modules())
    for path, module in source.named_modules():
        rule = default_registry().lookup(type(module))
        if rule is not None and not rule.exact and path in theirs and type(theirs[path]) is not type(module):
            return True
    return False
