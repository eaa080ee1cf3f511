"""bnsurgeon: exact BatchNorm surgery (sync / plain / frozen) for PyTorch and timm models.

The API is imported lazily so that ``bnsurgeon --help`` does not pay for torch/timm.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = {
    "convert": ("bnsurgeon.surgery.walk", "convert"),
    "ConvertResult": ("bnsurgeon.surgery.walk", "ConvertResult"),
    "convert_source": ("bnsurgeon.api", "convert_source"),
    "inspect": ("bnsurgeon.api", "inspect"),
    "load": ("bnsurgeon.api", "load"),
    "save": ("bnsurgeon.api", "save"),
    "compare_eval": ("bnsurgeon.api", "compare_eval"),
    "Rule": ("bnsurgeon.rules", "Rule"),
    "register_rule": ("bnsurgeon.rules", "register"),
    "init_distributed": ("bnsurgeon.runtime", "init_distributed"),
    "SyncBatchNorm": ("bnsurgeon.runtime", "SyncBatchNorm"),
    "SyncBatchNormAct": ("bnsurgeon.runtime", "SyncBatchNormAct"),
    "FrozenBatchNorm": ("bnsurgeon.runtime", "FrozenBatchNorm"),
    "FrozenBatchNormAct": ("bnsurgeon.runtime", "FrozenBatchNormAct"),
    "recalibrate": ("bnsurgeon.api", "recalibrate"),
    "recalibrate_source": ("bnsurgeon.api", "recalibrate_source"),
    "recalibrate_averaged": ("bnsurgeon.api", "recalibrate_averaged"),
    "RecalibrationReport": ("bnsurgeon.api", "RecalibrationReport"),
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    target = _API.get(name)
    if target is None:
        raise AttributeError(f"module 'bnsurgeon' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value
