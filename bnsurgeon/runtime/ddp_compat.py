"""Let DistributedDataParallel wrap bnsurgeon's sync layers on CPU.

DDP refuses any ``nn.SyncBatchNorm`` instance when the model is on CPU, because
torch's own SyncBatchNorm cannot run there. bnsurgeon's layers subclass it (for
isinstance and state-dict compatibility) and do run on CPU/gloo, so the check is
narrowed: it still fires, unchanged, for torch's SyncBatchNorm and any other
subclass, and skips only bnsurgeon's layers. Installed once, on import of
``bnsurgeon.runtime``; a no-op if a torch version has no such check.
"""

from __future__ import annotations


def install() -> bool:
    """Wrap DDP's SyncBatchNorm device check; True if it is (now) in place."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    original = getattr(DistributedDataParallel, "_passing_sync_batchnorm_handle", None)
    if original is None:
        return False
    if getattr(original, "_bnsurgeon_wrapped", False):
        return True

    def passing_sync_batchnorm_handle(self, module):
        from bnsurgeon.runtime.layers import SyncBatchNorm

        foreign = any(
            isinstance(layer, nn.SyncBatchNorm) and not isinstance(layer, SyncBatchNorm) for layer in module.modules()
        )
        if foreign:
            return original(self, module)
        return None

    setattr(passing_sync_batchnorm_handle, "_bnsurgeon_wrapped", True)  # noqa: B010  (a function attribute)
    setattr(passing_sync_batchnorm_handle, "__wrapped__", original)  # noqa: B010
    setattr(DistributedDataParallel, "_passing_sync_batchnorm_handle", passing_sync_batchnorm_handle)  # noqa: B010
    return True
