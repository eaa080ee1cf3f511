"""SOURCE string -> nn.Module: a timm name, ``pkg.module:factory``, or a checkpoint file.

Building a named architecture lives in ``architecture.py``, putting weights into it in
``weights.py``, and rebuilding a bnsurgeon checkpoint in ``rebuild.py``; this module
picks which one a SOURCE needs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

from bnsurgeon.core.errors import FLAG_KEYWORDS, CheckpointError, UsageError
from bnsurgeon.files.reading import (
    SAFETENSORS_SUFFIXES,
    TORCH_SUFFIXES,
    RawCheckpoint,
    entry_name,
    pick_weights,
    read_checkpoint,
    state_dict_candidates,
    strip_common_prefix,
    why_not_a_state_dict,
)
from bnsurgeon.files.weights import check_fit, materialize
from bnsurgeon.loading.architecture import Architecture, LoadedSource, own_input_shape, parse_architecture
from bnsurgeon.loading.rebuild import rebuild_from_checkpoint
from bnsurgeon.loading.recorded import MAX_NAME_CHARS, read_recorded
from bnsurgeon.loading.transformers_source import (
    bnsurgeon_weights_of,
    directory_inputs,
    is_bnsurgeon_file,
    load_directory,
    model_directory,
)
from bnsurgeon.loading.trust import (
    TIMM_NAME_PATTERN,
    confirm_architecture,
    is_plain_literal,
    python_args_hint,
    size_arg_problem,
)

TRAINING_ARG_NAMES = ("num_classes", "in_chans", "global_pool")


def looks_like_file(source: str) -> bool:
    path = Path(source)
    return path.exists() or path.is_symlink() or path.suffix in SAFETENSORS_SUFFIXES + TORCH_SUFFIXES or "/" in source


def source_inputs(source: "str | os.PathLike", label: str = "SOURCE") -> list[tuple[Path, str]]:
    """Every file reading SOURCE may open, each with its label for messages: the file itself, and for a file
    of a model directory (or the directory) every file of the model (config.json, weights, shards, index).
    An output may be none of them, ``--force`` or not."""
    path = Path(source)
    if not looks_like_file(str(source)):
        return []
    files = [] if path.is_dir() else [path]
    try:
        directory = model_directory(path)
    except OSError:  # a name the filesystem refuses: reading it fails with its own message
        directory = None
    if directory is not None:
        files += directory_inputs(directory)
    return [(file, f"a file {label} {path} reads") for file in dict.fromkeys(files)]


def load_source(
    source: str,
    *,
    model: str | None = None,
    model_args: dict[str, Any] | None = None,
    weights: str | None = None,
    trust_pickle: bool = False,
    meta: bool = False,
    accept_recorded_args: bool = False,
    raw: RawCheckpoint | None = None,
    flag: str = "--model",
    named_elsewhere: Architecture | None = None,
) -> LoadedSource:
    """Resolve SOURCE to a model with its weights (or on the meta device when ``meta``).

    ``model``/``model_args`` are what the user typed for this SOURCE: they confirm what
    the file names (``trust.confirm_architecture``), and ``flag`` is how the user types
    them, for the messages. ``raw`` is the already-read file, when the caller has read it.
    ``named_elsewhere``: a model the user named for another argument of the same command
    (``trust.confirm_architecture``).
    """
    written = bnsurgeon_weights_of(Path(source)) if raw is None else None
    if written is not None:  # a directory bnsurgeon wrote: its weights file describes the converted model
        source = str(written)
    else:
        directory = model_directory(Path(source)) if not model else None
        if directory is not None and not (raw.is_bnsurgeon if raw is not None else is_bnsurgeon_file(Path(source))):
            return _load_model_directory(directory, meta)
    if raw is not None or looks_like_file(source):
        raw = raw or read_checkpoint(Path(source), trust_pickle=trust_pickle, mmap=meta)
        return _load_file(raw, model, model_args, weights, meta, accept_recorded_args, flag, named_elsewhere)
    if model:
        raise UsageError(
            f"--model is only for checkpoint files; {source!r} already names the model",
            "drop --model, or pass a checkpoint file",
        )
    architecture = parse_architecture(source, model_args)
    built = architecture.build(meta=meta)
    return LoadedSource(built, architecture, architecture.describe(), own_input_shape(built))


def _load_model_directory(directory: Path, meta: bool) -> LoadedSource:
    """A Hugging Face model directory: transformers' own class, from local files (loading.transformers_source)."""
    model, name, config = load_directory(directory, meta=meta)
    architecture = Architecture("transformers", name, {"config": config})
    return LoadedSource(
        model, architecture, f"{directory} ({architecture.describe()})", None if meta else own_input_shape(model)
    )


def unwrap_data_parallel(model: "nn.Module") -> "tuple[nn.Module, str]":
    """The module an ``nn.DataParallel`` wraps, and a note saying so ('' for any other model).

    inspect and verify work on the wrapped module: its paths are the model's own (no ``module.``),
    and verify's ranks must not run DataParallel (replicas inside a multi-rank job are refused).
    """
    from torch import nn

    if isinstance(model, nn.DataParallel):
        return model.module, f" (the {type(model.module).__name__} its nn.DataParallel wraps)"
    return model, ""


def _load_file(
    raw: RawCheckpoint,
    model,
    model_args,
    weights,
    meta,
    accept_recorded_args,
    flag,
    named_elsewhere: Architecture | None = None,
) -> LoadedSource:
    from torch import nn

    path = raw.path
    if isinstance(raw.obj, nn.Module):
        module, wrapper = unwrap_data_parallel(raw.obj)
        return LoadedSource(module, Architecture("unknown", type(module).__name__), str(path) + wrapper, None, raw)
    if raw.is_bnsurgeon:
        architecture = confirm_architecture(
            read_recorded(raw).architecture,
            path,
            model,
            model_args,
            accept_recorded_args=accept_recorded_args,
            flag=flag,
            named_elsewhere=named_elsewhere,
        )
        return rebuild_from_checkpoint(raw, meta=meta, architecture=architecture, weights=weights)

    candidates = state_dict_candidates(raw.obj)
    if not candidates:
        reason = why_not_a_state_dict(raw.obj)
        if reason:  # tensors are there: "holds no model weights" would misstate the file
            raise CheckpointError(
                f"{path} holds no state dict bnsurgeon can use: {reason}",
                "save model.state_dict() alone (or under 'state_dict'), with its other entries beside it",
            )
        raise CheckpointError(
            f"{path} holds no model weights (no tensors, nor a state dict under "
            "state_dict/model/state_dict_ema/model_ema/ema)",
            "pass the file that holds the model's state dict",
        )
    key = pick_weights(path, candidates, weights)
    state = candidates[key]
    architecture = _architecture_for(path, raw, model, model_args, accept_recorded_args, flag)
    if meta:  # nothing allocated, but the file's tensors must fit what is listed (keys and shapes)
        built = architecture.build(meta=True)
        state, prefix = strip_common_prefix(state, set(built.state_dict()))
        check_fit(built, state, path)
    else:
        prefix_found: list[str] = []

        def build(on_meta: bool):
            return architecture.build(meta=on_meta)

        def fit(built_model, tensors):
            stripped, stripped_prefix = strip_common_prefix(tensors, set(built_model.state_dict()))
            prefix_found.append(stripped_prefix)
            return stripped

        built = materialize(build, state, path, adapt=fit)
        prefix = prefix_found[-1] if prefix_found else ""
    carried = _carried(raw, key)
    return LoadedSource(
        built,
        architecture,
        f"{path} ({architecture.describe()})",
        own_input_shape(built),
        raw,
        key or None,
        prefix,
        carried,
    )


def _carried(raw: RawCheckpoint, key: str) -> dict[str, Any]:
    """What the source checkpoint held besides the chosen weights (reported; not written)."""
    if not isinstance(raw.obj, dict) or key == "":
        return {}
    return {entry_name(name): type(value).__name__ for name, value in raw.obj.items() if name != key}


def _architecture_for(path, raw: RawCheckpoint, model, model_args, accept_recorded_args, flag) -> Architecture:
    """The user's --model, else a timm training checkpoint's ``arch`` (a timm name: data, never code)."""
    if model:
        return parse_architecture(model, model_args)
    obj = raw.obj if isinstance(raw.obj, dict) else {}
    arch = obj.get("arch")
    if isinstance(arch, str):
        if len(arch) > MAX_NAME_CHARS:  # quoted in every message about it, and matched against timm's registry
            raise CheckpointError(
                f"{path} names an architecture of {len(arch):,} characters (at most "
                f"{MAX_NAME_CHARS}), which is not a timm model name",
                "pass --model ARCH",
            )
        if not TIMM_NAME_PATTERN.match(arch):
            raise CheckpointError(
                f"{path} names the architecture {arch!r}, which is not a timm model name", "pass --model ARCH"
            )
        args = obj.get("args")
        recorded = {}
        for name in TRAINING_ARG_NAMES:
            value = getattr(args, name, None) if args is not None else None
            if value is not None:
                if not is_plain_literal(value):
                    raise CheckpointError(
                        f"{path}: args.{name} is a {type(value).__name__}, not a plain value",
                        f"pass {flag}-arg {name}=VALUE and {flag} {arch}",
                        python=_typed_args_hint(name, arch, flag),
                    )
                problem = size_arg_problem(name, value)
                if problem:  # it would shape the model: refused before anything is built
                    raise CheckpointError(
                        f"{path}: args.{name} {problem}",
                        f"pass {flag} {arch} and {flag}-arg {name}=VALUE",
                        python=_typed_args_hint(name, arch, flag),
                    )
                recorded[name] = value
        return confirm_architecture(
            Architecture("timm", arch, recorded),
            path,
            None,
            model_args,
            accept_recorded_args=accept_recorded_args,
            flag=flag,
        )
    raise UsageError(
        f"{path} does not say which model it belongs to", "pass --model ARCH (a timm name or package.module:function)"
    )


def _typed_args_hint(name: str, arch: str, flag: str) -> str:
    """The Python form of ``--model-arg NAME=VALUE and --model ARCH``."""
    keyword = FLAG_KEYWORDS.get(flag, "model=")
    return python_args_hint({name: "VALUE"}, flag, f" and {keyword}{arch!r}")
