"""What a bnsurgeon checkpoint records about its model, read and validated before it shapes one.

Metadata is untrusted data: every field is parsed, type-checked, and checked against the
stored tensors and the rule registry here, and ``check_rebuilt`` checks the rebuilt model
against what the file claims (same BN classes at the same paths, same shared tensors).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bnsurgeon.core.anatomy import qualname
from bnsurgeon.core.errors import CheckpointError, MetadataError
from bnsurgeon.core.json_text import refuse_constant, unique_keys
from bnsurgeon.core.layout import counted, shown
from bnsurgeon.files.reading import (
    PREFIX,
    RawCheckpoint,
    expand_aliases,
    pick_weights,
    state_dict_candidates,
    why_not_a_state_dict,
)
from bnsurgeon.loading.architecture import Architecture
from bnsurgeon.surgery.walk import class_map

if TYPE_CHECKING:
    import torch
    from torch import nn

#: metadata schema versions this bnsurgeon reads
KNOWN_SCHEMAS = (1,)
ARCHITECTURE_KINDS = ("timm", "factory", "transformers", "unknown")
MAX_NAME_CHARS = 200


@dataclass
class Recorded:
    """The validated ``bnsurgeon.*`` metadata of one file."""

    schema: int
    architecture: Architecture
    target: str
    options: dict[str, Any] = field(default_factory=dict)
    classes: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    source: str = ""
    folds: list[dict[str, Any]] = field(default_factory=list)  # --to fused; each checked against the model by fusion
    #: every conversion the file went through, in order (load replays all of them)
    history: list[dict[str, Any]] = field(default_factory=list)
    check_input: Any = None  # a CheckInput: the input the file's checks used, reused by later ones
    rules: list[str] = field(default_factory=list)  # --rules specs whose rules the conversion used
    #: the entry of a .pt output holding the model's tensors: state_dict, or the chosen state dict's own name
    #: when the source's state_dict was another one (--weights state_dict_ema)
    weights: str = "state_dict"
    #: parameters that did not require grad in the converted model (None: the file does not say)
    frozen_parameters: list[str] | None = None
    #: BN batch counters (``num_batches_tracked``) kept as metadata, not tensors: a model directory's weights
    #: have the keys its config's class loads (``files.model_directory``), and a frozen BN class has none
    counts: dict[str, int] = field(default_factory=dict)


def _bad(raw: RawCheckpoint, key: str, problem: str) -> MetadataError:
    return MetadataError(f"{raw.path}: metadata {PREFIX}{key} {problem}")


def _field(raw: RawCheckpoint, key: str, default: Any = None) -> Any:
    text = raw.metadata.get(PREFIX + key)
    if text is None:
        return default
    if not isinstance(text, str):
        raise _bad(raw, key, f"is a {type(text).__name__}, not a JSON string")
    try:
        return json.loads(text, object_pairs_hook=unique_keys, parse_constant=refuse_constant)
    except ValueError as error:
        raise _bad(raw, key, f"is not valid JSON ({error})") from None
    except RecursionError:  # ``[[[[...`` nested past the interpreter's limit
        raise _bad(raw, key, "is nested too deeply to be metadata") from None


def _string_map(raw: RawCheckpoint, key: str) -> dict[str, str]:
    value = _field(raw, key, {})
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _bad(raw, key, "must map names to names (a JSON object of strings)")
    return value


def _schema(raw: RawCheckpoint) -> int:
    value = _field(raw, "schema")
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad(raw, "schema", f"is {shown(value)}, not a schema version")
    if value not in KNOWN_SCHEMAS:
        from bnsurgeon import __version__

        raise MetadataError(
            f"{raw.path} was written by a newer bnsurgeon (metadata schema {value}; "
            f"bnsurgeon {__version__} reads schema {', '.join(map(str, KNOWN_SCHEMAS))})",
            "upgrade bnsurgeon (pip install -U bnsurgeon) to read it",
        )
    return value


def _architecture(raw: RawCheckpoint) -> Architecture:
    from bnsurgeon.core.user_code import FACTORY_PATTERN
    from bnsurgeon.loading.trust import TIMM_NAME_PATTERN, is_plain_literal, size_args_problem

    value = _field(raw, "architecture", {})
    if not isinstance(value, dict) or set(value) - {"kind", "name", "kwargs"}:
        raise _bad(raw, "architecture", "must be an object with kind, name and kwargs")
    kind, name, kwargs = value.get("kind"), value.get("name"), value.get("kwargs") or {}
    if kind not in ARCHITECTURE_KINDS or not isinstance(name, str):
        raise _bad(
            raw,
            "architecture",
            f"has kind {shown(kind)} and name {shown(name)}; kind must be one of {ARCHITECTURE_KINDS}",
        )
    if len(name) > MAX_NAME_CHARS:  # it is quoted in messages, and typed again to confirm a factory
        raise _bad(raw, "architecture", f"names a {kind} of {len(name):,} characters (at most {MAX_NAME_CHARS})")
    if kind == "factory" and not FACTORY_PATTERN.match(name):
        raise _bad(raw, "architecture", f"names {shown(name)}, not a factory of the form package.module:function")
    if kind == "timm" and not TIMM_NAME_PATTERN.match(name):
        raise _bad(raw, "architecture", f"names {shown(name)}, not a timm model name")
    if kind == "transformers":
        from bnsurgeon.loading.transformers_source import CLASS_PATTERN, check_config

        if not CLASS_PATTERN.match(name) or set(kwargs) != {"config"}:
            raise _bad(
                raw,
                "architecture",
                f"names {shown(name)} with {shown(sorted(kwargs))}: not a transformers class and its config",
            )
        try:
            check_config(kwargs["config"], f"{raw.path}: metadata {PREFIX}architecture's config")
        except CheckpointError as error:
            raise MetadataError(error.message, error.hint) from None
    if not isinstance(kwargs, dict) or not is_plain_literal(kwargs):
        raise _bad(
            raw, "architecture", "has kwargs that are not plain literals (str, number, bool, None, lists, dicts)"
        )
    problem = size_args_problem(kwargs)
    if problem:  # it would shape the model: refused before anything is built
        raise MetadataError(f"{raw.path}: metadata {PREFIX}architecture kwargs.{problem}")
    return Architecture(kind, name, dict(kwargs))


def known_classes() -> set[str]:
    """Every class a rule claims, and every class bnsurgeon's targets produce."""
    from bnsurgeon.rules import builtin_rules, default_registry
    from bnsurgeon.runtime import FrozenBatchNorm, FrozenBatchNormAct, SyncBatchNorm, SyncBatchNormAct

    produced = {qualname(cls) for cls in (SyncBatchNorm, SyncBatchNormAct, FrozenBatchNorm, FrozenBatchNormAct)}
    claimed = [*builtin_rules(), *default_registry()]  # the built-ins whether or not timm is imported yet
    return produced | {qualname(cls) for rule in claimed for cls in rule.classes}


def recorded_weights(raw: RawCheckpoint) -> str:
    """The entry the file records as the model's tensors (``state_dict`` unless recorded otherwise), checked to
    be a top-level state dict of the file."""
    value = _field(raw, "weights", "state_dict")
    if value == "state_dict":
        return value
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS or "." in value:
        raise _bad(raw, "weights", f"is {shown(value)}, not the name of an entry of the file")
    if value not in state_dict_candidates(raw.obj):
        raise _bad(raw, "weights", f"names the entry {shown(value)}, which holds no state dict in the file")
    return value


def stored_tensors(raw: RawCheckpoint, weights: str | None = None) -> dict[str, "torch.Tensor"]:
    """The model's tensors (the entry the file records); ``weights`` names another state dict of the file
    (a training checkpoint's EMA)."""
    candidates = state_dict_candidates(raw.obj)
    if weights is not None:
        return candidates[pick_weights(raw.path, candidates, weights)]
    key = recorded_weights(raw)
    found = candidates.get(key) or (candidates.get("") if key == "state_dict" else None)
    if found is None:
        reason = why_not_a_state_dict(raw.obj)
        if reason:  # tensors are there: "missing every key" would misstate the file
            raise CheckpointError(
                f"{raw.path} holds no state dict bnsurgeon can use: {reason}",
                "the file's state_dict was edited; convert the original again",
            )
    return found or {}


def recorded_rules(raw: RawCheckpoint) -> list[str]:
    """The ``--rules pkg.mod:obj`` specs the file was converted with (validated; nothing imported)."""
    from bnsurgeon.core.user_code import FACTORY_PATTERN

    value = _field(raw, "rules", [])
    if value is None:
        return []
    if (
        not isinstance(value, list)
        or len(value) > 64
        or not all(isinstance(spec, str) and len(spec) <= 200 and FACTORY_PATTERN.match(spec) for spec in value)
    ):
        raise _bad(raw, "rules", "must be a JSON list of package.module:object names")
    return value


def _history(raw: RawCheckpoint, target: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    from bnsurgeon.files.history import history_problem, step

    value = _field(raw, "history")
    if value is None:  # files from before the history was recorded: their one step
        return [step(target, options)]
    problem = history_problem(value)
    if problem:
        raise _bad(raw, "history", f"is not a valid conversion history ({problem})")
    if value[-1]["target"] != target:
        raise _bad(
            raw, "history", f"ends with target {shown(value[-1]['target'])}, but the file records {shown(target)}"
        )
    return value


def _check_input(raw: RawCheckpoint) -> Any:
    from bnsurgeon.checks.check_input import CheckInput

    value = _field(raw, "check_input")
    if value is None:
        return None
    try:
        return CheckInput.from_record(value, origin="")
    except MetadataError:
        raise
    except CheckpointError as error:
        raise _bad(raw, "check_input", f"is not a valid check input ({error.message})") from None


def read_recorded(raw: RawCheckpoint) -> Recorded:
    """Parse and check every ``bnsurgeon.*`` field; raise MetadataError naming the first bad one."""
    from bnsurgeon.rules import FROZEN_POLICIES, TARGETS

    schema = _schema(raw)
    architecture = _architecture(raw)
    rules = recorded_rules(raw)
    if rules:  # their classes are known only once the user has named (and so registered) them
        from bnsurgeon.rules import confirm_rules

        confirm_rules(rules, str(raw.path))
    target = _field(raw, "target", "sync")
    if target not in TARGETS:
        raise _bad(raw, "target", f"is {shown(target)}, not one of {', '.join(TARGETS)}")
    options = _field(raw, "options", {}) or {}
    if not isinstance(options, dict):
        raise _bad(raw, "options", "must be a JSON object")
    if options.get("frozen", "keep") not in FROZEN_POLICIES:
        raise _bad(
            raw, "options", f"has frozen={shown(options.get('frozen'))}, not one of {', '.join(FROZEN_POLICIES)}"
        )
    if not isinstance(options.get("allow_unhandled", False), bool):
        raise _bad(raw, "options", "has a non-boolean allow_unhandled")
    classes = _string_map(raw, "classes")
    if architecture.kind == "transformers":  # its module holds its frozen BN classes: the registry finds them
        from bnsurgeon.loading.transformers_source import model_class

        model_class(architecture.name)
    unknown = sorted({cls for cls in classes.values()} - known_classes())
    if unknown and not options.get("allow_unhandled", False):
        raise _bad(raw, "classes", f"names classes no rule claims or produces: {', '.join(unknown[:3])}")
    aliases = _string_map(raw, "aliases")
    stored = stored_tensors(raw)
    for alias, key in aliases.items():
        if alias in stored:
            raise _bad(raw, "aliases", f"maps {shown(alias)}, which the file stores itself, to {shown(key)}")
        if key not in stored:
            raise _bad(raw, "aliases", f"maps {shown(alias)} to {shown(key)}, which the file does not store")
    source = _field(raw, "source", "")
    folds = _field(raw, "folds", []) if target == "fused" else []
    if not isinstance(folds, list) or not all(isinstance(fold, dict) for fold in folds):
        raise _bad(raw, "folds", "must be a JSON list of objects")
    history = _history(raw, target, options)
    check_input = _check_input(raw)
    counts = _counts(raw, stored)
    return Recorded(
        schema,
        architecture,
        target,
        options,
        classes,
        aliases,
        source if isinstance(source, str) else "",
        folds,
        history,
        check_input,
        rules,
        recorded_weights(raw),
        _frozen_parameters(raw),
        counts,
    )


#: a counter is a non-negative int64; more entries than this is not a model's BN
MAX_COUNTS = 100_000


def _counts(raw: RawCheckpoint, stored: dict[str, Any]) -> dict[str, int]:
    value = _field(raw, "counts", {}) or {}
    if not isinstance(value, dict) or len(value) > MAX_COUNTS:
        raise _bad(raw, "counts", f"must be a JSON object of at most {MAX_COUNTS:,} counters")
    for key, count in value.items():
        if not isinstance(key, str) or not key.endswith("num_batches_tracked") or len(key) > 4096:
            raise _bad(raw, "counts", f"names {shown(key)}, not a BN batch counter")
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count < 2**63:
            raise _bad(raw, "counts", f"gives {shown(key)} the count {shown(count)}, not a non-negative int64")
        if key in stored:
            raise _bad(raw, "counts", f"gives {shown(key)}, which the file stores as a tensor")
    return dict(value)


def _frozen_parameters(raw: RawCheckpoint) -> list[str] | None:
    value = _field(raw, "frozen_parameters", None)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(name, str) and len(name) <= 1000 for name in value):
        raise _bad(raw, "frozen_parameters", "must be a JSON list of parameter names")
    return value


def apply_trainability(raw: RawCheckpoint, recorded: Recorded, model: "nn.Module") -> None:
    """Each parameter requires grad exactly as it did in the model that was written (when the file says)."""
    if recorded.frozen_parameters is None:
        return
    parameters = dict(model.named_parameters())
    unknown = sorted(set(recorded.frozen_parameters) - set(parameters))
    if unknown:
        raise _bad(
            raw,
            "frozen_parameters",
            f"names {shown(unknown[0])}, which the rebuilt model has no "
            f"parameter for ({counted(len(unknown), 'name')})",
        )
    frozen = set(recorded.frozen_parameters)
    for name, parameter in parameters.items():
        parameter.requires_grad_(name not in frozen)


def check_rebuilt(raw: RawCheckpoint, recorded: Recorded, model: "nn.Module") -> None:
    """The rebuilt model is the one the file describes: same BN classes, same shared tensors."""
    actual = class_map(model)
    if actual != recorded.classes:
        paths = sorted(set(actual) | set(recorded.classes))
        differing = [p for p in paths if actual.get(p) != recorded.classes.get(p)]
        path = differing[0]
        raise MetadataError(
            f"{raw.path}: rebuilding as {recorded.target!r} gave {actual.get(path, 'nothing')} at {shown(path)} where "
            f"the checkpoint recorded {shown(recorded.classes.get(path, 'nothing'))} ({counted(len(differing), 'module')} {'differs' if len(differing) == 1 else 'differ'})",
            "the metadata does not describe these weights: use the bnsurgeon/timm versions that wrote the file, "
            "pass the model explicitly, or convert the original again",
        )
    named = model.state_dict(keep_vars=True)
    for alias, key in recorded.aliases.items():
        if alias not in named or key not in named or named[alias] is not named[key]:
            raise MetadataError(
                f"{raw.path}: metadata {PREFIX}aliases says {shown(alias)} is the same tensor as {shown(key)}, "
                "but the model does not share them",
            )


def state_from_checkpoint(
    raw: RawCheckpoint, recorded: Recorded | None = None, weights: str | None = None
) -> dict[str, "torch.Tensor"]:
    import torch

    recorded = recorded or read_recorded(raw)
    state = expand_aliases(stored_tensors(raw, weights), recorded.aliases)
    if weights is None or weights == recorded.weights:  # the counters are the recorded weights' own
        state.update({key: torch.tensor(count, dtype=torch.long) for key, count in recorded.counts.items()})
    return state


def architecture_from_checkpoint(raw: RawCheckpoint) -> Architecture:
    return _architecture(raw)
