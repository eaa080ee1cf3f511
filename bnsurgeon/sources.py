"""SOURCE string -> nn.Module: a timm name, ``pkg.module:factory``, or a checkpoint file.

Building a named architecture lives in ``architecture.py``, putting weights into it in
``weights.py``, and rebuilding a bnsurgeon checkpoint in ``rebuild.py``; this module
picks which one a SOURCE needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .architecture import (  # noqa: F401  (re-exported: their historical home)
    SEED,
    Architecture,
    LoadedSource,
    parse_architecture,
    parse_model_args,
    timm_input_shape,
)
from .checkpoint import (
    SAFETENSORS_SUFFIXES,
    TORCH_SUFFIXES,
    RawCheckpoint,
    read_checkpoint,
    state_dict_candidates,
    strip_common_prefix,
)
from .errors import CheckpointError, UsageError
from .rebuild import rebuild_from_checkpoint
from .recorded import architecture_from_checkpoint, state_from_checkpoint  # noqa: F401
from .weights import check_fit, load_weights, materialize  # noqa: F401

TRAINING_ARG_NAMES = ("num_classes", "in_chans", "global_pool")


def looks_like_file(source: str) -> bool:
    path = Path(source)
    return path.exists() or path.suffix in SAFETENSORS_SUFFIXES + TORCH_SUFFIXES or "/" in source


def load_source(
    source: str,
    *,
    model: str | None = None,
    model_args: dict[str, Any] | None = None,
    weights: str | None = None,
    trust_pickle: bool = False,
    meta: bool = False,
    trust_factory: bool = False,
    raw: RawCheckpoint | None = None,
) -> LoadedSource:
    """Resolve SOURCE to a model with its weights (or on the meta device when ``meta``).

    ``raw`` is the already-read file, when the caller has read it (read once, not twice).
    """
    if raw is not None or looks_like_file(source):
        raw = raw or read_checkpoint(Path(source), trust_pickle=trust_pickle)
        return _load_file(raw, model, model_args, weights, meta, trust_factory)
    if model:
        raise UsageError(f"--model is only for checkpoint files; {source!r} already names the model",
                         "drop --model, or pass a checkpoint file")
    architecture = parse_architecture(source, model_args)
    built = architecture.build(meta=meta)
    return LoadedSource(built, architecture, architecture.describe(), timm_input_shape(built))


def _load_file(raw: RawCheckpoint, model, model_args, weights, meta, trust_factory) -> LoadedSource:
    from torch import nn

    path = raw.path
    if isinstance(raw.obj, nn.Module):
        module = raw.obj
        return LoadedSource(module, Architecture("unknown", type(module).__name__), str(path), None, raw)
    if raw.is_bnsurgeon:
        override = None
        if model:
            recorded = architecture_from_checkpoint(raw)
            override = parse_architecture(model, model_args or recorded.kwargs).build(meta=meta)
        return rebuild_from_checkpoint(raw, meta=meta, trust_factory=trust_factory, model=override)

    candidates = state_dict_candidates(raw.obj)
    if not candidates:
        raise CheckpointError(f"{path} holds no model weights (no tensors, nor a state dict under "
                              "state_dict/model/state_dict_ema/model_ema/ema)",
                              "pass the file that holds the model's state dict")
    key = _pick_weights(path, candidates, weights)
    state = candidates[key]
    architecture = _architecture_for(path, raw, model, model_args, state)
    if meta:
        built = architecture.build(meta=True)
        state, prefix = strip_common_prefix(state, set(built.state_dict()))
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
    return LoadedSource(built, architecture, f"{path} ({architecture.describe()})", timm_input_shape(built), raw,
                        key or None, prefix, carried)


def _pick_weights(path: Path, candidates: dict[str, dict], weights: str | None) -> str:
    if weights is not None:
        if weights not in candidates:
            raise UsageError(f"{path} has no weights named {weights!r}",
                             f"choose one of: {', '.join(repr(k or '<top level>') for k in candidates)}")
        return weights
    return next(iter(candidates))


def _carried(raw: RawCheckpoint, key: str) -> dict[str, Any]:
    """What the source checkpoint held besides the chosen weights (reported; not written)."""
    if not isinstance(raw.obj, dict) or key == "":
        return {}
    return {name: type(value).__name__ for name, value in raw.obj.items() if name != key}


def _architecture_for(path, raw: RawCheckpoint, model, model_args, state) -> Architecture:
    kwargs = dict(model_args or {})
    if model:
        return parse_architecture(model, kwargs)
    obj = raw.obj if isinstance(raw.obj, dict) else {}
    arch = obj.get("arch")
    if isinstance(arch, str):
        args = obj.get("args")
        for name in TRAINING_ARG_NAMES:
            value = getattr(args, name, None) if args is not None else None
            if value is not None and name not in kwargs:
                kwargs[name] = value
        return Architecture("timm", arch, kwargs)
    raise UsageError(f"{path} does not say which model it belongs to",
                     "pass --model ARCH (a timm name or package.module:function)")
