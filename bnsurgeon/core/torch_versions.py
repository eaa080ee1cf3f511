"""The torch releases bnsurgeon supports, and what differs between them: the one module that knows.

bnsurgeon runs on torch 2.4 (the floor ``pyproject.toml`` declares; ``docs/versions.md`` says why) up to the
newest release. Where torch changed how something is reached, ``FEATURES`` names the difference and the release
that brought the newer form; code asks ``has(name)`` (or calls a shim below) instead of testing ``hasattr`` or the
version itself (a test fails on any other module that does), so that raising the floor past a release means
deleting its lines here. A feature an older torch cannot do at all is refused in one line with its own exit
code (``require``): "X needs torch >= 2.7 (you have 2.4.1)", never an error that blames the user's input.
"""

from __future__ import annotations

import re
from typing import Any

#: the oldest torch bnsurgeon supports (pyproject.toml's torch>=)
FLOOR = (2, 4)

#: feature -> the torch release that brought it (what bnsurgeon uses where it exists)
FEATURES: dict[str, tuple[int, int]] = {
    # the weights_only unpickler refusing with pickle.UnpicklingError (2.4: RuntimeError; torch#132349)
    "weights_only_unpickling_error": (2, 5),
    # FSDP2's fully_shard as torch.distributed.fsdp.fully_shard (2.4, 2.5: torch.distributed._composable.fsdp)
    "fully_shard_public": (2, 6),
    # torch.onnx.export(..., dynamo=True) returning an ONNXProgram (2.4 has the older torch.onnx.dynamo_export)
    "onnx_dynamo_export": (2, 5),
    # torch.distributed.all_gather_single (all_gather_into_tensor, deprecated from 2.13, before)
    "all_gather_single": (2, 13),
    # the float8 scale type of MX formats, readable from a safetensors file (F8_E8M0)
    "float8_e8m0fnu": (2, 7),
    # packed 4-bit floats, readable from a safetensors file (F4)
    "float4_e2m1fn_x2": (2, 8),
}


def installed() -> tuple[int, int]:
    """(major, minor) of the torch installed (a local version such as 2.4.1+cu121 included)."""
    import torch

    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(match.group(1)), int(match.group(2))) if match else FLOOR


def installed_text() -> str:
    import torch

    return str(torch.__version__)


def has(feature: str) -> bool:
    """Whether the installed torch has ``feature`` (a key of ``FEATURES``)."""
    return installed() >= FEATURES[feature]


def needed(feature: str) -> str:
    major, minor = FEATURES[feature]
    return f"{major}.{minor}"


def require(feature: str, what: str) -> None:
    """Refuse ``what`` in one line (TorchTooOldError, exit 18) where the installed torch lacks ``feature``."""
    if has(feature):
        return
    from bnsurgeon.core.errors import TorchTooOldError

    raise TorchTooOldError(
        f"{what} needs torch >= {needed(feature)} (you have {installed_text()})",
        f"install torch >= {needed(feature)} (pip install -U torch), or leave this out",
    )


def weights_only_refusal() -> type[Exception]:
    """What torch's weights_only unpickler raises when it refuses a file, which torch.load's weights_only path
    reports as an UnpicklingError: UnpicklingError itself, RuntimeError on torch 2.4 (whatever its cause)."""
    import pickle

    return pickle.UnpicklingError if has("weights_only_unpickling_error") else RuntimeError


def flat_all_gather() -> Any:
    """torch's all_gather into one flat tensor: ``all_gather_single`` where it exists (``all_gather_into_tensor``
    is deprecated there and warns on every call), else ``all_gather_into_tensor``."""
    import torch.distributed as dist

    return dist.all_gather_single if has("all_gather_single") else dist.all_gather_into_tensor


def disable_compile(function: Any, reason: str) -> Any:
    """``torch.compiler.disable(function)``, with the reason dynamo quotes where this torch takes one (its
    signature is asked: the argument arrived after 2.4 without a release note to pin it to)."""
    import torch

    try:
        return torch.compiler.disable(function, reason=reason)
    except TypeError:
        return torch.compiler.disable(function)
