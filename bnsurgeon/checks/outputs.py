"""Model outputs as a flat list of tensors, so any output structure can be compared."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def flatten_tensors(output: Any) -> list:
    """Tensors of ``output`` (a tensor, or dicts/lists/tuples of them) in a fixed order."""
    return [tensor for _, tensor in named_tensors(output)]


def named_tensors(output: Any, prefix: str = "") -> "list[tuple[str, torch.Tensor]]":
    """(path, tensor) for each tensor of ``output``: ``logits``, ``hidden_states[2]``, ``[0].boxes``.

    A transformers ``ModelOutput`` is a dict holding only the fields that are set, so two outputs
    are lined up by these names, not by position: a field one side lacks is named, not compared
    with whatever came next.
    """
    import torch

    if isinstance(output, torch.Tensor):
        return [(prefix or "output", output)]
    if isinstance(output, dict):
        return [
            item
            for key, value in output.items()
            for item in named_tensors(value, f"{prefix}.{key}" if prefix else str(key))
        ]
    if isinstance(output, (list, tuple)):
        return [item for index, value in enumerate(output) for item in named_tensors(value, f"{prefix}[{index}]")]
    return []


def per_sample(output: Any, batch: int) -> "list[list] | None":
    """``output`` cut into ``batch`` samples, each a flat list of tensors; None when it is not per sample.

    Batch-first tensors (alone, in dicts, lists or tuples) are cut along their first
    dimension; a list of ``batch`` dicts (a detector's one result per image) is taken
    item by item. Anything else (a scalar loss, a tensor without the batch dimension)
    cannot be lined up sample by sample.
    """
    import torch

    if isinstance(output, torch.Tensor):
        if output.dim() and output.shape[0] == batch:
            return [[output[i]] for i in range(batch)]
        return None
    if isinstance(output, (list, tuple)) and len(output) == batch and all(isinstance(o, dict) for o in output):
        return [flatten_tensors(o) for o in output]
    if isinstance(output, dict):
        parts = [per_sample(value, batch) for value in output.values()]
    elif isinstance(output, (list, tuple)):
        parts = [per_sample(value, batch) for value in output]
        if any(part is None for part in parts) and len(output) == batch:
            return [flatten_tensors(o) for o in output]
    else:
        return [[] for _ in range(batch)]  # not a tensor: nothing to compare
    complete = [part for part in parts if part is not None]
    if len(complete) < len(parts):
        return None
    return [[t for part in complete for t in part[i]] for i in range(batch)]
