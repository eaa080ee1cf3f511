"""Write a conversion: the checkpoint with self-describing metadata, and its two reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import __version__
from .architecture import Architecture
from .checkpoint import atomic_write, write_checkpoint
from .recorded import class_map
from .surgery import ConvertResult


def save(result: ConvertResult, path: "str | Path", architecture: Architecture, *, source: str = "",
         extras: dict[str, Any] | None = None) -> Path:
    """Write the converted model with self-describing metadata (atomic)."""
    path = Path(path)
    metadata = {
        "schema": 1,
        "version": __version__,
        "architecture": architecture.to_dict(),
        "target": result.report.target,
        "options": {k: v for k, v in result.report.options.items() if k != "inplace"},
        "classes": class_map(result.model),
        "source": source,
    }
    if result.report.fusion is not None:
        metadata["folds"] = result.report.fusion["folded"]
    write_checkpoint(path, result.model, metadata, extras)
    return path


def write_reports(result: ConvertResult, output: Path) -> tuple[Path, Path]:
    json_path = output.with_name(output.name + ".report.json")
    md_path = output.with_name(output.name + ".report.md")
    atomic_write(json_path, lambda temp: temp.write_text(result.report.to_json() + "\n"))
    atomic_write(md_path, lambda temp: temp.write_text(result.report.to_markdown()))
    return json_path, md_path
