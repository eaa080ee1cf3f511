"""The eval-equivalence check run before writing: which input, and are the outputs the same."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

from .errors import BnSurgeonError, ModelCannotRunError, NonFiniteWeightsError
from .outputs import flatten_tensors
from .report import CheckResult

if TYPE_CHECKING:
    import torch
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


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else "no message")[:200]


def check_input(shape: tuple[int, ...], seed: int = CHECK_SEED, *, dtype=None, device=None) -> "torch.Tensor":
    """The seeded check input, refused (not attempted) when it cannot fit in this machine's memory."""
    import math
    import os

    import torch

    dtype = dtype or torch.float32
    needed = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        physical = None
    if physical and needed > physical:
        raise ModelCannotRunError(
            f"the check input {tuple(shape)} needs {needed / 2**30:,.1f} GiB, more than this machine's "
            f"{physical / 2**30:,.1f} GiB of memory",
            "pass a smaller --input-shape (the batch and spatial size do not change which BN code runs)",
        )
    try:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        return x.to(device=device or "cpu", dtype=dtype)
    except (RuntimeError, MemoryError) as error:
        raise ModelCannotRunError(f"cannot allocate the check input {tuple(shape)}: {_first_line(error)}",
                                  "pass a smaller --input-shape") from None


def run_forward(model: "nn.Module", x: "torch.Tensor", what: str):
    """``model(x)``, with a model that raises on this input reported as such (exit 9), not as a crash."""
    try:
        return model(x)
    except BnSurgeonError:
        raise
    except Exception as error:
        raise ModelCannotRunError(
            f"{what} cannot run on the input {tuple(x.shape)}: {type(error).__name__}: {_first_line(error)}",
        ) from None


def non_finite_tensors(model: "nn.Module") -> list[str]:
    """Names of floating-point weights and buffers holding NaN or Inf."""
    import torch

    return [name for name, tensor in model.state_dict().items()
            if tensor.is_floating_point() and not tensor.is_meta and not bool(torch.isfinite(tensor).all())]


def refuse_non_finite(model: "nn.Module", origin: str) -> None:
    bad = non_finite_tensors(model)
    if bad:
        shown = ", ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")
        raise NonFiniteWeightsError(f"{origin} holds non-finite values (NaN or Inf) in {len(bad)} tensor(s): {shown}")


def require_finite(model: "nn.Module", outputs: list) -> None:
    """NaN compares unequal to itself: when a check fails on non-finite outputs, say why instead of 'outputs differ'."""
    import torch

    if all(bool(torch.isfinite(o).all()) for o in outputs if o.is_floating_point()):
        return
    refuse_non_finite(model, "the source model")
    raise ModelCannotRunError("the source model's outputs on the check input are not finite (NaN or Inf)",
                              "check the weights, or pass another --input-shape (or --no-check)")


def compare_eval(source: "nn.Module", converted: "nn.Module", input_shape: tuple[int, ...], *,
                 exact: bool = True, seed: int = CHECK_SEED) -> CheckResult:
    """Eval outputs of both models on one seeded input: bit for bit, or within fp tolerance."""
    import torch

    reference = next(iter(source.parameters()), None)
    if reference is None:
        reference = next(iter(source.buffers()), None)
    dtype = reference.dtype if reference is not None and reference.is_floating_point() else torch.float32
    device = reference.device if reference is not None else torch.device("cpu")
    x = check_input(input_shape, seed, dtype=dtype, device=device)
    with preserved_modes(source, converted), torch.no_grad():
        source.eval()
        converted.eval()
        expected = flatten_tensors(run_forward(source, x.clone(), "the source model"))
        actual = flatten_tensors(run_forward(converted, x.clone(), "the converted model"))
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
    if not passed:
        require_finite(source, expected)
    mode = "bit-identical" if exact else "close (rtol 1e-4; frozen x*scale+shift vs batch_norm arithmetic)"
    return CheckResult(passed, mode, diff, list(input_shape), seed)


def is_inexact(source: "nn.Module", converted: "nn.Module") -> bool:
    """True where a module converted from x*scale+shift frozen BN sits: eval is close, not bitwise."""
    from .rules import default_registry

    theirs = dict(converted.named_modules())
    for path, module in source.named_modules():
        rule = default_registry().lookup(type(module))
        if rule is not None and not rule.exact and path in theirs and type(theirs[path]) is not type(module):
            return True
    return False


def tensor_shapes(model: "nn.Module") -> dict[str, tuple[int, ...]]:
    """Every weight and buffer's shape (num_batches_tracked aside: frozen targets drop it)."""
    return {name: tuple(t.shape) for name, t in model.state_dict().items() if not name.endswith("num_batches_tracked")}


def require_same_architecture(source: "nn.Module", converted: "nn.Module", source_name: str, converted_name: str) -> None:
    """Surgery keeps every weight's name and shape: models that differ there were not converted from one another."""
    from .errors import WeightsMismatchError

    ours, theirs = tensor_shapes(source), tensor_shapes(converted)
    if ours == theirs:
        return
    missing = [k for k in ours if k not in theirs]
    unexpected = [k for k in theirs if k not in ours]
    mismatched = [k for k in ours if k in theirs and ours[k] != theirs[k]]
    parts = [f"{label} {len(items)} (e.g. {items[0]})" for label, items in
             (("only in SOURCE", missing), ("only in CONVERTED", unexpected), ("different shape", mismatched)) if items]
    raise WeightsMismatchError(
        f"{converted_name} is not a conversion of {source_name}: their weights differ ({'; '.join(parts)})",
        "pass the SOURCE that CONVERTED was made from (with the same --model-arg values)",
    )
