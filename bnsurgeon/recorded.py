"""What a bnsurgeon checkpoint records about its model: architecture, classes, shared tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .architecture import Architecture
from .checkpoint import RawCheckpoint, expand_aliases, state_dict_candidates
from .fields import qualname
from .surgery import plan

if TYPE_CHECKING:
    import torch
    from torch import nn


def class_map(model: "nn.Module") -> dict[str, str]:
    """path -> class of every BN-family module (recorded so load can prove it rebuilt the same)."""
    return {path: qualname(type(entry.module)) for entry in plan(model) for path in entry.paths}


def state_from_checkpoint(raw: RawCheckpoint) -> dict[str, "torch.Tensor"]:
    candidates = state_dict_candidates(raw.obj)
    state = candidates.get("state_dict") or candidates.get("") or {}
    return expand_aliases(state, raw.bnsurgeon("aliases", {}) or {})


def architecture_from_checkpoint(raw: RawCheckpoint) -> Architecture:
    return Architecture.from_dict(raw.bnsurgeon("architecture", {}) or {})
