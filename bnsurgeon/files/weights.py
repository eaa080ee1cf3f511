"""Put a checkpoint's tensors into a model: strictly, and without a second copy where possible."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bnsurgeon.core.errors import WeightsMismatchError
from bnsurgeon.core.layout import counted

if TYPE_CHECKING:
    import torch
    from torch import nn


def materialize(build, state: dict[str, "torch.Tensor"], origin: Any, adapt=None) -> "nn.Module":
    """The model with the checkpoint's tensors, built on the meta device and assigned.

    No random initialization and no second copy of the weights: the checkpoint's own
    tensors (memory-mapped where the format allows) become the model's. Models that
    compute at init or keep non-persistent buffers cannot be built on meta; they fall
    back to a normal build followed by a copying load.
    """

    try:
        model = build(True)
    except Exception:  # e.g. .tolist()/numpy at init: not buildable on meta
        model = None
    if model is not None:
        tensors = adapt(model, state) if adapt else state
        expected = model.state_dict()
        check_fit(model, tensors, origin, expected)
        refuse_lossy_casts(tensors, expected, origin)
        tensors = {k: v.to(expected[k].dtype) if v.dtype != expected[k].dtype else v for k, v in tensors.items()}
        shared = shared_names(model)
        model.load_state_dict(tensors, strict=True, assign=True)
        retie(model, shared)
        leftovers = [t for t in (*model.parameters(), *model.buffers()) if t.is_meta]
        if not leftovers:
            return model
    model = build(False)
    load_weights(model, adapt(model, state) if adapt else state, origin)
    return model


def shared_names(model: "nn.Module") -> list[list[str]]:
    """Groups of state-dict names that are one tensor in ``model`` (tied weights, a shared module)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def retie(model: "nn.Module", groups: list[list[str]]) -> None:
    """Make each group one tensor again: ``load_state_dict(assign=True)`` wraps every name in its own Parameter."""
    for first, *others in groups:
        owner, _, attribute = first.rpartition(".")
        tensor = getattr(model.get_submodule(owner), attribute)
        for name in others:
            owner, _, attribute = name.rpartition(".")
            module = model.get_submodule(owner)
            if attribute in module._parameters:
                module._parameters[attribute] = tensor
            else:
                module._buffers[attribute] = tensor


def check_fit(
    model: "nn.Module", state: dict[str, "torch.Tensor"], origin: Any = "checkpoint", expected: dict | None = None
) -> None:
    """Raise WeightsMismatchError listing missing, unexpected and shape-mismatched keys."""
    expected = expected if expected is not None else model.state_dict()
    refuse_non_dense(state, origin)
    refuse_packed({k: v for k, v in state.items() if k in expected}, origin)  # unexpected ones are listed below
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [
        f"{k} {tuple(state[k].shape)} vs {tuple(expected[k].shape)}"
        for k in expected
        if k in state and tuple(state[k].shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or mismatched:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)):
            if items:
                shown = ", ".join(items[:4]) + (f" (+{len(items) - 4} more)" if len(items) > 4 else "")
                parts.append(f"{label} {len(items)}: {shown}")
        raise WeightsMismatchError(
            f"weights in {origin} do not fit the architecture: " + "; ".join(parts),
            "check --model and --model-arg (e.g. num_classes=...), or --weights to pick another state dict",
        )


def refuse_non_dense(state: dict[str, "torch.Tensor"], origin: Any) -> None:
    """A sparse, quantized or nested tensor is not a dense weight: named here, before a forward fails on it."""
    import torch

    odd = [
        f"{key} ({str(value.layout)[6:] if value.layout != torch.strided else 'quantized' if value.is_quantized else 'nested'})"
        for key, value in state.items()
        if value.layout != torch.strided or value.is_quantized or value.is_nested
    ]
    if odd:
        shown = ", ".join(odd[:3]) + (f" (+{len(odd) - 3} more)" if len(odd) > 3 else "")
        raise WeightsMismatchError(
            f"weights in {origin} are not dense tensors: {counted(len(odd), 'tensor')}, {shown}",
            "save the state dict with dense tensors (tensor.to_dense(), or dequantize())",
        )


#: torch dtypes that pack several values into one element: no model weight is one, and torch casts none of them
PACKED_DTYPES = {
    "float4_e2m1fn_x2": "two 4-bit floats",
    "bits1x8": "eight bits",
    "bits2x4": "four 2-bit values",
    "bits4x2": "two 4-bit values",
}


def refuse_packed(state: dict[str, "torch.Tensor"], origin: Any) -> None:
    """A packed tensor (safetensors F4) has half the values' shape and no cast: named, not called a shape mismatch."""
    odd = [
        f"{key} ({str(value.dtype)[6:]}, {PACKED_DTYPES[str(value.dtype)[6:]]} per element)"
        for key, value in state.items()
        if str(value.dtype)[6:] in PACKED_DTYPES
    ]
    if odd:
        shown = ", ".join(odd[:3]) + (f" (+{len(odd) - 3} more)" if len(odd) > 3 else "")
        raise WeightsMismatchError(
            f"weights in {origin} are stored packed, which torch cannot cast to the model's dtypes: "
            f"{counted(len(odd), 'tensor')}, {shown}",
            "unpack them to the model's dtype (e.g. float32) and save the checkpoint again",
        )


def refuse_lossy_casts(state: dict[str, "torch.Tensor"], expected: dict[str, "torch.Tensor"], origin: Any) -> None:
    """Loading casts each tensor to the model's dtype: allowed where every value survives the cast
    (float16 -> float32, small ints -> float), refused where it would change the model silently
    (complex -> real drops the imaginary part, float64 -> float32 rounds, floats -> int truncate)."""
    import torch

    changed = []
    for key, value in state.items():
        want = expected[key].dtype
        if value.dtype == want or value.is_meta:
            continue
        if value.is_complex() and not expected[key].is_complex():
            changed.append(f"{key} ({str(value.dtype)[6:]} -> {str(want)[6:]})")
            continue
        try:
            with torch.no_grad():
                back = value.to(want).to(value.dtype)
        except (RuntimeError, NotImplementedError, TypeError):  # bits8, uint3, ...: torch has no cast for it
            changed.append(f"{key} ({str(value.dtype)[6:]} -> {str(want)[6:]}: torch cannot cast it)")
            continue
        same = torch.equal(back, value) or (
            value.is_floating_point()
            and torch.equal(back.isnan(), value.isnan())
            and torch.equal(back.nan_to_num(0.0), value.nan_to_num(0.0))
        )
        if not same:
            changed.append(f"{key} ({str(value.dtype)[6:]} -> {str(want)[6:]})")
    if changed:
        shown = ", ".join(changed[:3]) + (f" (+{len(changed) - 3} more)" if len(changed) > 3 else "")
        raise WeightsMismatchError(
            f"weights in {origin} would change when cast to the model's dtypes: {counted(len(changed), 'tensor')}, {shown}",
            "save the checkpoint in the model's dtypes (e.g. state_dict converted with .float()), "
            "or build the model in the checkpoint's dtype",
        )


def load_weights(model: "nn.Module", state: dict[str, "torch.Tensor"], origin: Any = "checkpoint") -> None:
    """Strict copying load with a clear error when the weights do not fit."""
    check_fit(model, state, origin)
    refuse_lossy_casts(state, model.state_dict(), origin)
    model.load_state_dict(state, strict=True)


def has_non_finite(tensor: "torch.Tensor") -> bool:
    """NaN or Inf anywhere in a floating-point tensor (meta tensors hold no values).

    A sum is non-finite whenever an element is (IEEE: NaN and Inf propagate, Inf - Inf is NaN),
    so one reduction without a mask allocation decides the common all-finite case; only a
    non-finite sum (possibly a finite overflow) is checked element by element.
    """
    import torch

    if not tensor.is_floating_point() or tensor.is_meta or tensor.numel() == 0:
        return False
    if bool(torch.isfinite(tensor.sum())):
        return False
    return not bool(torch.isfinite(tensor).all())
