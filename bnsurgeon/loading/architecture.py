"""How to build a model again: a timm name or an importable factory, with kwargs.

Every model-building path records an ``Architecture`` so that the written checkpoint
is self-describing and ``bnsurgeon.load`` can rebuild the same model.
"""

from __future__ import annotations

import ast
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from bnsurgeon.core.errors import FactoryRaisedError, SourceNotFoundError, UsageError, first_line
from bnsurgeon.core.layout import describe_kwargs
from bnsurgeon.files.reading import RawCheckpoint

if TYPE_CHECKING:
    from torch import nn

    from bnsurgeon.loading.resolve import ResolvedSource

SEED = 0


@dataclass
class Architecture:
    """How to build the model again: a timm name or an importable factory, with kwargs."""

    kind: str  # "timm" | "factory" | "transformers" | "unknown"
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Architecture":
        return cls(kind=data.get("kind", "unknown"), name=data.get("name", ""), kwargs=dict(data.get("kwargs") or {}))

    def describe(self) -> str:
        args = describe_kwargs(self.kwargs)
        if self.kind == "transformers":  # its kwargs are the whole config: named, not listed
            return f"transformers:{self.name}"
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
            if self.kind == "transformers":
                from bnsurgeon.loading.transformers_source import build

                return build(self.name, self.kwargs)
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
    return name[len("timm:") :] if name.startswith("timm:") else name


def _create_timm(name: str, kwargs: dict[str, Any]) -> "nn.Module":
    import timm

    name = resolve_timm_name(name)
    try:
        return timm.create_model(name, pretrained=False, **kwargs)
    except TypeError as error:
        raise UsageError(f"timm model {name!r} does not accept these arguments: {error}", "check --model-arg") from None
    except Exception as error:  # timm validates kwargs with asserts, KeyErrors, ValueErrors...
        raise UsageError(
            f"timm model {name!r} cannot be built with {describe_kwargs(kwargs) or 'no arguments'}: "
            f"{type(error).__name__}: {first_line(error)}",
            "check the --model-arg values against the model's constructor",
        ) from None


def resolve_timm_name(name: str) -> str:
    """``name`` if timm knows it, else its unique case-insensitive match; else SourceNotFoundError with suggestions."""
    import timm

    from bnsurgeon.loading.names import case_insensitive_match, suggestions

    if timm.is_model(name):
        return name
    known = timm.list_models()
    match = case_insensitive_match(name, known)
    if match is not None:
        return match
    close = suggestions(name, known)
    hint = f"did you mean {', '.join(close)}?" if close else "see timm.list_models() for the names"
    raise SourceNotFoundError(f"unknown timm model {name!r}", hint)


def _call_factory(target: str, kwargs: dict[str, Any]) -> "nn.Module":
    import inspect

    from torch import nn

    from bnsurgeon.core.user_code import check_factory_spec, import_named_module, shadowing_error

    check_factory_spec(target)
    module_name = target.partition(":")[0]
    try:
        module, function_name = import_named_module(target)
    except ImportError as error:
        raise shadowing_error() or SourceNotFoundError(
            f"cannot import {module_name!r} for factory {target!r} ({error})",
            "run from the directory that holds the package, or install it",
        ) from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise SourceNotFoundError(
            f"{module_name} has no callable {function_name!r}", "write SOURCE as package.module:function"
        )
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as error:
        raise UsageError(
            f"factory {target!r} cannot be called with {describe_kwargs(kwargs) or 'no arguments'} ({error})",
            "pass its arguments with --model-arg key=value, or name a function that builds the model",
        ) from None
    except ValueError:  # no signature to check (some builtins): the call below says
        pass
    try:
        model = factory(**kwargs)
    except (Exception, SystemExit) as error:  # sys.exit(0) in a factory must not end verify with "passed"
        raise shadowing_error() or FactoryRaisedError(
            f"factory {target!r} raised {type(error).__name__}: {first_line(error)}",
            "fix the factory or its --model-arg values",
        ) from None
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"factory {target!r} returned {type(model).__name__}, not an nn.Module", "return the model from it"
        )
    return model


def parse_architecture(spec: str, kwargs: dict[str, Any] | None = None) -> Architecture:
    """``resnet50`` / ``timm:resnet50`` -> timm; ``pkg.mod:fn`` -> factory."""
    kwargs = dict(kwargs or {})
    if spec.startswith("timm:") or ":" not in spec:
        return Architecture("timm", resolve_timm_name(_timm_name(spec)), kwargs)
    return Architecture("factory", spec, kwargs)


def own_input_shape(model: "nn.Module", batch: int = 2) -> tuple[int, ...] | None:
    """The input the model says it takes: timm's pretrained_cfg input_size, or a transformers vision
    config's num_channels and image_size (the size position embeddings are made for)."""
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    size = cfg.get("input_size") if isinstance(cfg, dict) else None
    if size:
        return (batch, *size)
    config = getattr(model, "config", None)
    channels, image = getattr(config, "num_channels", None), getattr(config, "image_size", None)
    if isinstance(image, int):
        image = (image, image)
    sizes = (channels, *image) if isinstance(image, (list, tuple)) and len(image) == 2 else ()
    if (
        sizes
        and all(isinstance(v, int) and not isinstance(v, bool) for v in sizes)
        and 1 <= sizes[0] <= 64
        and all(8 <= v <= 4096 for v in sizes[1:])
    ):
        return (batch, *sizes)
    return None


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
    check_input: Any = None  # a CheckInput recorded in a bnsurgeon checkpoint (validated)
    history: list = field(default_factory=list)  # conversions a bnsurgeon checkpoint records (validated)
    source: "ResolvedSource | None" = None  # the SOURCE it was loaded from, its kind told by the file read
