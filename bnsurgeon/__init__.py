"""bnsurgeon: exact BatchNorm surgery (sync / plain / frozen) for PyTorch and timm models.

The API is imported lazily so that ``bnsurgeon --help`` does not pay for torch/timm. The errors
are public here too (``from bnsurgeon import BnSurgeonError``): each subclass has the exit code
the CLI turns it into.
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
    "resolve_source": ("bnsurgeon.api", "resolve_source"),
    "ResolvedSource": ("bnsurgeon.api", "ResolvedSource"),
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
    "run_script": ("bnsurgeon.launch.script", "run_script"),
    "ScriptRaised": ("bnsurgeon.launch.script", "ScriptRaised"),
    "ScriptNotRunnable": ("bnsurgeon.launch.script", "ScriptNotRunnable"),
    "record_sync_gaps": ("bnsurgeon.launch.gaps", "record_sync_gaps"),
    "SyncGapRecording": ("bnsurgeon.launch.gaps", "SyncGapRecording"),
    # the errors a caller may catch: BnSurgeonError and its subclasses carry ``exit_code`` (the CLI's exit
    # status) and ``hint`` (the fix); the distributed ones are RuntimeErrors raised inside training
    "BnSurgeonError": ("bnsurgeon.core.errors", "BnSurgeonError"),
    "UsageError": ("bnsurgeon.core.errors", "UsageError"),
    "HookedModelError": ("bnsurgeon.core.errors", "HookedModelError"),
    "FactoryRaisedError": ("bnsurgeon.core.errors", "FactoryRaisedError"),
    "RuleRaisedError": ("bnsurgeon.core.errors", "RuleRaisedError"),
    "UnshippableModelError": ("bnsurgeon.core.errors", "UnshippableModelError"),
    "SourceNotFoundError": ("bnsurgeon.core.errors", "SourceNotFoundError"),
    "CheckpointError": ("bnsurgeon.core.errors", "CheckpointError"),
    "UnsafeCheckpointError": ("bnsurgeon.core.errors", "UnsafeCheckpointError"),
    "MetadataError": ("bnsurgeon.core.errors", "MetadataError"),
    "InputChangedError": ("bnsurgeon.core.errors", "InputChangedError"),
    "NonFiniteWeightsError": ("bnsurgeon.core.errors", "NonFiniteWeightsError"),
    "WeightsMismatchError": ("bnsurgeon.core.errors", "WeightsMismatchError"),
    "UnhandledModuleError": ("bnsurgeon.core.errors", "UnhandledModuleError"),
    "LazyModuleError": ("bnsurgeon.core.errors", "LazyModuleError"),
    "OutputError": ("bnsurgeon.core.errors", "OutputError"),
    "ModelCannotRunError": ("bnsurgeon.core.errors", "ModelCannotRunError"),
    "ConfirmationError": ("bnsurgeon.core.errors", "ConfirmationError"),
    "NothingToConvertError": ("bnsurgeon.core.errors", "NothingToConvertError"),
    "VerificationError": ("bnsurgeon.core.errors", "VerificationError"),
    "DataError": ("bnsurgeon.core.errors", "DataError"),
    "NotEnoughDataError": ("bnsurgeon.core.errors", "NotEnoughDataError"),
    "NonFiniteActivationsError": ("bnsurgeon.core.errors", "NonFiniteActivationsError"),
    "NoBatchNormReachedError": ("bnsurgeon.core.errors", "NoBatchNormReachedError"),
    "HostFailureError": ("bnsurgeon.core.errors", "HostFailureError"),
    "RankEndedError": ("bnsurgeon.core.errors", "RankEndedError"),
    "StatisticsOverflowError": ("bnsurgeon.core.errors", "StatisticsOverflowError"),
    "DistributedMismatchError": ("bnsurgeon.core.errors", "DistributedMismatchError"),
    "DistributedTimeoutError": ("bnsurgeon.core.errors", "DistributedTimeoutError"),
    "ReplicaFailedError": ("bnsurgeon.core.errors", "ReplicaFailedError"),
    "GraphCaptureError": ("bnsurgeon.core.errors", "GraphCaptureError"),
    "PreprocessorConfigError": ("bnsurgeon.core.errors", "PreprocessorConfigError"),
    "ShadowedModuleError": ("bnsurgeon.core.errors", "ShadowedModuleError"),
    "TorchTooOldError": ("bnsurgeon.core.errors", "TorchTooOldError"),
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
