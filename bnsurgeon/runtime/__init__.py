"""Runtime layers a converted model trains with: import cost is torch only."""

from bnsurgeon.runtime import ddp_compat
from bnsurgeon.runtime.debug import set_sync_debug
from bnsurgeon.runtime.distributed import DistributedInfo, init_distributed
from bnsurgeon.runtime.layers import FrozenBatchNorm, FrozenBatchNormAct, SyncBatchNorm, SyncBatchNormAct
from bnsurgeon.runtime.sync_function import SyncBatchNormFunction

ddp_compat.install()

__all__ = [
    "DistributedInfo",
    "FrozenBatchNorm",
    "FrozenBatchNormAct",
    "SyncBatchNorm",
    "SyncBatchNormAct",
    "SyncBatchNormFunction",
    "init_distributed",
    "set_sync_debug",
]
