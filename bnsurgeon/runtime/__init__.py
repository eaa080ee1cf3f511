"""Runtime layers a converted model trains with: import cost is torch only."""

from .debug import set_sync_debug
from .distributed import DistributedInfo, init_distributed
from .layers import FrozenBatchNorm, FrozenBatchNormAct, SyncBatchNorm, SyncBatchNormAct
from .sync_function import SyncBatchNormFunction
from . import ddp_compat

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
