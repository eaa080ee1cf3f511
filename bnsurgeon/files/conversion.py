"""Write a conversion: the checkpoint with self-describing metadata, and its two reports, as one unit."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from bnsurgeon import __version__
from bnsurgeon.core.json_text import dumps
from bnsurgeon.files.history import step
from bnsurgeon.files.model_directory import CONFIG_FILE, WEIGHTS_FILE, pretrained_layout, write_into_directory
from bnsurgeon.files.safewrite import write_files
from bnsurgeon.files.writing import checkpoint_writer, report_paths, write_checkpoint
from bnsurgeon.surgery.walk import ConvertResult, class_map

if TYPE_CHECKING:  # the loading stage's record of how to build the model, written as its dict
    from bnsurgeon.loading.architecture import Architecture


def _metadata(
    result: ConvertResult,
    architecture: Architecture,
    source: str,
    *,
    check_input: Any = None,
    history: list | None = None,
    weights: str = "state_dict",
) -> dict[str, Any]:
    metadata = {
        "schema": 1,
        "version": __version__,
        "architecture": architecture.to_dict(),
        "target": result.report.target,
        "options": {k: v for k, v in result.report.options.items() if k != "inplace"},
        "classes": class_map(result.model),
        "source": source,
    }
    from bnsurgeon.rules import specs_for

    rules = [getattr(item, "rule", None) for item in [*result.report.changed, *result.report.kept]]
    used = specs_for(rule for rule in rules if rule)
    if used:  # loading the file asks for the same --rules again
        metadata["rules"] = used
    metadata["history"] = list(history or []) + [step(result.report.target, result.report.options)]
    if check_input is not None and check_input.recordable():  # reused by later conversions of the file
        metadata["check_input"] = check_input.to_record()
    if result.report.fusion is not None:  # --to fused: which BN went into which producer, for load
        metadata["folds"] = result.report.fusion["folded"]
    if weights != "state_dict":  # the source's state_dict is another state dict, carried under its own name
        metadata["weights"] = weights
    # requires_grad is not in a state dict, and a class rebuilt from its config may freeze other parameters than
    # the source had (transformers' from_pretrained leaves DETR's backbone trainable, its constructor does not)
    metadata["frozen_parameters"] = [
        name for name, parameter in result.model.named_parameters() if not parameter.requires_grad
    ]
    return metadata


def save(
    result: ConvertResult,
    path: "str | Path",
    architecture: Architecture,
    *,
    source: str = "",
    extras: dict[str, Any] | None = None,
    check_input: Any = None,
    history: list | None = None,
) -> Path:
    """Write the converted model with self-describing metadata (atomic; replaces ``path``)."""
    path = Path(path)
    write_checkpoint(
        path, result.model, _metadata(result, architecture, source, check_input=check_input, history=history), extras
    )
    return path


def report_writers(result: ConvertResult, output: Path) -> dict[Path, Any]:
    """The JSON and Markdown reports of ``output``, as ``safewrite.write_files`` writers."""
    json_path, md_path = report_paths(output)
    return {
        json_path: lambda temp: temp.write_text(result.report.to_json() + "\n"),
        md_path: lambda temp: temp.write_text(result.report.to_markdown()),
    }


def write_conversion(
    result: ConvertResult,
    output: Path,
    architecture: Architecture,
    *,
    source: str = "",
    force: bool = False,
    extras: dict[str, Any] | None = None,
    check_input: Any = None,
    history: list | None = None,
    weights: str = "state_dict",
) -> tuple[Path, Path]:
    """The checkpoint (plus a training checkpoint's carried ``extras``) and its JSON and Markdown reports:
    all three written, or none changed."""
    reports = report_writers(result, output)
    write_files(
        {
            output: checkpoint_writer(
                output,
                result.model,
                _metadata(result, architecture, source, check_input=check_input, history=history, weights=weights),
                extras,
            ),
            **reports,
        },
        force=force,
    )
    json_path, md_path = reports
    return json_path, md_path


def write_model_directory(
    result: ConvertResult,
    directory: Path,
    architecture: Architecture,
    expected_keys: "set[str]",
    *,
    source: str = "",
    force: bool = False,
    check_input: Any = None,
    history: list | None = None,
) -> tuple[Path, Path]:
    """``-o DIR``: config.json, model.safetensors with the keys of the class config.json names (plus bnsurgeon's
    metadata) and the two reports, written as one unit; the directory is created only for them."""
    weights, config = directory / WEIGHTS_FILE, directory / CONFIG_FILE
    leave_out, counts = pretrained_layout(result.model, expected_keys)
    metadata = _metadata(result, architecture, source, check_input=check_input, history=history)
    if counts:
        metadata["counts"] = counts
    reports = report_writers(result, weights)
    text = dumps(architecture.kwargs["config"], indent=2, sort_keys=True) + "\n"
    write_into_directory(
        directory,
        {
            weights: checkpoint_writer(weights, result.model, metadata, leave_out=leave_out),
            config: lambda temp: temp.write_text(text),
            **reports,
        },
        force=force,
    )
    json_path, md_path = reports
    return json_path, md_path


def write_reports(result: ConvertResult, output: Path, *, force: bool = True) -> tuple[Path, Path]:
    """Only the two reports (atomic each)."""
    reports = report_writers(result, output)
    write_files(reports, force=force)
    json_path, md_path = reports
    return json_path, md_path
