"""The commands as library calls: ``inspect``, ``convert_source`` (resolve, convert, check,
write) and ``verify`` (load both sides, run every check)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from . import __version__
from .architecture import LoadedSource
from .checkpoint import check_output_path, describe_checkpoint, read_checkpoint
from .checks import (
    CHECK_SEED,
    check_input,
    compare_eval,
    first_runnable_shape,
    infer_input_shape,
    is_inexact,
    preserved_modes,
    refuse_non_finite,
    require_same_architecture,
    run_forward,
)
from .errors import ConfirmationError, NothingToConvertError, UsageError, VerificationError
from .inspection import Inspection, inspect_model
from .recorded import read_recorded
from .sources import load_source, looks_like_file
from .surgery import ConvertResult, convert
from .writing import write_conversion

if TYPE_CHECKING:
    from torch import nn


def inspect(source: "str | nn.Module", **source_options: Any) -> Inspection:
    """Inspect a model object or a SOURCE string (timm names are built on the meta device)."""
    from torch import nn

    if isinstance(source, nn.Module):
        return inspect_model(source, source=type(source).__name__)
    if not looks_like_file(source):
        loaded = load_source(source, meta=True, **source_options)
        return inspect_model(loaded.model, source=loaded.description)

    raw = read_checkpoint(source, trust_pickle=source_options.get("trust_pickle", False), mmap=True)
    contents = describe_checkpoint(raw)
    try:
        loaded = load_source(source, meta=True, raw=raw, **source_options)
    except ConfirmationError as error:
        result = Inspection(source=str(source), parameters=0, checkpoint=contents)
        result.notes.append(f"{error.message}: {error.hint}")
        return result
    except UsageError as error:
        if source_options.get("model"):
            raise
        result = Inspection(source=str(source), parameters=0, checkpoint=contents)
        result.notes.append(f"{error.message}: pass --model ARCH to list its BatchNorm modules")
        return result
    result = inspect_model(loaded.model, source=loaded.description)
    result.checkpoint = contents
    if loaded.weights_key:
        result.notes.append(f"weights taken from '{loaded.weights_key}' (choose another with --weights)")
    return result


def verify_timeout_s() -> float:
    """The ranks' collective timeout: ``BNSURGEON_DIST_TIMEOUT`` if set (validated up front), else 120 s."""
    from .runtime.timeout import ENV_VAR, parse_timeout_s

    raw = os.environ.get(ENV_VAR)
    return parse_timeout_s(raw) if raw and raw.strip() else 120.0
def _check_shape(loaded: LoadedSource, input_shape: tuple[int, ...] | None) -> tuple[int, ...]:
    """The input for the eval check (and for finding producers under --to fused)."""
    shape = input_shape or loaded.input_shape or infer_input_shape(loaded.model)
    if shape is None:
        raise UsageError("cannot tell what input the model takes for the equivalence check",
                         "pass --input-shape N,C,H,W (or --no-check)")
    if input_shape is None:
        shape = first_runnable_shape(loaded.model, tuple(shape))
    return tuple(shape)


@dataclass
class ConvertOutcome:
    result: ConvertResult
    loaded: LoadedSource
    output: Path | None
    reports: tuple[Path, Path] | None


def convert_source(
    source: str,
    output: "str | Path | None",
    *,
    to: str = "sync",
    frozen: str = "keep",
    allow_unhandled: bool = False,
    model: str | None = None,
    model_args: dict[str, Any] | None = None,
    weights: str | None = None,
    trust_pickle: bool = False,
    accept_recorded_args: bool = False,
    force: bool = False,
    check: bool = True,
    input_shape: tuple[int, ...] | None = None,
    verify_world_sizes: tuple[int, ...] = (),
    progress: "Callable[[str], None] | None" = None,
    allow_no_bn: bool = False,
) -> ConvertOutcome:
    """The ``bnsurgeon convert`` pipeline. Writes nothing unless every step succeeded.

    ``progress`` is told the name of each phase as it starts (the CLI shows a spinner).
    A model with no BN-family module raises NothingToConvertError unless ``allow_no_bn``.
    A .pt/.pth/.pth.tar output carries a training checkpoint's other entries
    (``training_checkpoint.carry_entries``).
    """
    from .rules import check_target
    from .training_checkpoint import carry_entries

    phase = progress or (lambda text: None)

    check_target(to, frozen)
    if verify_world_sizes and not check:
        raise UsageError("--verify needs the eval check", "drop --no-check")
    timeout = verify_timeout_s() if verify_world_sizes else None
    out = check_output_path(output, [source], force=force) if output is not None else None
    phase(f"loading {source}")
    loaded = load_source(source, model=model, model_args=model_args, weights=weights,
                         trust_pickle=trust_pickle, accept_recorded_args=accept_recorded_args)
    fused = to == "fused"
    shape = _check_shape(loaded, input_shape) if check or fused else None
    phase(f"converting to {to}" + (f" (finding producers on {tuple(shape)})" if fused else ""))
    result = convert(loaded.model, to, frozen=frozen, allow_unhandled=allow_unhandled,
                     example_input=tuple(shape) if fused else None)
    result.report.source = loaded.description
    result.report.tool_version = __version__
    report = result.report
    if not (report.changed or report.kept or report.unhandled) and not allow_no_bn:
        raise NothingToConvertError(f"{loaded.description} has no BatchNorm-family module: there is nothing to convert")
    carried = carry_entries(loaded, result, out)
    result.report.carried = carried.summary
    if check:
        phase(f"checking eval outputs on {tuple(shape)}")
        if fused:
            from .fused_check import fused_check_result

            result.report.check = fused_check_result(loaded.model, result, tuple(shape), CHECK_SEED)
        else:
            result.report.check = compare_eval(loaded.model, result.model, tuple(shape), exact=result.exact)
        if not result.report.check.passed:
            raise VerificationError(
                f"converted model's eval outputs differ from the source's (max |diff| "
                f"{result.report.check.max_abs_diff:.3g}, {result.report.check.mode})"
            )
        if verify_world_sizes:
            from .verify import verify_models

            phase("verifying (train, 2 gloo ranks, perturbed)")
            if fused:
                from .fused_check import verify_fused

                verification = verify_fused(loaded.model, result.model, result.report.fusion["folded"], tuple(shape),
                                            source_name=loaded.description)
            else:
                verification = verify_models(loaded.model, result.model, tuple(shape), world_sizes=verify_world_sizes,
                                             exact=result.exact, source_name=loaded.description,
                                             collective_timeout=timeout)
            result.report.verification = verification.to_dict()
            if not verification.passed:
                failed = verification.first_failure
                raise VerificationError(
                    f"verification failed: {failed.name} (max |diff| {failed.max_abs_diff:.3g})"
                    + (f", first divergent module {failed.first_divergence}" if failed.first_divergence else "")
                )
    reports = None
    if out is not None:
        result.report.output = str(out)
        phase(f"writing {out}")
        reports = write_conversion(result, out, loaded.architecture, source=loaded.description, force=force,
                                   extras=carried.entries)
    return ConvertOutcome(result, loaded, out, reports)


def verify(source: str, converted: str, *, world_sizes: tuple[int, ...] = (2,), input_shape: tuple[int, ...] | None = None,
           atol: float | None = None, perturb: bool = True, model: str | None = None,
           model_args: dict[str, Any] | None = None, converted_model: str | None = None,
           converted_model_args: dict[str, Any] | None = None, trust_pickle: bool = False,
           accept_recorded_args: bool = False, on_check: "Callable[[Any], None] | None" = None):
    """``bnsurgeon verify``: prove CONVERTED behaves like SOURCE (eval, train, N ranks, frozen).

    Both arguments are loaded under the same trust rules, each confirmed only by what the
    user typed for it: ``model``/``model_args`` for SOURCE, ``converted_model``/
    ``converted_model_args`` for CONVERTED. ``on_check`` is told each check (a
    ``verify.CheckOutcome``) as it finishes.
    """
    import torch

    from .verify import verify_models

    timeout = verify_timeout_s()
    if any(w < 2 for w in world_sizes):
        raise UsageError(f"--world-size must be at least 2 (got {min(world_sizes)})", "use 2 or 3 on a CPU machine")
    left = load_source(source, model=model, model_args=model_args, trust_pickle=trust_pickle,
                       accept_recorded_args=accept_recorded_args)
    right = load_source(converted, model=converted_model, model_args=converted_model_args, trust_pickle=trust_pickle,
                        accept_recorded_args=accept_recorded_args, flag="--converted-model")
    refuse_non_finite(left.model, left.description)
    refuse_non_finite(right.model, right.description)
    recorded = read_recorded(right.checkpoint) if right.checkpoint is not None and right.checkpoint.is_bnsurgeon else None
    fused = recorded is not None and recorded.target == "fused"
    if not fused:  # a fused model lacks the folded BN modules by design
        require_same_architecture(left.model, right.model, left.description, right.description)
    shape = input_shape or left.input_shape or right.input_shape or infer_input_shape(left.model)
    if shape is None:
        raise UsageError("cannot tell what input the models take", "pass --input-shape N,C,... (e.g. 4,16,32)")
    if input_shape is None:
        shape = first_runnable_shape(left.model, tuple(shape))
    if fused:
        from .fused_check import verify_fused

        return verify_fused(left.model, right.model, recorded.folds, tuple(shape), atol=atol, perturb=perturb,
                            source_name=left.description, converted_name=right.description)
    x = check_input(tuple(shape))
    with preserved_modes(left.model, right.model), torch.no_grad():
        for loaded, what in ((left, "SOURCE"), (right, "CONVERTED")):
            parameter = next(iter(loaded.model.parameters()), None)
            dtype = parameter.dtype if parameter is not None and parameter.is_floating_point() else torch.float32
            run_forward(loaded.model.eval(), x.to(dtype), f"{what} ({loaded.description})")
    return verify_models(left.model, right.model, shape, world_sizes=world_sizes, atol=atol, perturb=perturb,
                         exact=not is_inexact(left.model, right.model), source_name=left.description,
                         converted_name=right.description, collective_timeout=timeout, on_check=on_check)
