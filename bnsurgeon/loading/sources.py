"""A resolved SOURCE -> nn.Module: a timm name, ``pkg.module:factory``, a checkpoint file, a model directory.

What SOURCE is was decided once by ``resolve.py`` (the one door into this stage); building a named
architecture lives in ``architecture.py``, putting weights into it in ``weights.py``, rebuilding a bnsurgeon
checkpoint in ``rebuild.py``, a Hugging Face directory in ``transformers_source.py``; this module picks which
one the resolved kind needs.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

from bnsurgeon.core.errors import FLAG_KEYWORDS, CheckpointError, UsageError
from bnsurgeon.files.reading import (
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
from bnsurgeon.loading.resolve import (
    BNSURGEON,
    BNSURGEON_DIRECTORY,
    DIRECTORY_WEIGHTS,
    MODEL_DIRECTORY,
    NAME_KINDS,
    PICKLED_MODULE,
    TRANSFORMERS_DIRECTORY,
    ResolvedSource,
    bnsurgeon_weights,
    peek,
    resolve_source,
)
from bnsurgeon.loading.transformers_source import load_directory
from bnsurgeon.loading.trust import (
    TIMM_NAME_PATTERN,
    confirm_architecture,
    is_plain_literal,
    python_args_hint,
    size_arg_problem,
)

TRAINING_ARG_NAMES = ("num_classes", "in_chans", "global_pool")


def load_source(
    source: "ResolvedSource | str | os.PathLike",
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
    """The model a resolved SOURCE names, with its weights (or on the meta device when ``meta``).

    ``source`` is the value ``resolve.resolve_source`` gave (a string is resolved here, once).
    ``model``/``model_args`` are what the user typed for this SOURCE: they confirm what
    the file names (``trust.confirm_architecture``), and ``flag`` is how the user types
    them, for the messages. ``raw`` is the already-read file, when the caller has read it.
    ``named_elsewhere``: a model the user named for another argument of the same command
    (``trust.confirm_architecture``). The loaded source carries the value, its kind told by the file read.
    """
    resolved = resolve_source(source, model=model, check_name=False)
    loaded = _load(
        resolved, model, model_args, weights, trust_pickle, meta, accept_recorded_args, raw, flag, named_elsewhere
    )
    if loaded.source is not None and loaded.source.architecture is None:  # the one the file names
        loaded.source = loaded.source.naming(loaded.architecture.describe())
    return loaded


def _load(
    resolved: ResolvedSource,
    model,
    model_args,
    weights,
    trust_pickle,
    meta,
    accept_recorded_args,
    raw: RawCheckpoint | None,
    flag,
    named_elsewhere,
) -> LoadedSource:
    path = resolved.path
    if raw is None and resolved.kind == MODEL_DIRECTORY:
        written = bnsurgeon_weights(resolved)
        if written is not None:  # a directory bnsurgeon wrote: its weights file describes the converted model
            path = written
        elif not model:
            return _load_model_directory(resolved.as_transformers(), meta)
    elif resolved.kind == DIRECTORY_WEIGHTS:  # its own metadata wins: a bnsurgeon file is read as one
        told = peek(resolved, raw)
        if told.kind == TRANSFORMERS_DIRECTORY:
            return _load_model_directory(told, meta)
    if resolved.kind in NAME_KINDS:
        if model:
            raise UsageError(
                f"--model is only for checkpoint files; {resolved.text!r} already names the model",
                "drop --model, or pass a checkpoint file",
            )
        architecture = parse_architecture(resolved.text, model_args)
        built = architecture.build(meta=meta)
        return LoadedSource(built, architecture, architecture.describe(), own_input_shape(built), source=resolved)
    assert path is not None  # every kind but a name has one
    raw = raw or read_checkpoint(path, trust_pickle=trust_pickle, mmap=meta)
    return _load_file(
        resolved.read_as(raw), raw, model, model_args, weights, meta, accept_recorded_args, flag, named_elsewhere
    )


def _load_model_directory(resolved: ResolvedSource, meta: bool) -> LoadedSource:
    """A Hugging Face model directory: transformers' own class, from local files (loading.transformers_source)."""
    directory = resolved.directory
    assert directory is not None  # a model directory kind has one
    model, name, config = load_directory(directory, meta=meta)
    architecture = Architecture("transformers", name, {"config": config})
    return LoadedSource(
        model,
        architecture,
        f"{directory} ({architecture.describe()})",
        None if meta else own_input_shape(model),
        source=resolved,
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
    resolved: ResolvedSource,
    raw: RawCheckpoint,
    model,
    model_args,
    weights,
    meta,
    accept_recorded_args,
    flag,
    named_elsewhere: Architecture | None = None,
) -> LoadedSource:
    path = raw.path
    if resolved.kind == PICKLED_MODULE:
        module, wrapper = unwrap_data_parallel(raw.obj)
        return LoadedSource(
            module, Architecture("unknown", type(module).__name__), str(path) + wrapper, None, raw, source=resolved
        )
    if resolved.kind in (BNSURGEON, BNSURGEON_DIRECTORY):
        architecture = confirm_architecture(
            read_recorded(raw).architecture,
            path,
            model,
            model_args,
            accept_recorded_args=accept_recorded_args,
            flag=flag,
            named_elsewhere=named_elsewhere,
        )
        loaded = rebuild_from_checkpoint(raw, meta=meta, architecture=architecture, weights=weights)
        loaded.source = resolved
        return loaded

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
        source=resolved,
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
