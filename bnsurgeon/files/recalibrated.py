"""Write a recalibrated model: the source file again, with only the BN running statistics changed.

A training checkpoint recalibrated with ``--weights state_dict_ema`` is written back whole:
every entry (optimizer, the raw model's weights, epoch, args, ...) is the same object, and
in the chosen state dict only the ``running_mean``/``running_var`` tensors of the
recalibrated modules are new (in the file's own dtype). What was done is recorded:

- a training checkpoint (a dict beside its state dicts): an added entry
  ``bnsurgeon_recalibrations``, a list of plain records (one per recalibration);
- a bnsurgeon checkpoint: the metadata field ``bnsurgeon.recalibrations`` (JSON);
- a bare state dict (``.pt`` or ``.safetensors``), or a model built from a timm name or a
  factory (written as a bare state dict): in the reports beside the output, and in a
  ``.safetensors`` output's metadata field ``recalibrations``. A bare ``.pt`` state dict
  stays a bare state dict (an added entry would make it a training checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from bnsurgeon.core.errors import UsageError, statistics_overflow
from bnsurgeon.core.json_text import dumps
from bnsurgeon.files.reading import PREFIX, RawCheckpoint, state_dict_candidates
from bnsurgeon.files.safewrite import write_files
from bnsurgeon.files.writing import report_paths

if TYPE_CHECKING:
    import torch
    from torch import nn

RECORD_ENTRY = "bnsurgeon_recalibrations"
STAT_NAMES = ("running_mean", "running_var")


def new_statistics(model: "nn.Module", paths: list[str]) -> dict[str, "torch.Tensor"]:
    """The model's state-dict keys of the recalibrated buffers, with their new values."""
    state = model.state_dict()
    wanted = {f"{path}.{name}" for path in paths for name in STAT_NAMES}
    return {key: value.detach().cpu() for key, value in state.items() if key in wanted}


def _replaced(state: dict, new: dict[str, "torch.Tensor"], prefix: str, aliases: dict[str, str]) -> dict:
    """A copy of ``state`` (same tensors) with the new statistics in place, each in the file's dtype."""
    import torch

    result = dict(state)
    for key, value in new.items():
        stored = prefix + key
        if stored not in result:
            stored = prefix + aliases.get(key, key)
        if stored not in result:
            raise UsageError(
                f"the recalibrated buffer {key} has no tensor in the file's state dict to replace",
                "write a .safetensors output of the model instead",
            )
        old = result[stored]
        if tuple(old.shape) != tuple(value.shape):
            raise UsageError(
                f"the recalibrated buffer {key} has shape {tuple(value.shape)}, the file's {tuple(old.shape)}",
                "recalibrate the file the model was loaded from",
            )
        if old.is_floating_point():  # the file's dtype may be narrower than the model's: Inf there is no statistic
            module, _, name = key.rpartition(".")
            overflow = statistics_overflow(module, {name: value.to(torch.float64)}, old.dtype)
            if overflow is not None:
                raise overflow
        result[stored] = value.to(dtype=old.dtype).clone()
    return result


def _nest(obj: Any, key: str, state: dict) -> Any:
    """``obj`` with the state dict at ``key`` ('' top level, 'entry' or 'entry.state_dict') replaced."""
    if key == "":
        return state
    entry, _, field = key.partition(".")
    copy = dict(obj)
    copy[entry] = dict(obj[entry], **{field: state}) if field else state
    return copy


def check_output_format(output: Path, raw: "RawCheckpoint | None", weights_key: str | None) -> None:
    """Refuse, before any work, an output format that cannot hold the source written back."""
    if raw is None or not isinstance(raw.obj, dict):
        return
    safetensors_out = output.suffix == ".safetensors"
    candidates = state_dict_candidates(raw.obj)
    key = weights_key if weights_key is not None else ("state_dict" if "state_dict" in candidates else "")
    if raw.is_bnsurgeon:
        if (raw.path.suffix == ".safetensors") != safetensors_out:
            kind = ".safetensors" if raw.path.suffix == ".safetensors" else ".pt"
            raise UsageError(
                f"{raw.path} is a {kind} checkpoint; its recalibrated copy is one too",
                "end the output with " + (".safetensors" if kind == ".safetensors" else ".pt or .pth"),
            )
    elif key != "" and safetensors_out:
        raise UsageError(
            f"{raw.path} is a training checkpoint; a .safetensors output cannot hold its other entries",
            "end the output with .pth.tar, .pth or .pt (the whole checkpoint is written back)",
        )


def recalibrated_writers(
    output: Path,
    raw: "RawCheckpoint | None",
    weights_key: str | None,
    prefix: str,
    model: "nn.Module",
    paths: list[str],
    record: dict[str, Any],
    report_json: str,
    report_md: str,
) -> "dict[Path, Callable[[Path], object]]":
    """The output (the source file with new statistics, or the model's state dict) and its two reports."""
    import torch

    new = new_statistics(model, paths)
    json_path, md_path = report_paths(output)
    writers: dict[Path, Callable[[Path], object]] = {
        json_path: lambda temp: temp.write_text(report_json + "\n"),
        md_path: lambda temp: temp.write_text(report_md),
    }
    if raw is None or not isinstance(raw.obj, dict):  # a timm name or factory: the model's own state dict
        state, seen = {}, set()
        for name, value in model.state_dict().items():
            value = value.detach().cpu().contiguous()
            shared = value.untyped_storage().data_ptr() in seen  # tied weights: safetensors stores each once
            seen.add(value.untyped_storage().data_ptr())
            state[name] = value.clone() if shared else value
        writers[output] = _bare_writer(output, state, {}, record)
        return writers
    aliases = _aliases(raw)
    candidates = state_dict_candidates(raw.obj)
    key = weights_key if weights_key is not None else ("state_dict" if "state_dict" in candidates else "")
    if key not in candidates:
        raise UsageError(f"{raw.path} has no state dict {key!r} to write back", "pass --weights NAME")
    state = _replaced(candidates[key], new, prefix, aliases)
    obj = _nest(raw.obj, key, state)
    check_output_format(output, raw, weights_key)
    if raw.is_bnsurgeon:
        previous = _previous_records(raw.metadata.get(PREFIX + "recalibrations"))
        metadata = {name: value for name, value in raw.metadata.items()}
        metadata[PREFIX + "recalibrations"] = dumps(previous + [record])
        if raw.path.suffix == ".safetensors":
            writers[output] = _safetensors_writer(obj, metadata)
        else:
            obj = dict(obj)
            obj["bnsurgeon"] = {
                name[len(PREFIX) :]: value for name, value in metadata.items() if name.startswith(PREFIX)
            }
            obj["bnsurgeon"].update(
                {name: value for name, value in raw.obj["bnsurgeon"].items() if PREFIX + name not in metadata}
            )
            writers[output] = lambda temp: torch.save(obj, temp)
        return writers
    if key == "":  # a bare state dict stays one (a .safetensors output records the run in its metadata)
        writers[output] = _bare_writer(output, obj, dict(raw.metadata), record)
        return writers
    obj = dict(obj)
    recorded = obj.get(RECORD_ENTRY)
    obj[RECORD_ENTRY] = (list(recorded) if isinstance(recorded, list) else []) + [record]
    writers[output] = lambda temp: torch.save(obj, temp)
    return writers


def write_recalibrated(writers: "dict[Path, Callable[[Path], object]]", *, force: bool) -> None:
    """All three files, or none changed (atomic, as every bnsurgeon write)."""
    write_files(writers, force=force)


def _bare_writer(output: Path, state: dict, metadata: dict[str, str], record: dict[str, Any]):
    import torch

    if output.suffix == ".safetensors":
        metadata = dict(metadata)
        metadata.setdefault("format", "pt")
        metadata["recalibrations"] = dumps(_previous_records(metadata.get("recalibrations")) + [record])
        return _safetensors_writer(state, metadata)
    return lambda temp: torch.save(state, temp)


def _safetensors_writer(tensors: dict, metadata: dict[str, str]):
    import safetensors.torch

    tensors = {key: value.contiguous() for key, value in tensors.items()}
    return lambda temp: safetensors.torch.save_file(tensors, str(temp), metadata=metadata)


def _aliases(raw: RawCheckpoint) -> dict[str, str]:
    text = raw.metadata.get(PREFIX + "aliases")
    try:
        value = json.loads(text) if isinstance(text, str) else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _previous_records(text: Any) -> list:
    try:
        value = json.loads(text) if isinstance(text, str) else []
    except ValueError:
        return []
    return value if isinstance(value, list) else []
