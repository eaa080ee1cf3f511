"""The eval-equivalence check run before writing: which input, and are the outputs the same."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

from .outputs import flatten_tensors
from .report import CheckResult

if TYPE_CHECKING:
    from torch import nn

    from .check_input import CheckInput

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
    """A plausible input tensor shape, sized for the first conv/linear the forward reaches."""
    from .check_input import infer_check_input

    found = infer_check_input(model, batch)
    return found.shape if found is not None else None


def resolve_check_input(model: "nn.Module", *, input_shape: "tuple[int, ...] | None" = None,
                        example_input: "CheckInput | None" = None, recorded: "CheckInput | None" = None,
                        own_shape: "tuple[int, ...] | None" = None) -> "CheckInput | None":
    """The input the checks use, first found: --input-shape, --example-input, what the
    checkpoint recorded, the model's own (timm), else inferred from the first conv reached.

    Only a shape that bnsurgeon chose itself is shrunk to a smaller spatial size.
    """
    from .check_input import CheckInput, infer_check_input

    if input_shape is not None and example_input is not None:
        from .errors import UsageError

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
    if inferred is not None and inferred.kind == "tensor":
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


def compare_eval(source: "nn.Module", converted: "nn.Module", input_shape: "tuple[int, ...] | CheckInput", *,
                 exact: bool = True, seed: int = CHECK_SEED) -> CheckResult:
    """Eval outputs of both models on one seeded input: bit for bit, or within fp tolerance."""
    import torch

    from .check_input import CheckInput, clone_value

    check_input = CheckInput.of_shape(input_shape)

    reference = next(iter(source.parameters()), None)
    if reference is None:
        reference = next(iter(source.buffers()), None)
    dtype = reference.dtype if reference is not None and reference.is_floating_point() else torch.float32
    device = reference.device if reference is not None else torch.device("cpu")
    x = check_input.make(seed=seed, dtype=dtype, device=device)
    with preserved_modes(source, converted), torch.no_grad():
        source.eval()
        converted.eval()
        try:
            expected = flatten_tensors(source(clone_value(x)))
        except Exception as error:  # the model does not take this input
            from .errors import UsageError

            raise UsageError(f"the source model fails on the check input {check_input.describe()} "
                             f"({type(error).__name__}: {str(error).strip().splitlines()[0][:160] if str(error).strip() else ''})",
                             "pass the input it takes: --input-shape N,C,H,W or --example-input x.pt") from None
        actual = flatten_tensors(converted(clone_value(x)))
    diff = 0.0
    passed = len(expected) == len(actual) and len(expected) > 0
    for a, b in zip(expected, actual):
        if a.shape != b.shape:
            passed = False
            continue
        diff = max(diff, (a.float() - b.float()).abs().max().item() if a.numel() else 0.0)
        if exact:  # NaN where NaN: the same (the check is then marked inconclusive below)
            same = torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                          and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))
            passed = passed and same
        else:
            scale = a.float().abs().max().item() if a.numel() else 1.0
            passed = passed and torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5 * max(scale, 1.0))
    mode = "bit-identical" if exact else "close (rtol 1e-4; frozen x*scale+shift vs batch_norm arithmetic)"
    vacuous = vacuous_reason(expected)  # the check then proves little: said, not hidden (verify fails on it)
    note = f"inconclusive: {vacuous}; run bnsurgeon verify (--example-input, --compare-at)" if vacuous else ""
    shape = list(check_input.shape) if check_input.shape is not None else []
    return CheckResult(passed, mode, diff, shape, seed, note, check_input.describe())


def vacuous_reason(outputs: list) -> str | None:
    """Why a comparison of these outputs proves nothing: no values at all, or non-finite ones."""
    if not outputs or all(t.numel() == 0 for t in outputs):
        return "the outputs are empty (e.g. a detector returned 0 boxes)"
    bad = [t for t in outputs if t.is_floating_point() and t.numel() and not bool(t.isfinite().all())]
    if bad:
        return f"{len(bad)} of {len(outputs)} output tensors hold NaN/inf"
    return None


def _inexact(source: "nn.Module", converted: "nn.Module") -> bool:
    """True where a module converted from x*scale+shift frozen BN sits: eval is close, not bitwise."""
    from .rules import default_registry

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
    from .rules.builders import _PLAIN_BN, is_frozen_origin
    from .surgery import plan

    for entry in plan(model):
        origin = getattr(entry.module, "bnsurgeon_origin", None) or entry.cls_name
        if origin not in _PLAIN_BN and not is_frozen_origin(origin) and "Act" not in origin.rsplit(".", 1)[-1]:
            return True
    return False


def observed_input_dims(model: "nn.Module", check_input: "CheckInput") -> dict[str, int]:
    """path -> rank of the input each BN-family module receives on the check input (eval, no grad)."""
    import torch

    from .surgery import is_bn_like

    dims: dict[str, int] = {}

    def record(path):
        def hook(module, args):  # returns None: a pre-hook's return value would replace the input
            if args and isinstance(args[0], torch.Tensor):
                dims.setdefault(path, args[0].dim())
        return hook

    handles = [module.register_forward_pre_hook(record(path))
               for path, module in model.named_modules() if is_bn_like(module)]
    reference = next(iter(model.parameters()), None)
    dtype = reference.dtype if reference is not None and reference.is_floating_point() else torch.float32
    try:
        with preserved_modes(model), torch.no_grad():
            model.eval()(check_input.make(dtype=dtype))
    finally:
        for handle in handles:
            handle.remove()
    return dims
