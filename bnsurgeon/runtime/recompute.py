"""Activation checkpointing: a recomputed forward reuses the global statistics of its original.

``torch.utils.checkpoint`` (reentrant or not) and everything built on it (timm's
``set_grad_checkpointing``, Lightning, FSDP's activation checkpointing) run the forward of a
checkpointed segment a second time while the autograd engine runs the backward. A sync layer
that did its forward again would issue a second all_gather and update its running statistics
a second time (torch's SyncBatchNorm does both, pytorch#96136). Here:

- **Detection**: a forward is a recompute when it runs inside the autograd engine
  (``torch._C._current_graph_task_id() != -1``), which is where both checkpoint modes
  recompute. An ordinary forward never runs there.
- **The original forward** of a layer whose input the engine will not keep (grad disabled, as
  in the reentrant mode, or saved-tensor hooks active, as in the non-reentrant mode) leaves
  its global statistics in the layer's stash, with the local (count, mean, var) row as a
  fingerprint. A forward with grad enabled and no hooks stashes nothing: it is not
  checkpointed. An entry leaves the stash when a recompute takes it or its own backward runs;
  at most ``STASH_LIMIT`` wait per layer (the oldest is dropped).
- **The recompute** computes its local row (one pass, no collective), takes the oldest stashed
  entry with the same fingerprint (bit-equal: the recompute sees the same input) and
  normalizes with those statistics: no collective, no running-stat update, no call count.
  The search is by value, so one layer run on several checkpointed inputs (the backbone
  called once per view: BYOL, SimSiam, MoCo v3) and stale entries (a train-mode forward
  whose backward never ran: ``update_bn``, pseudo-labels under ``no_grad``) are found.
- **On devices** the host cannot compare fingerprints without a synchronization, and a device
  assert that picked an entry blindly killed the CUDA context whenever the order differed
  (view 2's backward runs first). So a device layer stashes nothing and every recompute
  synchronizes again, as below: every rank recomputes the same layers in the same order, so
  the merged statistics are the original forward's, bit for bit, at one collective more.
- **Not recognised** (a recompute with no stashed entry, e.g. a user's own scheme, or more
  than ``STASH_LIMIT`` pending calls): the recompute synchronizes again, with the same header
  on every rank, and leaves the running statistics alone. Outputs and gradients stay exact;
  it costs one more collective. A recompute scheme that does not run inside the autograd
  engine is an ordinary forward: exact outputs and gradients, one more collective and
  running-stat update, like plain BN.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import torch

STASH_LIMIT = 4


def recomputing() -> bool:
    """Whether this forward runs inside the autograd engine: a checkpoint recompute."""
    return torch._C._current_graph_task_id() != -1


def may_be_recomputed() -> bool:
    """Whether the engine will not keep this forward's inputs: grad off (reentrant checkpoint)
    or saved-tensor hooks active (non-reentrant checkpoint, offloading)."""
    if not torch.is_grad_enabled():
        return True
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


@dataclass(eq=False, repr=False)
class GlobalStats:
    """What a synchronized forward learned: enough to normalize and to run the backward.

    Compared by identity and shown without values: printing a device tensor reads it back to
    the host (a synchronization, and an error inside CUDA graph capture).
    """

    mean: torch.Tensor
    var: Optional[torch.Tensor]  # None on the CUDA path, whose kernels need only invstd
    invstd: torch.Tensor
    total: Any  # int on the host (CPU), else a (1,) tensor (the CUDA path: per-rank int32 counts)
    header: Optional[torch.Tensor]  # the forward row's header (None on the CUDA path: its backward sends none)
    fingerprint: Optional[torch.Tensor] = None

    def __repr__(self) -> str:
        channels = tuple(self.mean.shape) if isinstance(self.mean, torch.Tensor) else "?"
        return f"GlobalStats(channels={channels}, fingerprint={self.fingerprint is not None})"


class StatsStash:
    """A layer's global statistics waiting for their recompute, oldest first."""

    def __init__(self) -> None:
        self._entries: deque[GlobalStats] = deque(maxlen=STASH_LIMIT)

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, stats: GlobalStats) -> None:
        self._entries.append(stats)

    def discard(self, stats: GlobalStats) -> None:
        """Forget ``stats`` if it still waits. By identity, never ``deque.remove``: from Python 3.12
        a miss formats the value into its error, which printed device tensors on every backward."""
        for index, entry in enumerate(self._entries):
            if entry is stats:
                del self._entries[index]
                return

    def take(self, fingerprint: torch.Tensor) -> Optional[GlobalStats]:
        """The stashed statistics of the forward this recompute replays, or None (host values only)."""
        for entry in self._entries:
            stashed = entry.fingerprint
            if stashed is not None and stashed.shape == fingerprint.shape and torch.equal(stashed, fingerprint):
                self.discard(entry)
                return entry
        return None
