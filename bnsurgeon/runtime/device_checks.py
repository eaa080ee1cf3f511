"""What a device (CUDA) refuses that a CPU accepts: one door for device asserts and capture checks.

- ``device_assert``: ``torch._assert_async`` with a message CUDA accepts. torch's CUDA kernel
  checks on the host, at every launch, that the message is shorter than 255 bytes, whether the
  condition holds or not ("Message length must be smaller than 255"); the CPU kernel and meta
  tensors have no limit, so a long layer name passed every CPU test and raised on every GPU
  call. Every device assert in bnsurgeon goes through here (``tests/test_architecture.py``
  scans for others), and the message is cut to fit, keeping its start and its end.
- ``capturing``: whether the current CUDA stream is being captured into a graph. A persistent
  device constant (a layer's header, the call step) made during capture is recorded instead of
  run: it holds garbage for later eager calls and is re-made at every replay. The layers build
  them in their first eager step and refuse a first call inside capture (``GraphCaptureError``).
"""

from __future__ import annotations

import torch

#: CUDA refuses assert messages of 255 bytes or more (a host check at every launch)
ASSERT_MESSAGE_LIMIT = 254
_CUT = " ... "


def fit_assert_message(message: str, limit: int = ASSERT_MESSAGE_LIMIT) -> str:
    """``message`` within ``limit`` UTF-8 bytes: the start and the end kept, the middle elided."""
    encoded = message.encode("utf-8")
    if len(encoded) <= limit:
        return message
    room = limit - len(_CUT)
    head = encoded[: room * 3 // 5].decode("utf-8", "ignore")
    tail = encoded[len(encoded) - (room - len(head.encode("utf-8"))) :].decode("utf-8", "ignore")
    return head + _CUT + tail


def short_name(name: str, limit: int = 64) -> str:
    """A layer path for a device message: its last ``limit`` characters (the most specific part)."""
    return name if len(name) <= limit else "..." + name[-(limit - 3) :]


def device_assert(condition: torch.Tensor, message: str) -> None:
    """Assert ``condition`` on the device, with no host read; ``message`` cut to what CUDA accepts."""
    torch._assert_async(condition, fit_assert_message(message))


def capturing(device: torch.device) -> bool:
    """Whether work issued now on ``device`` is being captured into a CUDA graph instead of run."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
