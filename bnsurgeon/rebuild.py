"""Rebuild the model a bnsurgeon checkpoint records: architecture, the same surgery, strict weights."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .architecture import LoadedSource, parse_architecture, timm_input_shape
from .checkpoint import RawCheckpoint, read_checkpoint
from .errors import CheckpointError, UsageError
from .recorded import architecture_from_checkpoint, class_map, state_from_checkpoint
from .surgery import convert, name_sync_layers
from .weights import load_weights, materialize

if TYPE_CHECKING:
    from torch import nn


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
                       allow_unhandled=bool(options.get("allow_unhandled", False)), inplace=True,
                       folds=raw.bnsurgeon("folds", []) if target == "fused" else None).model

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
