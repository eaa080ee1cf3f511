"""SOURCE string -> nn.Module: a timm name, ``pkg.module:factory``, or a checkpoint file.

Every model-building path records an ``Architecture`` so that the written checkpoint
is self-describing and ``bnsurgeon.load`` can rebuild the same model.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint import (
    SAFETENSORS_SUFFIXES,
    TORCH_SUFFIXES,
    RawCheckpoint,
    expand_aliases,
    read_checkpoint,
    state_dict_candidates,
    strip_common_prefix,
)
from .errors import CheckpointError, SourceNotFoundError, UsageError, WeightsMismatchError

if TYPE_CHECKING:
    import torch
    from torch import nn

SEED = 0
TRAINING_ARG_NAMES = ("num_classes", "in_chans", "global_pool")


@dataclass
class Architecture:
    """How to build the model again: a timm name or an importable factory, with kwargs."""

    kind: str  # "timm" | "factory" | "unknown"
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Architecture":
        return cls(kind=data.get("kind", "unknown"), name=data.get("name", ""), kwargs=dict(data.get("kwargs") or {}))

    def describe(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        prefix = "timm:" if self.kind == "timm" else ""
        return f"{prefix}{self.name}" + (f"({args})" if args else "")

    def build(self, *, meta: bool = False) -> "nn.Module":
        """Instantiate with seeded init (or on the meta device: no weights allocated)."""
        import torch

        with torch.device("meta") if meta else _seeded(SEED):
            if self.kind == "timm":
                return _create_timm(self.name, self.kwargs)
            if self.kind == "factory":
                return _call_factory(self.name, self.kwargs)
        raise UsageError(
            "the checkpoint does not record an architecture bnsurgeon can rebuild",
            "pass the model (--model ARCH, or bnsurgeon.load(path, model=...))",
        )


@contextmanager
def _seeded(seed: int):
    import torch

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


@dataclass
class LoadedSource:
    """A model ready for surgery, and what is known about where it came from."""

    model: "nn.Module"
    architecture: Architecture
    description: str
    input_shape: tuple[int, ...] | None = None
    checkpoint: RawCheckpoint | None = None
    weights_key: str | None = None
    stripped_prefix: str = ""
    carried: dict[str, Any] = field(default_factory=dict)


def parse_model_args(pairs: list[str] | None) -> dict[str, Any]:
    """``key=value`` strings -> kwargs; values parsed as Python literals when they are."""
    result: dict[str, Any] = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise UsageError(f"--model-arg {pair!r} is not key=value", "write it like num_classes=10")
        key, raw = pair.split("=", 1)
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        result[key.strip()] = value
    return result


def _timm_name(name: str) -> str:
    return name[len("timm:"):] if name.startswith("timm:") else name


def _create_timm(name: str, kwargs: dict[str, Any]) -> "nn.Module":
    import timm

    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else "see timm.list_models() for the names"
        raise SourceNotFoundError(f"unknown timm model {name!r}", hint)
    try:
        return timm.create_model(name, pretrained=False, **kwargs)
    except TypeError as error:
        raise UsageError(f"timm model {name!r} does not accept these arguments: {error}", "check --model-arg") from None


def _call_factory(target: str, kwargs: dict[str, Any]) -> "nn.Module":
    from torch import nn

    module_name, _, function_name = target.partition(":")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise SourceNotFoundError(f"cannot import {module_name!r} for factory {target!r} ({error})",
                                  "run from the directory that holds the package, or install it") from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise SourceNotFoundError(f"{module_name} has no callable {function_name!r}", "write SOURCE as package.module:function")
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise UsageError(f"factory {target!r} returned {type(model).__name__}, not an nn.Module", "return the model from it")
    return model


def parse_architecture(spec: str, kwargs: dict[str, Any] | None = None) -> Architecture:
    """``resnet50`` / ``timm:resnet50`` -> timm; ``pkg.mod:fn`` -> factory."""
    kwargs = dict(kwargs or {})
    if spec.startswith("timm:") or ":" not in spec:
        return Architecture("timm", _timm_name(spec), kwargs)
    return Architecture("factory", spec, kwargs)


def looks_like_file(source: str) -> bool:
    path = Path(source)
    return path.exists() or path.suffix in SAFETENSORS_SUFFIXES + TORCH_SUFFIXES or "/" in source


def timm_input_shape(model: "nn.Module", batch: int = 2) -> tuple[int, ...] | None:
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    size = cfg.get("input_size")
    return (batch, *size) if size else None


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
        from .api import rebuild_from_checkpoint

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


def materialize(build, state: dict[str, "torch.Tensor"], origin: Any, adapt=None) -> "nn.Module":
    """The model with the checkpoint's tensors, built on the meta device and assigned.

    No random initialization and no second copy of the weights: the checkpoint's own
    tensors (memory-mapped where the format allows) become the model's. Models that
    compute at init or keep non-persistent buffers cannot be built on meta; they fall
    back to a normal build followed by a copying load.
    """

    try:
        model = build(True)
    except Exception:  # e.g. .tolist()/numpy at init: not buildable on meta
        model = None
    if model is not None:
        tensors = adapt(model, state) if adapt else state
        expected = model.state_dict()
        check_fit(model, tensors, origin, expected)
        tensors = {k: v.to(expected[k].dtype) if v.dtype != expected[k].dtype else v for k, v in tensors.items()}
        model.load_state_dict(tensors, strict=True, assign=True)
        leftovers = [t for t in (*model.parameters(), *model.buffers()) if t.is_meta]
        if not leftovers:
            return model
    model = build(False)
    load_weights(model, adapt(model, state) if adapt else state, origin)
    return model


def check_fit(model: "nn.Module", state: dict[str, "torch.Tensor"], origin: Any = "checkpoint",
              expected: dict | None = None) -> None:
    """Raise WeightsMismatchError listing missing, unexpected and shape-mismatched keys."""
    expected = expected if expected is not None else model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [
        f"{k} {tuple(state[k].shape)} vs {tuple(expected[k].shape)}"
        for k in expected
        if k in state and tuple(state[k].shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or mismatched:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)):
            if items:
                shown = ", ".join(items[:4]) + (f" (+{len(items) - 4} more)" if len(items) > 4 else "")
                parts.append(f"{label} {len(items)}: {shown}")
        raise WeightsMismatchError(
            f"weights in {origin} do not fit the architecture: " + "; ".join(parts),
            "check --model and --model-arg (e.g. num_classes=...), or --weights to pick another state dict",
        )


def load_weights(model: "nn.Module", state: dict[str, "torch.Tensor"], origin: Any = "checkpoint") -> None:
    """Strict copying load with a clear error when the weights do not fit."""
    check_fit(model, state, origin)
    model.load_state_dict(state, strict=True)


def state_from_checkpoint(raw: RawCheckpoint) -> dict[str, "torch.Tensor"]:
    candidates = state_dict_candidates(raw.obj)
    state = candidates.get("state_dict") or candidates.get("") or {}
    return expand_aliases(state, raw.bnsurgeon("aliases", {}) or {})


def architecture_from_checkpoint(raw: RawCheckpoint) -> Architecture:
    return Architecture.from_dict(raw.bnsurgeon("architecture", {}) or {})

