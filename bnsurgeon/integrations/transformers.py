"""Hugging Face ``Trainer``: ``Trainer(model, args, ..., callbacks=[BNSurgeonCallback()])``.

Neither the Trainer nor accelerate synchronizes BatchNorm; their maintainers tell users to
call torch's ``convert_sync_batchnorm`` by hand, which drops timm's BatchNormAct2d
activation and refuses CPU tensors. The callback converts the Trainer's model in place with
bnsurgeon's rules when the Trainer is built (``on_init_end``, before ``train()`` wraps it in
DDP), so the sync layers run on the Trainer's process group (the default one, set up by
torchrun or accelerate; gloo on CPU, NCCL on GPUs). With gradient checkpointing the Trainer
turns off DDP's buffer broadcast; the statistics stay identical on every rank anyway, because
each sync layer computes them from the global batch (and a recomputed forward reuses them).
``sync_batchnorm(model)`` does the same for a script that builds its own loop.
"""

from __future__ import annotations

from typing import Any

from torch.nn import Module
from transformers import TrainerCallback

from bnsurgeon.surgery.walk import convert


def sync_batchnorm(model: Module, *, frozen: str = "keep", allow_unhandled: bool = False,
                   process_group: Any = None) -> Module:
    """Convert ``model`` in place to bnsurgeon's sync layers (the same object is returned)."""
    return convert(model, "sync", frozen=frozen, allow_unhandled=allow_unhandled, process_group=process_group,
                   inplace=True).model


class BNSurgeonCallback(TrainerCallback):
    """Synchronize the Trainer's BN-family layers (``frozen="unfreeze"`` also trains frozen BN)."""

    def __init__(self, frozen: str = "keep", allow_unhandled: bool = False, process_group: Any = None) -> None:
        self.frozen = frozen
        self.allow_unhandled = allow_unhandled
        self.process_group = process_group
        self.converted = 0

    def on_init_end(self, args, state, control, model: Module | None = None, **kwargs):  # noqa: ANN001 - HF's signature
        if model is not None:
            result = convert(model, "sync", frozen=self.frozen, allow_unhandled=self.allow_unhandled,
                             process_group=self.process_group, inplace=True)
            self.converted = len(result.report.changed)
        return control
