"""The commands as library calls: ``inspect``, ``convert_source`` (resolve, convert, check,
write) and ``verify`` (load both sides, run every check)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from . import __version__
from .architecture import LoadedSource
from .checkpoint import check_output_path, describe_checkpoint, read_checkpoint
from .checks import CHECK_SEED, _inexact, compare_eval, first_runnable_shape, infer_input_shape
from .errors import UsageError, VerificationError
from .inspection import Inspection, inspect_model
from .sources import load_source, looks_like_file
from .surgery import ConvertResult, convert
from .writing import save, write_reports

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

    raw = read_checkpoint(source, trust_pickle=source_options.get("trust_pickle", False))
    contents = describe_checkpoint(raw)
    try:
        loaded = load_source(source, meta=True, raw=raw, **source_options)
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
    force: bool = False,
    check: bool = True,
    input_shape: tuple[int, ...] | None = None,
    verify_world_sizes: tuple[int, ...] = (),
    progress: "Callable[[str], None] | None" = None,
) -> ConvertOutcome:
    """The ``bnsurgeon convert`` pipeline. Writes nothing unless every step succeeded.

    ``progress`` is told the name of each phase as it starts (the CLI shows a spinner).
    """
    from .rules import check_target

    phase = progress or (lambda text: None)

    check_target(to, frozen)
    if verify_world_sizes and not check:
        raise UsageError("--verify needs the eval check", "drop --no-check")
    out = check_output_path(output, [source], force=force) if output is not None else None
    trust_factory = model is not None
    phase(f"loading {source}")
    loaded = load_source(source, model=model, model_args=model_args, weights=weights,
                         trust_pickle=trust_pickle, trust_factory=trust_factory)
    fused = to == "fused"
    shape = _check_shape(loaded, input_shape) if check or fused else None
    phase(f"converting to {to}" + (f" (finding producers on {tuple(shape)})" if fused else ""))
    result = convert(loaded.model, to, frozen=frozen, allow_unhandled=allow_unhandled,
                     example_input=tuple(shape) if fused else None)
    result.report.source = loaded.description
    result.report.tool_version = __version__
    result.report.carried = {k: f"{v} (not written)" for k, v in loaded.carried.items()}
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
                                             exact=result.exact, source_name=loaded.description)
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
        save(result, out, loaded.architecture, source=loaded.description)
        reports = write_reports(result, out)
    return ConvertOutcome(result, loaded, out, reports)


def verify(source: str, converted: str, *, world_sizes: tuple[int, ...] = (2,), input_shape: tuple[int, ...] | None = None,
           atol: float | None = None, perturb: bool = True, model: str | None = None,
           model_args: dict[str, Any] | None = None, trust_pickle: bool = False):
    """``bnsurgeon verify``: prove CONVERTED behaves like SOURCE (eval, train, N ranks, frozen)."""
    from .verify import verify_models

    named_factory = ":" in source and not source.startswith("timm:") and not Path(source).exists()
    left = load_source(source, model=model, model_args=model_args, trust_pickle=trust_pickle,
                       trust_factory=model is not None or named_factory)
    right = load_source(converted, trust_pickle=trust_pickle, trust_factory=named_factory or model is not None)
    shape = input_shape or left.input_shape or right.input_shape or infer_input_shape(left.model)
    if shape is None:
        raise UsageError("cannot tell what input the models take", "pass --input-shape N,C,... (e.g. 4,16,32)")
    if input_shape is None:
        shape = first_runnable_shape(left.model, tuple(shape))
    if right.checkpoint is not None and right.checkpoint.bnsurgeon("target") == "fused":
        from .fused_check import verify_fused

        return verify_fused(left.model, right.model, right.checkpoint.bnsurgeon("folds", []), shape, atol=atol,
                            perturb=perturb, source_name=left.description, converted_name=right.description)
    if any(w < 2 for w in world_sizes):
        raise UsageError(f"--world-size must be at least 2 (got {min(world_sizes)})", "use 2 or 3 on a CPU machine")
    return verify_models(left.model, right.model, shape, world_sizes=world_sizes, atol=atol, perturb=perturb,
                         exact=not _inexact(left.model, right.model), source_name=left.description,
                         converted_name=right.description)
