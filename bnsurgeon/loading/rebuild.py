"""Rebuild the model a bnsurgeon checkpoint records: architecture, the same surgery, strict weights."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from bnsurgeon.core.errors import CheckpointError, MetadataError
from bnsurgeon.core.layout import shown
from bnsurgeon.files.history import replay
from bnsurgeon.files.model_directory import WEIGHTS_FILE
from bnsurgeon.files.reading import RawCheckpoint, read_checkpoint
from bnsurgeon.files.weights import check_fit, load_weights, materialize
from bnsurgeon.loading.architecture import Architecture, LoadedSource, own_input_shape
from bnsurgeon.loading.recorded import Recorded, apply_trainability, check_rebuilt, read_recorded, state_from_checkpoint
from bnsurgeon.loading.resolve import ResolvedSource, bnsurgeon_weights, resolve_source
from bnsurgeon.loading.transformers_source import CONFIG_NAME, read_config
from bnsurgeon.loading.trust import confirm_architecture
from bnsurgeon.surgery.walk import name_sync_layers

if TYPE_CHECKING:
    from torch import nn


def rebuild_from_checkpoint(
    raw: RawCheckpoint,
    *,
    meta: bool = False,
    architecture: Architecture | None = None,
    model: "nn.Module | None" = None,
    weights: str | None = None,
) -> LoadedSource:
    """Build the recorded architecture, replay the recorded conversions, load the weights strictly.

    ``architecture`` is what the caller confirmed (``trust.confirm_architecture``); without
    it the recorded one is used only where the trust rules allow it with no confirmation.
    A file converted with ``--rules`` is rebuilt only once the user has named them again.
    ``weights`` picks another state dict of a training checkpoint (its EMA).
    """
    recorded = read_recorded(raw)
    check_directory_config(raw, recorded)
    if model is None and architecture is None:
        architecture = confirm_architecture(recorded.architecture, raw.path)
    architecture = architecture or recorded.architecture
    history, target = recorded.history, recorded.target

    def build(on_meta: bool):
        base = model if model is not None else architecture.build(meta=on_meta)
        return replay(
            base, history, recorded.classes, folds=recorded.folds if target == "fused" else None, origin=str(raw.path)
        )

    if meta:  # nothing allocated, but the file's tensors must fit what is listed (keys and shapes)
        rebuilt = build(True)
        check_fit(rebuilt, state_from_checkpoint(raw, recorded, weights), raw.path)
    elif model is not None:
        rebuilt = build(False)
        load_weights(rebuilt, state_from_checkpoint(raw, recorded, weights), raw.path)
    else:
        rebuilt = materialize(build, state_from_checkpoint(raw, recorded, weights), raw.path)
    check_rebuilt(raw, recorded, rebuilt)
    apply_trainability(raw, recorded, rebuilt)
    name_sync_layers(rebuilt)
    loaded = LoadedSource(
        rebuilt, architecture, f"{raw.path} ({architecture.describe()}, {target})", own_input_shape(rebuilt), raw
    )
    loaded.history = history
    loaded.check_input = recorded.check_input
    # the entry the model came from: the chosen one, or one the file records other than its state_dict
    loaded.weights_key = weights or (recorded.weights if recorded.weights != "state_dict" else None)
    return loaded


def check_directory_config(raw: RawCheckpoint, recorded: Recorded) -> None:
    """A directory bnsurgeon wrote (-o DIR) holds its config twice: config.json for from_pretrained, and the
    recorded one that bnsurgeon rebuilds from. An edit to config.json would be used by one and not the other."""
    beside = Path(raw.path).parent / CONFIG_NAME
    if recorded.architecture.kind != "transformers" or Path(raw.path).name != WEIGHTS_FILE or not beside.is_file():
        return
    config, ours = read_config(beside.parent), recorded.architecture.kwargs.get("config") or {}
    if config != ours:
        field = next((key for key in sorted(set(config) | set(ours), key=str) if config.get(key) != ours.get(key)), "?")
        raise MetadataError(
            f"{beside} differs from the config bnsurgeon recorded in {raw.path.name} (first at {shown(field, 80)}): "
            "from_pretrained would build one model and bnsurgeon another",
            "restore config.json; to change labels or settings, change model.config after bnsurgeon.load and "
            "save_pretrained, then convert that directory",
        )


def load(
    path: "str | Path | ResolvedSource",
    *,
    model: "str | nn.Module | None" = None,
    model_args: dict[str, Any] | None = None,
    accept_recorded_args: bool = False,
    mmap: bool = False,
) -> "nn.Module":
    """Rebuild a converted model from a bnsurgeon checkpoint, ready to wrap in DDP.

    ``model`` overrides the recorded architecture: an ``nn.Module`` of the original
    architecture (converted in place), or a SOURCE-style name; naming exactly the recorded
    factory is what confirms it. ``model_args`` confirm (or override) recorded constructor
    arguments. The returned model owns its memory: rewriting the file afterwards changes
    nothing. ``mmap=True`` keeps the tensors as views of the file instead (no copy, for huge
    read-only uses; the file must then not change while the model lives).
    """
    from torch import nn

    resolved = resolve_source(path, check_name=False)
    written = bnsurgeon_weights(resolved)  # a model directory bnsurgeon wrote (-o DIR)
    if written is None and resolved.names_directory:  # the directory or its config.json, not a weights file in it
        raise CheckpointError(
            f"{resolved.text} is a Hugging Face model directory that bnsurgeon did not convert",
            f"convert it first: bnsurgeon convert {resolved.text} -o OUT_DIR",
        )
    path = written or resolved.text
    raw = read_checkpoint(path, mmap=mmap)
    if not raw.is_bnsurgeon:
        raise CheckpointError(
            f"{path} is not a bnsurgeon checkpoint (no bnsurgeon metadata)",
            "convert it first: bnsurgeon convert SOURCE -o OUT",
        )
    if isinstance(model, nn.Module):
        rebuilt = rebuild_from_checkpoint(raw, model=model).model
    else:
        recorded = read_recorded(raw)
        architecture = confirm_architecture(
            recorded.architecture, raw.path, model, model_args, accept_recorded_args=accept_recorded_args
        )
        rebuilt = rebuild_from_checkpoint(raw, architecture=architecture).model
    return rebuilt


#: architectures another process can build again from their record alone
REPEATABLE_KINDS = ("timm", "factory", "transformers")


def recipe(
    architecture: Architecture, history: list[dict[str, Any]], classes: dict[str, str] | None = None
) -> "Callable[[], nn.Module] | None":
    """A picklable callable that builds this model's structure again in another process (verify's ranks),
    or None where the architecture is not recorded. Its tensors are the caller's to send: the build is seeded,
    not the model's weights."""
    if architecture.kind not in REPEATABLE_KINDS:
        return None
    return functools.partial(build_from_recipe, architecture.to_dict(), list(history), dict(classes or {}))


def build_from_recipe(
    architecture: dict[str, Any], history: list[dict[str, Any]], classes: dict[str, str]
) -> "nn.Module":
    """What ``recipe`` sends: the architecture built, then every recorded conversion replayed."""
    model = Architecture.from_dict(architecture).build()
    if history:
        model = replay(model, history, classes, origin="the model's recipe")
    name_sync_layers(model)
    return model
