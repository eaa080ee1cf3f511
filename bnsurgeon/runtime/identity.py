"""Which layer, which call: the header every sync-layer row carries, and its check.

The forward all_gather already sends one row per rank. Its first ``HEADER`` slots say
which layer sent it, so every rank sees every rank's layer at no extra collective and
no extra round trip, and ranks that reached different layers raise
``DistributedMismatchError`` instead of mixing their statistics:

    [id0, id1, id2, id3, channels, dtype, call, phase | count, mean(C), var(C)]   forward
    [id0, id1, id2, id3, channels, dtype, call, phase | 0, sum_dy(C), sum_term(C)] CPU backward

- ``id0..id3``: a 64-bit hash (blake2b) of the layer's name, in four 16-bit slots, so
  each is an integer that float32 represents exactly (float32 is exact only up to 2^24).
- ``channels`` and the input ``dtype`` code; ``call``: how many synchronized
  (train-mode) forwards this layer has run in this process (eval-mode forwards never
  sync, so they never count); ``phase``: 1 forward, 2 backward. The count is exact up
  to 2^24 calls of one layer in float32 statistics (2^53 in float64); past that, adding
  one no longer changes it, on every rank alike, so the slot stops telling extra calls
  apart but never reports a false mismatch. A CPU
  backward row has the same length as its forward row, so a rank in a backward that
  meets a rank in an extra forward is named too.
- The name is the module path (set at conversion and at ``bnsurgeon.load``); a layer
  built directly and never converted is named by class, width and construction order in
  its process (``SyncBatchNorm#3(64)``), the same on every rank that builds the same
  layers in the same order.
- An activation-checkpointing recompute reuses its original forward's statistics and sends
  nothing (recompute.py), so it does not count; when it is not recognised it synchronizes
  with the header of the last call, on every rank alike.

Rows can only be compared when they have the same size: ranks at layers of different
widths (or float64 against float32 statistics) send rows of different lengths, which
gloo reports by aborting the rank with the shorter row ("Received data size doesn't
match expected size"); no check inside a row can prevent that without a second
collective. ``BNSURGEON_SYNC_DEBUG=1`` adds that collective (``debug.py``): a fixed-size
header gather before every collective, which names those mismatches too.

On the CPU the comparison is a host read of the gathered header (the rows are on the
host already). On devices it is a device assert (``device_checks.device_assert``, no host synchronization): the
error surfaces at the device's next synchronization, names this rank's layer, and on
CUDA leaves the context unusable, as any device-side assert does.
"""

from __future__ import annotations

import hashlib
import itertools
import weakref

import torch

from bnsurgeon.core.errors import DistributedMismatchError, GraphCaptureError
from bnsurgeon.runtime import device_checks
from bnsurgeon.runtime.device_checks import device_assert, short_name
from bnsurgeon.runtime.recompute import StatsStash

HEADER = 8
FORWARD, BACKWARD = 1, 2
CALL_SLOT = 6
#: header slots hold integers float32 represents exactly
_SLOT_LIMIT = 2**24
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_PHASES = {FORWARD: "forward", BACKWARD: "backward"}

#: layer id -> name, for every layer named in this process (ranks hold the same model,
#: so a rank can name the layer another rank reports)
_names: dict[int, str] = {}
_construction_order = itertools.count()
#: token -> live identity, for the compiled path (sync_op.py), which passes layers as integers
_live: "weakref.WeakValueDictionary[int, LayerIdentity]" = weakref.WeakValueDictionary()
_tokens = itertools.count(1)


def layer_id(name: str) -> int:
    """Stable 64-bit identity of a layer name (the same in every process), registered for messages."""
    value = int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")
    _names[value] = name
    return value


def default_name(kind: str, num_features: int) -> str:
    """Name of a layer built directly: class, width, and its construction order in this process."""
    return f"{kind}#{next(_construction_order)}({num_features})"


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


class LayerIdentity:
    """A layer's name, its 64-bit id, the per-device header tensors holding its call count,
    its checkpoint stash, and the token that names it to the compiled path."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.id = layer_id(name)
        self._headers: dict = {}
        self.stash = StatsStash()
        self.token = next(_tokens)
        _live[self.token] = self

    def __getstate__(self):
        return {"name": self.name}

    def __setstate__(self, state) -> None:
        LayerIdentity.__init__(self, state["name"])

    def __deepcopy__(self, memo):
        return LayerIdentity(self.name)

    def next_header(self, x: torch.Tensor, stats_dtype: torch.dtype, advance: bool = True) -> torch.Tensor:
        """This call's forward header for input ``x``, on its device in ``stats_dtype`` (see ``header_for``)."""
        return self.header_for(x.device, x.dtype, x.shape[1], stats_dtype, advance)

    def header_for(
        self,
        device: torch.device,
        input_dtype: torch.dtype,
        channels: int,
        stats_dtype: torch.dtype,
        advance: bool = True,
    ) -> torch.Tensor:
        """This call's forward header, on ``device`` in ``stats_dtype``; advances the call count
        (``advance=False``: the last call's header, for an unrecognised recompute).

        Built on the device itself, once per layer and input kind (no host-to-device copy, which
        synchronizes and cannot be captured in a CUDA graph); each call then advances the count
        in place with one add (no host value, so graph replays advance it too).
        """
        key = (device, stats_dtype, input_dtype, channels)
        header = self._headers.get(key)
        if header is None:
            self._refuse_inside_capture(device, f"a new input kind ({channels} channels, {input_dtype})")
            slots = [(self.id >> shift) & 0xFFFF for shift in (48, 32, 16, 0)]
            slots += [channels % _SLOT_LIMIT, _dtype_code(input_dtype), 0, FORWARD]
            header = filled_on_device(slots, stats_dtype, device)
            self._headers[key] = header
        if advance:
            step = _STEPS.get((device, stats_dtype))
            if step is None:
                self._refuse_inside_capture(device, f"a new device or dtype ({device}, {stats_dtype})")
                step = _call_step(device, stats_dtype)
            header.add_(step)
        return header

    def _refuse_inside_capture(self, device: torch.device, what: str) -> None:
        """A device constant is about to be made: not inside CUDA graph capture, where it would be recorded."""
        if device_checks.capturing(device):
            raise GraphCaptureError(
                f"bnsurgeon: sync layer '{self.name}' met {what} inside CUDA graph capture, where its device "
                "constants would be recorded instead of made; run one eager training step with the same inputs "
                "before capturing (torch.cuda.graph's warm-up)"
            )


def filled_on_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of small integers made on ``device`` by fill kernels, never copied from the host."""
    with torch.inference_mode(False):  # a normal tensor, updatable in and out of inference mode
        tensor = torch.zeros(len(values), dtype=dtype, device=device)
        for index, value in enumerate(values):
            if value:
                tensor[index].fill_(value)
    return tensor


_STEPS: dict = {}


def _call_step(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The header increment: 1 in the call slot, 0 elsewhere (one per device and dtype)."""
    step = _STEPS.get((device, dtype))
    if step is None:
        step = _STEPS[(device, dtype)] = filled_on_device(
            [0] * CALL_SLOT + [1] + [0] * (HEADER - CALL_SLOT - 1), dtype, device
        )
    return step


def identity_for(token: int) -> "LayerIdentity":
    """The live identity a compiled graph names by its token."""
    return _live[token]


_BACKWARD_TAILS: dict = {}


def backward_header(forward_row: torch.Tensor) -> list[torch.Tensor]:
    """Pieces that start a CPU backward row: the forward's header with phase 2 and an empty count slot."""
    key = (forward_row.device, forward_row.dtype)
    tail = _BACKWARD_TAILS.get(key)
    if tail is None:
        tail = _BACKWARD_TAILS[key] = filled_on_device([BACKWARD, 0], forward_row.dtype, forward_row.device)
    return [forward_row[: HEADER - 1], tail]


def describe_header(header: torch.Tensor | list) -> str:
    """'name' forward call 3 (64 channels, float32) from one header row."""
    values = [int(v) for v in (header.tolist() if isinstance(header, torch.Tensor) else header)]
    ident = (values[0] << 48) | (values[1] << 32) | (values[2] << 16) | values[3]
    name = _names.get(ident, f"<unnamed layer id {ident:#018x}>") if ident else "<anonymous layer>"
    dtype = _DTYPES[values[5] - 1] if 0 < values[5] <= len(_DTYPES) else "unknown dtype"
    phase = _PHASES.get(values[7], f"phase {values[7]}")
    return f"'{name}' {phase} call {values[6]} ({values[4]} channels, {str(dtype).replace('torch.', '')})"


def mismatch_error(headers: torch.Tensor, group) -> DistributedMismatchError:
    """The error naming each rank's layer and call, from the gathered (W, HEADER) headers."""
    import torch.distributed as dist

    rows = headers.tolist()
    seen = []
    for group_rank, row in enumerate(rows):
        rank = dist.get_global_rank(group, group_rank) if group is not None else group_rank
        seen.append(f"rank {rank}: {describe_header(row)}")
    return DistributedMismatchError(
        "sync batch norm ranks are at different layers or calls: "
        + "; ".join(seen)
        + ". Every rank must run the same sync layers, in the same order, the same number of times in "
        "train mode (data-dependent control flow, or an extra train-mode forward on one rank?)."
    )


def check_headers(gathered: torch.Tensor, group, on_host: bool, layer_name: str) -> None:
    """Raise on every rank when the rows' headers differ; ``gathered`` is the (W, row) result."""
    headers = gathered[:, :HEADER]
    if on_host:
        if not torch.equal(headers, headers[:1].expand_as(headers)):
            raise mismatch_error(headers, group)
        return
    device_assert((headers == headers[:1]).all(), header_mismatch_message(layer_name))


def header_mismatch_message(layer_name: str) -> str:
    """What a device assert says when ranks met at different layers (within CUDA's message limit)."""
    return (
        f"bnsurgeon: sync layer '{short_name(layer_name)}' met other ranks at a different layer or call "
        "(rerun with BNSURGEON_SYNC_DEBUG=1 to name every rank's layer)"
    )
