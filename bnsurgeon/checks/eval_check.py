"""The eval-equivalence check run before writing: which input, and are the outputs the same."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bnsurgeon.checks.outputs import flatten_tensors
from bnsurgeon.core.errors import ModelCannotRunError, NonFiniteWeightsError
from bnsurgeon.core.layout import counted
from bnsurgeon.core.running import preserved_modes, run_forward
from bnsurgeon.files.weights import has_non_finite
from bnsurgeon.surgery.report import CheckResult

if TYPE_CHECKING:
    import torch
    from torch import nn

    from bnsurgeon.checks.check_input import CheckInput

CHECK_SEED = 0


def infer_input_shape(model: "nn.Module", batch: int = 2) -> tuple[int, ...] | None:
    """A plausible input tensor shape, sized for the first conv/linear the forward reaches."""
    from bnsurgeon.checks.check_input import infer_check_input

    found = infer_check_input(model, batch)
    return found.shape if found is not None else None


def resolve_check_input(
    model: "nn.Module",
    *,
    input_shape: "tuple[int, ...] | None" = None,
    example_input: "CheckInput | None" = None,
    recorded: "CheckInput | None" = None,
    own_shape: "tuple[int, ...] | None" = None,
) -> "CheckInput | None":
    """The input the checks use, first found: --input-shape, --example-input, what the
    checkpoint recorded, the model's own (timm), else inferred from the first conv reached.

    Only a shape that bnsurgeon chose itself is shrunk to a smaller spatial size.
    """
    from bnsurgeon.checks.check_input import CheckInput, infer_check_input

    if input_shape is not None and example_input is not None:
        from bnsurgeon.core.errors import UsageError

        raise UsageError("--input-shape and --example-input both say what the input is", "pass one of them")
    if input_shape is not None:
        return CheckInput.of_shape(tuple(input_shape))
    if example_input is not None:
        return example_input
    if recorded is not None:
        return recorded
    if own_shape is not None:
        return CheckInput.of_shape(first_runnable_shape(model, tuple(own_shape)))
    inferred = infer_check_input(model)
    if inferred is not None and inferred.kind == "tensor" and inferred.shape is not None:
        return CheckInput.of_shape(first_runnable_shape(model, inferred.shape))
    return inferred


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


def non_finite_tensors(model: "nn.Module") -> list[str]:
    """Names of floating-point weights and buffers holding NaN or Inf."""
    return [name for name, tensor in model.state_dict().items() if has_non_finite(tensor)]


def refuse_non_finite(model: "nn.Module", origin: str) -> None:
    bad = non_finite_tensors(model)
    if bad:
        shown = ", ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")
        raise NonFiniteWeightsError(
            f"{origin} holds non-finite values (NaN or Inf) in {counted(len(bad), 'tensor')}: {shown}"
        )


#: no training sees more batches; a count near 2^63 overflows at the next step (and 1/count is momentum=None's factor)
MAX_BATCHES_TRACKED = 1 << 53


def refuse_invalid_weights(model: "nn.Module", origin: str) -> None:
    """Before converting: NaN/Inf in a parameter or a BN statistic, or a negative running variance.

    An Inf variance zeroes its channel and a negative one makes NaN, so the eval check can
    pass (or be merely inconclusive) on a model ``verify`` then refuses: named here, nothing written.
    (Other buffers, such as attention masks, may hold -inf by design.)
    """
    from torch.nn.parameter import is_lazy

    from bnsurgeon.core.anatomy import is_bn_like

    named = {name: tensor for name, tensor in model.named_parameters() if not is_lazy(tensor)}
    negative, counters = [], []
    for path, module in model.named_modules():
        if is_bn_like(module):
            counter = module._buffers.get("num_batches_tracked")
            if (
                counter is not None
                and not counter.is_meta
                and counter.numel() == 1
                and not counter.is_floating_point()
                and not 0 <= int(counter) <= MAX_BATCHES_TRACKED
            ):  # 1/count (momentum=None) or an overflow
                counters.append(
                    f"{path}.num_batches_tracked={int(counter)}" if path else f"num_batches_tracked={int(counter)}"
                )
            for name in ("running_mean", "running_var"):
                tensor = module._buffers.get(name)
                if tensor is not None and not is_lazy(tensor):  # an uninitialized lazy BN is refused later, by name
                    named[f"{path}.{name}" if path else name] = tensor
                    if (
                        name == "running_var"
                        and tensor.is_floating_point()
                        and not tensor.is_meta
                        and bool((tensor < 0).any())
                    ):
                        negative.append(f"{path}.{name}" if path else name)
    bad = [name for name, tensor in named.items() if has_non_finite(tensor)]
    if bad:
        shown = ", ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")
        raise NonFiniteWeightsError(
            f"{origin} holds non-finite values (NaN or Inf) in {counted(len(bad), 'tensor')}: {shown}"
        )
    if counters:
        shown = ", ".join(counters[:3]) + (f" (+{len(counters) - 3} more)" if len(counters) > 3 else "")
        raise NonFiniteWeightsError(
            f"{origin} holds an impossible batch count in {counted(len(counters), 'BatchNorm module')}: "
            f"{shown} (a count of batches is from 0 to 2^53; the file is damaged)",
            "nothing was written; use an intact checkpoint",
        )
    if negative:
        shown = ", ".join(negative[:3]) + (f" (+{len(negative) - 3} more)" if len(negative) > 3 else "")
        raise NonFiniteWeightsError(
            f"{origin} holds negative running variances in "
            f"{counted(len(negative), 'BatchNorm module')}: {shown} (a variance is never negative; the file is damaged)",
            "nothing was written; use an intact checkpoint",
        )


def require_finite(model: "nn.Module", outputs: list) -> None:
    """NaN compares unequal to itself: when a check fails on non-finite outputs, say why instead of 'outputs differ'."""
    import torch

    if all(bool(torch.isfinite(o).all()) for o in outputs if o.is_floating_point()):
        return
    refuse_non_finite(model, "the source model")
    raise ModelCannotRunError(
        "the source model's outputs on the check input are not finite (NaN or Inf)",
        "check the weights, or pass another --input-shape (or --no-check)",
    )


def compare_eval(
    source: "nn.Module",
    converted: "nn.Module",
    input_shape: "tuple[int, ...] | CheckInput",
    *,
    exact: bool = True,
    seed: int = CHECK_SEED,
) -> CheckResult:
    """Eval outputs of both models on one seeded input: bit for bit, or within fp tolerance."""
    import torch

    from bnsurgeon.checks.check_input import CheckInput, clone_value

    check_input = CheckInput.of_shape(input_shape)

    reference: torch.Tensor | None = next(iter(source.parameters()), None)
    if reference is None:
        reference = next(iter(source.buffers()), None)
    dtype = reference.dtype if reference is not None and reference.is_floating_point() else torch.float32
    device = reference.device if reference is not None else torch.device("cpu")
    x = check_input.make(seed=seed, dtype=dtype, device=device)
    with preserved_modes(source, converted), torch.no_grad():
        source.eval()
        converted.eval()
        expected = flatten_tensors(run_forward(source, clone_value(x), "the source model", check_input.describe()))
        actual = flatten_tensors(run_forward(converted, clone_value(x), "the converted model", check_input.describe()))
    diff = 0.0
    passed = len(expected) == len(actual) and len(expected) > 0
    for a, b in zip(expected, actual, strict=False):  # lengths may differ: then passed is False already
        if a.shape != b.shape:
            passed = False
            continue
        diff = max(diff, (a.float() - b.float()).abs().max().item() if a.numel() else 0.0)
        if exact:  # NaN where NaN: the same (the check is then marked inconclusive below)
            same = torch.equal(a, b) or (
                a.is_floating_point()
                and torch.equal(a.isnan(), b.isnan())
                and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
            )
            passed = passed and same
        else:
            scale = a.float().abs().max().item() if a.numel() else 1.0
            passed = passed and torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5 * max(scale, 1.0))
    vacuous = vacuous_reason(expected)  # the check then proves little: said, not hidden (verify fails on it)
    if not passed or vacuous:
        refuse_non_finite(source, "the source model")  # non-finite weights are named (exit 4), not "inconclusive"
    if not passed:
        require_finite(source, expected)
    mode = "bit-identical" if exact else "close (rtol 1e-4; frozen x*scale+shift vs batch_norm arithmetic)"
    note = f"inconclusive: {vacuous}; run bnsurgeon verify (--example-input, --compare-at)" if vacuous else ""
    shape = list(check_input.shape) if check_input.shape is not None else []
    return CheckResult(passed, mode, diff, shape, seed, note, check_input.describe())


def vacuous_reason(outputs: list) -> str | None:
    """Why a comparison of these outputs proves nothing: no values at all, or non-finite ones."""
    if not outputs or all(t.numel() == 0 for t in outputs):
        return "the outputs are empty (e.g. a detector returned 0 boxes)"
    bad = [t for t in outputs if t.is_floating_point() and t.numel() and not bool(t.isfinite().all())]
    if bad:
        return f"{len(bad)} of {counted(len(outputs), 'output tensor')} {'holds' if len(bad) == 1 else 'hold'} NaN/inf"
    return None


def is_inexact(source: "nn.Module", converted: "nn.Module") -> bool:
    """True where a module converted from x*scale+shift frozen BN sits: eval is close, not bitwise."""
    from bnsurgeon.rules import default_registry

    registry = default_registry()
    theirs = dict(converted.named_modules())
    for path, module in source.named_modules():
        if path not in theirs or type(theirs[path]) is type(module):
            continue
        for side in (module, theirs[path]):  # from or into x*scale+shift frozen BN
            rule = registry.lookup(type(side))
            if rule is not None and not rule.exact:
                return True
    return False


def needs_input_dims(model: "nn.Module") -> bool:
    """Does ``--to plain`` need input ranks: a BN whose class says no dimensionality (_BatchNormXd, SyncBN)?"""
    from bnsurgeon.rules.builders import PLAIN_BN, is_frozen_origin
    from bnsurgeon.surgery.walk import plan

    for entry in plan(model):
        origin = getattr(entry.module, "bnsurgeon_origin", None) or entry.cls_name
        if origin not in PLAIN_BN and not is_frozen_origin(origin) and "Act" not in origin.rsplit(".", 1)[-1]:
            return True
    return False


def observed_input_dims(model: "nn.Module", check_input: "CheckInput") -> dict[str, int]:
    """path -> rank of the input each BN-family module receives on the check input (eval, no grad)."""
    import torch

    from bnsurgeon.core.anatomy import is_bn_like

    dims: dict[str, int] = {}

    def record(path):
        def hook(module, args):  # returns None: a pre-hook's return value would replace the input
            if args and isinstance(args[0], torch.Tensor):
                dims.setdefault(path, args[0].dim())

        return hook

    handles = [
        module.register_forward_pre_hook(record(path)) for path, module in model.named_modules() if is_bn_like(module)
    ]
    reference = next(iter(model.parameters()), None)
    dtype = reference.dtype if reference is not None and reference.is_floating_point() else torch.float32
    try:
        with preserved_modes(model), torch.no_grad():
            model.eval()(check_input.make(dtype=dtype))
    finally:
        for handle in handles:
            handle.remove()
    return dims


def tensor_shapes(model: "nn.Module") -> dict[str, tuple[int, ...]]:
    """Every weight and buffer's shape (num_batches_tracked aside: frozen targets drop it)."""
    return {name: tuple(t.shape) for name, t in model.state_dict().items() if not name.endswith("num_batches_tracked")}


def require_same_architecture(
    source: "nn.Module", converted: "nn.Module", source_name: str, converted_name: str
) -> None:
    """Surgery keeps every weight's name and shape: models that differ there were not converted from one another."""
    from bnsurgeon.core.errors import WeightsMismatchError

    ours, theirs = tensor_shapes(source), tensor_shapes(converted)
    if ours == theirs:
        return
    missing = [k for k in ours if k not in theirs]
    unexpected = [k for k in theirs if k not in ours]
    mismatched = [k for k in ours if k in theirs and ours[k] != theirs[k]]
    parts = [
        f"{label} {len(items)} (e.g. {items[0]})"
        for label, items in (
            ("only in SOURCE", missing),
            ("only in CONVERTED", unexpected),
            ("different shape", mismatched),
        )
        if items
    ]
    raise WeightsMismatchError(
        f"{converted_name} is not a conversion of {source_name}: their weights differ ({'; '.join(parts)})",
        "pass the SOURCE that CONVERTED was made from (with the same --model-arg values)",
    )
