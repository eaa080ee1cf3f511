"""The Python API the CLI is a thin layer over: convert, check, save, load.

``bnsurgeon.convert(module)`` is the surgery itself; ``convert_source`` is the whole
``bnsurgeon convert`` pipeline (resolve SOURCE, convert, check, write).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from . import __version__
from .checkpoint import (
    RawCheckpoint,
    atomic_write,
    check_output_path,
    describe_checkpoint,
    read_checkpoint,
    write_checkpoint,
)
from .errors import CheckpointError, UsageError, VerificationError
from .fields import qualname
from .inspection import Inspection, inspect_model
from .outputs import flatten_tensors
from .report import CheckResult
from .sources import (
    Architecture,
    LoadedSource,
    architecture_from_checkpoint,
    load_source,
    load_weights,
    materialize,
    looks_like_file,
    parse_architecture,
    state_from_checkpoint,
)
from .surgery import ConvertResult, convert, name_sync_layers, plan

if TYPE_CHECKING:
    from torch import nn

CHECK_SEED = 0


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


def class_map(model: "nn.Module") -> dict[str, str]:
    """path -> class of every BN-family module (recorded so load can prove it rebuilt the same)."""
    return {path: qualname(type(entry.module)) for entry in plan(model) for path in entry.paths}


def save(result: ConvertResult, path: "str | Path", architecture: Architecture, *, source: str = "",
         extras: dict[str, Any] | None = None) -> Path:
    """Write the converted model with self-describing metadata (atomic)."""
    path = Path(path)
    metadata = {
        "schema": 1,
        "version": __version__,
        "architecture": architecture.to_dict(),
        "target": result.report.target,
        "options": {k: v for k, v in result.report.options.items() if k != "inplace"},
        "classes": class_map(result.model),
        "source": source,
    }
    write_checkpoint(path, result.model, metadata, extras)
    return path


def write_reports(result: ConvertResult, output: Path) -> tuple[Path, Path]:
    json_path = output.with_name(output.name + ".report.json")
    md_path = output.with_name(output.name + ".report.md")
    atomic_write(json_path, lambda temp: temp.write_text(result.report.to_json() + "\n"))
    atomic_write(md_path, lambda temp: temp.write_text(result.report.to_markdown()))
    return json_path, md_path


def rebuild_from_checkpoint(raw: RawCheckpoint, *, meta: bool = False, trust_factory: bool = False,
                            model: "nn.Module | None" = None) -> LoadedSource:
    """Build the recorded architecture, redo the recorded surgery, load the weights strictly."""
    architecture = architecture_from_checkpoint(raw)
    if model is None:
        if architecture.kind == "factory" and not trust_factory:
            raise UsageError(
                f"{raw.path} was made from the factory {architecture.name!r}; importing it runs code",
                f"confirm with --model {architecture.name} (or bnsurgeon.load(path, model={architecture.name!r}))",
            )
    options = raw.bnsurgeon("options", {}) or {}
    target = raw.bnsurgeon("target", "sync")

    def build(on_meta: bool):
        base = model if model is not None else architecture.build(meta=on_meta)
        return convert(base, target, frozen=options.get("frozen", "keep"),
                       allow_unhandled=bool(options.get("allow_unhandled", False)), inplace=True).model

    if meta:
        rebuilt = build(True)
    elif model is not None:
        rebuilt = build(False)
        load_weights(rebuilt, state_from_checkpoint(raw), raw.path)
    else:
        rebuilt = materialize(build, state_from_checkpoint(raw), raw.path)
    recorded = raw.bnsurgeon("classes", {}) or {}
    actual = class_map(rebuilt)
    differing = [p for p in recorded if actual.get(p) != recorded[p]]
    if differing:
        path = differing[0]
        raise CheckpointError(
            f"{raw.path}: rebuilding gave {actual.get(path)} at {path!r} where the checkpoint recorded "
            f"{recorded[path]} ({len(differing)} module(s) differ)",
            "use the bnsurgeon/timm versions that wrote the file, or pass the model explicitly",
        )
    name_sync_layers(rebuilt)
    from .sources import timm_input_shape

    return LoadedSource(rebuilt, architecture, f"{raw.path} ({architecture.describe()}, {target})",
                        timm_input_shape(rebuilt), raw)


def load(path: "str | Path", *, model: "str | nn.Module | None" = None, trust_factory: bool = False) -> "nn.Module":
    """Rebuild a converted model from a bnsurgeon checkpoint, ready to wrap in DDP.

    ``model`` overrides the recorded architecture: an ``nn.Module`` of the original
    architecture (converted in place), or a SOURCE-style name, which also confirms a
    recorded factory.
    """
    from torch import nn

    raw = read_checkpoint(path)
    if not raw.is_bnsurgeon:
        raise CheckpointError(f"{path} is not a bnsurgeon checkpoint (no bnsurgeon metadata)",
                              "convert it first: bnsurgeon convert SOURCE -o OUT")
    if isinstance(model, nn.Module):
        return rebuild_from_checkpoint(raw, model=model).model
    if isinstance(model, str):
        architecture = parse_architecture(model, architecture_from_checkpoint(raw).kwargs)
        return rebuild_from_checkpoint(raw, model=architecture.build()).model
    return rebuild_from_checkpoint(raw, trust_factory=trust_factory).model


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
    phase(f"converting to {to}")
    result = convert(loaded.model, to, frozen=frozen, allow_unhandled=allow_unhandled)
    result.report.source = loaded.description
    result.report.tool_version = __version__
    result.report.carried = {k: f"{v} (not written)" for k, v in loaded.carried.items()}
    if check:
        shape = input_shape or loaded.input_shape or infer_input_shape(loaded.model)
        if shape is None:
            raise UsageError("cannot tell what input the model takes for the equivalence check",
                             "pass --input-shape N,C,H,W (or --no-check)")
        if input_shape is None:
            shape = first_runnable_shape(loaded.model, tuple(shape))
        phase(f"checking eval outputs on {tuple(shape)}")
        result.report.check = compare_eval(loaded.model, result.model, tuple(shape), exact=result.exact)
        if not result.report.check.passed:
            raise VerificationError(
                f"converted model's eval outputs differ from the source's (max |diff| "
                f"{result.report.check.max_abs_diff:.3g}, {result.report.check.mode})"
            )
        if verify_world_sizes:
            from .verify import verify_models

            phase("verifying (train, 2 gloo ranks, perturbed)")
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


def _inexact(source: "nn.Module", converted: "nn.Module") -> bool:
    """True where a module converted from x*scale+shift frozen BN sits: eval is close, not bitwise."""
    from .rules import default_registry

    theirs = dict(converted.named_modules())
    for path, module in source.named_modules():
        rule = default_registry().lookup(type(module))
        if rule is not None and not rule.exact and path in theirs and type(theirs[path]) is not type(module):
            return True
    return False


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
    if any(w < 2 for w in world_sizes):
        raise UsageError(f"--world-size must be at least 2 (got {min(world_sizes)})", "use 2 or 3 on a CPU machine")
    return verify_models(left.model, right.model, shape, world_sizes=world_sizes, atol=atol, perturb=perturb,
                         exact=not _inexact(left.model, right.model), source_name=left.description,
                         converted_name=right.description)
