"""Model outputs as a flat list of tensors, so any output structure can be compared."""

from __future__ import annotations

from typing import Any


def flatten_tensors(output: Any) -> list:
    """Tensors of ``output`` (a tensor, or dicts/lists/tuples of them) in a fixed order."""
    import torch

    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for value in output.values() for t in flatten_tensors(value)]
    if isinstance(output, (list, tuple)):
        return [t for value in output for t in flatten_tensors(value)]
    return []
