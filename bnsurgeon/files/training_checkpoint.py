"""Carry a training checkpoint's other entries (optimizer, EMA, epoch, args, ...) into the output.

A user converting ``last.pth.tar`` to resume training with sync BN needs everything the
file held, not only the model. Into a ``.pt``/``.pth``/``.pth.tar`` output:

- the chosen weights are the converted model's (also under their original key when
  that is not ``state_dict``, sharing the same tensors);
- every other state dict (EMA: ``state_dict_ema``, ``model_ema``, ...) is loaded into a
  copy of the source model and converted with the same options;
- optimizer states are index-based (``param_groups[i]['params']`` are positions in
  ``model.parameters()``). They stay valid exactly when the converted model has the
  source's parameters in the same order, which ``sync``/``plain`` guarantee (surgery
  keeps the Parameter objects). That is checked, not assumed: when the order differs
  (``--to frozen`` turns BN weights into buffers; ``--frozen unfreeze`` does the
  reverse) the conversion is refused with the reason, because a shifted optimizer
  state would silently apply one layer's momentum to another;
- everything else is copied as it is.

A ``.safetensors`` output holds tensors only: the entries are listed as not written.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bnsurgeon.core.errors import CheckpointError, NonFiniteWeightsError, UsageError
from bnsurgeon.core.layout import counted
from bnsurgeon.files.reading import count_tensors, entry_name, nesting_depth, state_dict_candidates, strip_common_prefix
from bnsurgeon.files.weights import has_non_finite, load_weights
from bnsurgeon.surgery.walk import ConvertResult, convert

if TYPE_CHECKING:
    from torch import nn

    from bnsurgeon.loading.architecture import LoadedSource  # what the loading stage hands over


@dataclass
class Carried:
    """What goes into the output besides the model (``entries``) and what the report says of each."""

    entries: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, str] = field(default_factory=dict)
    #: the output entry holding the model's tensors (recorded as bnsurgeon.weights when not state_dict)
    weights_key: str = "state_dict"


def writes_extras(output: Path | None) -> bool:
    """True for outputs written with torch.save (.pt, .pth, .pth.tar), which can hold any entry."""
    return output is not None and output.suffix != ".safetensors"


def is_optimizer_state(value: Any) -> bool:
    """An ``optimizer.state_dict()`` (or a list of them, as Lightning stores ``optimizer_states``)."""

    def one(item: Any) -> bool:
        return isinstance(item, dict) and "state" in item and "param_groups" in item

    # not recursive: a file's list may nest 100,000 deep
    return one(value) or (isinstance(value, (list, tuple)) and any(one(item) for item in value))


#: a .pt output is written by pickle, which recurses once per level; no training checkpoint nests this deep
MAX_CARRIED_NESTING = 100


def parameter_order(model: "nn.Module") -> list[str]:
    return [name for name, _ in model.named_parameters()]


def parameters_unchanged(result: ConvertResult) -> bool:
    """The converted model has the source's Parameter objects, in the same order, under the same names."""
    source = list(result.source.named_parameters())
    converted = list(result.model.named_parameters())
    return len(source) == len(converted) and all(
        name_a == name_b and param_a is param_b
        for (name_a, param_a), (name_b, param_b) in zip(source, converted, strict=True)
    )


def _describe(value: Any) -> str:
    tensors = count_tensors(value)
    return type(value).__name__ + (f", {counted(tensors, 'tensor')}" if tensors else "")


def _converted_copy(result: ConvertResult, state: dict, origin: str, options: dict[str, Any]) -> dict:
    """``state`` (e.g. EMA weights) loaded into a copy of the source model, converted like the model (the same
    target, frozen policy, filters, input dims and, for ``fused``, the same folds), then checked for NaN/Inf
    as the model's own weights are."""
    import torch

    expected = set(result.source.state_dict())
    state, _ = strip_common_prefix(state, expected)
    twin = copy.deepcopy(result.source)
    with torch.no_grad():
        load_weights(twin, state, origin)
    fused = result.report.fusion
    converted = convert(
        twin, result.report.target, inplace=True, folds=fused["folded"] if fused is not None else None, **options
    ).model
    tensors = {key: value.detach() for key, value in converted.state_dict().items()}
    bad = [key for key, value in tensors.items() if has_non_finite(value)]
    if bad:
        listed = ", ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")
        raise NonFiniteWeightsError(
            f"{origin} holds non-finite values (NaN or Inf) in {counted(len(bad), 'tensor')}: {listed}"
        )
    return tensors


def output_weights_key(raw: Any, weights_key: str, output: Path | None) -> str:
    """Where a .pt output keeps the model's (checked) tensors: ``state_dict``, unless the source's own
    ``state_dict`` entry is another state dict (``--weights state_dict_ema``): then the chosen entry's own name,
    so that every state dict stays under the name it had."""
    entry = weights_key.split(".", 1)[0]
    if (
        not writes_extras(output)
        or not isinstance(raw.obj, dict)
        or "state_dict" not in raw.obj
        or entry in ("", "state_dict")
    ):
        return "state_dict"
    if "." in weights_key:
        raise UsageError(
            f"{raw.path}: the chosen weights {weights_key!r} sit inside the entry {entry!r}, beside a state_dict "
            "entry of its own; a .pt output cannot keep both under their names with the model's",
            "write a .safetensors output (the chosen weights only), or save that state dict at the top level",
        )
    return entry


def carry_entries(
    loaded: LoadedSource, result: ConvertResult, output: Path | None, options: dict[str, Any] | None = None
) -> Carried:
    """The source checkpoint's other entries, converted or copied for ``output`` (see the module doc).

    ``options`` are the keyword arguments the model was converted with (frozen, allow_unhandled,
    include, exclude, input_dims): every other state dict is converted with the same ones.
    """
    raw = loaded.checkpoint
    options = dict(
        options
        or {
            "frozen": result.report.options.get("frozen", "keep"),
            "allow_unhandled": bool(result.report.options.get("allow_unhandled", False)),
        }
    )
    if raw is None or not isinstance(raw.obj, dict) or _is_bare_state_dict(raw.obj):
        return Carried()
    weights_key = loaded.weights_key or ("state_dict" if raw.is_bnsurgeon else "")
    weights_entry = weights_key.split(".", 1)[0]
    main = output_weights_key(raw, weights_key, output)
    own = {"bnsurgeon", weights_entry} if raw.is_bnsurgeon else set()
    others = {name: value for name, value in raw.obj.items() if name != weights_entry and name not in own}
    carried = Carried(weights_key=main)
    if not writes_extras(output):
        reason = "not written: a .safetensors output holds the model's tensors only; write .pth/.pth.tar to carry it"
        carried.summary = {entry_name(name): f"{_describe(value)}; {reason}" for name, value in others.items()}
        return carried

    if "bnsurgeon" in others:  # a .pt output keeps bnsurgeon's metadata under that name
        raise UsageError(
            f"{raw.path} holds an entry named 'bnsurgeon', the name a .pt output keeps for bnsurgeon's "
            "metadata: carried, it would replace it and the file would not load back",
            "write a .safetensors output (the weights only), or rename that entry in the source",
        )
    for name, value in others.items():
        if nesting_depth(value, MAX_CARRIED_NESTING) > MAX_CARRIED_NESTING:
            raise CheckpointError(
                f"{raw.path} entry {entry_name(name)!r} nests containers more than {MAX_CARRIED_NESTING} levels deep, "
                "more than a training checkpoint does and more than a .pt output can be written with",
                "write a .safetensors output (the weights only), or save the checkpoint without that entry",
            )
    target = result.report.target
    if weights_entry and weights_entry != main:
        weights = {k: v.detach() for k, v in result.model.state_dict().items()}
        carried.entries[weights_entry] = _nest(raw.obj[weights_entry], weights_key, weights)
        carried.summary[weights_entry] = (
            f"the converted weights (the same tensors as {main}), {counted(len(weights), 'tensor')}"
        )
    elif weights_entry and weights_entry == main and main != "state_dict":
        carried.summary[weights_entry] = "the converted and checked weights: what bnsurgeon.load returns"
    candidates = state_dict_candidates(raw.obj)
    for name, value in others.items():
        nested_keys = [key for key in candidates if isinstance(name, str) and key.split(".", 1)[0] == name]
        if nested_keys:
            state = _converted_copy(result, candidates[nested_keys[0]], f"{raw.path} entry {nested_keys[0]!r}", options)
            carried.entries[name] = _nest(value, nested_keys[0], state)
            carried.summary[entry_name(name)] = (
                f"converted to {target} like the model ({counted(len(state), 'tensor')})"
            )
        elif is_optimizer_state(value):
            if not parameters_unchanged(result):
                raise UsageError(
                    f"{raw.path} holds optimizer state ({entry_name(name)!r}) that --to {target} would invalidate: the converted "
                    f"model's parameters differ from the source's ({_parameter_change(result)}), and optimizer state "
                    "is indexed by parameter position",
                    "write a .safetensors output (weights only) and start a new optimizer, or convert to sync/plain",
                )
            carried.entries[name] = value
            carried.summary[entry_name(name)] = (
                f"carried ({_describe(value)}); still valid: the converted model has the "
                "source's parameters, same objects in the same order"
            )
        else:
            carried.entries[name] = value
            carried.summary[entry_name(name)] = f"carried ({_describe(value)})"
    return carried


def _is_bare_state_dict(obj: dict) -> bool:
    return "" in state_dict_candidates(obj)


def _nest(original: Any, key: str, state: dict) -> Any:
    """``state`` where the source held its weights: the entry itself, or its ``state_dict`` field."""
    if "." in key and isinstance(original, dict):
        return dict(original, **{key.split(".", 1)[1]: state})
    return state


def _parameter_change(result: ConvertResult) -> str:
    before, after = parameter_order(result.source), parameter_order(result.model)
    lost = [name for name in before if name not in set(after)]
    gained = [name for name in after if name not in set(before)]
    parts = []
    buffers = {name for name, _ in result.model.named_buffers()}
    became_buffers = [name for name in lost if name in buffers]
    removed = [name for name in lost if name not in buffers]  # --to fused: folded into the producer
    if became_buffers:
        parts.append(
            f"{counted(len(became_buffers), 'parameter')} "
            f"{'becomes a buffer' if len(became_buffers) == 1 else 'become buffers'}, e.g. {became_buffers[0]}"
        )
    if removed:
        parts.append(
            f"{counted(len(removed), 'parameter')} {'is' if len(removed) == 1 else 'are'} removed "
            f"(folded into the layer before), e.g. {removed[0]}"
        )
    if gained:
        parts.append(
            f"{counted(len(gained), 'buffer')} {'becomes a parameter' if len(gained) == 1 else 'become parameters'}, "
            f"e.g. {gained[0]}"
        )
    return "; ".join(parts) or "their order changed"
