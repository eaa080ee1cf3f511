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
  sync, so they never count); ``phase``: 1 forward, 2 backward, 3 the compiled path's backward (it sums
  other quantities than the eager one, so a compiled rank and an eager one never meet). The count is exact up
  to 2^24 calls of one layer in float32 statistics (2^53 in float64); past that, adding
  one no longer changes it, on every rank alike, so the slot stops telling extra calls
  apart but never reports a false mismatch. A CPU
  backward row has the same length as its forward row, so a rank in a backward that
  meets a rank in an extra forward is named too.
- The name is the module path where every rank gives the same one: set at conversion and at
  ``bnsurgeon.load``. A layer with no such path (built directly, or a torch layer that ``bnsurgeon run``
  adopted) is named at its first synchronized call by what the ranks run in sync, never by what one rank
  did before (built more layers, ran one in eval mode, adopted it earlier): eagerly, its path in the
  outermost module running it (``Net.layer1.0.bn1``, read from the modules on the call stack); where no
  module runs it or the call is compiled, its place among the layers that first synchronized over its
  group (the 3rd). Until then it has a name of its own process for messages (``SyncBatchNorm#3(64)``).
- A mismatch found on the host names every rank's layer by that rank's own name: all ranks found it at
  the same collective, so one more small gather of the names is safe there (and costs nothing otherwise).
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
import os
import sys
import weakref
from typing import Any

import torch

from bnsurgeon.core.errors import DistributedMismatchError, GraphCaptureError
from bnsurgeon.runtime import device_checks
from bnsurgeon.runtime.device_checks import device_assert, short_name
from bnsurgeon.runtime.recompute import StatsStash

HEADER = 8
FORWARD, BACKWARD = 1, 2
#: the compiled path's backward sums the statistics' gradients, the eager one the kernel's sums: another row
COMPILED_BACKWARD = 3
CALL_SLOT = 6
#: header slots hold integers float32 represents exactly
_SLOT_LIMIT = 2**24
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_PHASES = {FORWARD: "forward", BACKWARD: "backward", COMPILED_BACKWARD: "compiled backward"}

#: layer id -> name, for every layer named in this process (ranks hold the same model,
#: so a rank can name the layer another rank reports)
_names: dict[int, str] = {}
_construction_order = itertools.count()
#: token -> live identity, for the compiled path (sync_op.py), which passes layers as integers
_live: "weakref.WeakValueDictionary[int, LayerIdentity]" = weakref.WeakValueDictionary()
_tokens = itertools.count(1)
#: ranks of a group -> how many layers first synchronized over it in this process (names where no path is known)
_first_syncs: dict[tuple[int, ...], int] = {}
#: a module that ran layers -> {id(layer): path} of its modules (the paths are read once per module)
_paths: "weakref.WeakKeyDictionary[Any, dict[int, str]]" = weakref.WeakKeyDictionary()


def layer_id(key: str, name: str | None = None) -> int:
    """Stable 64-bit identity of a layer's key (the same in every process), registered with its name for
    messages (``name``, else the key itself)."""
    value = int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little")
    _names[value] = name or key
    return value


def running_path(layer: Any, frame: Any) -> str | None:
    """``Root.path.to.layer``: the layer's path in the outermost module that is running it, read from the
    modules on the call stack from ``frame`` up (each module call's frame has it as ``self``); None where no
    module running holds it. The ranks run the same modules in sync, so they read the same path, whatever else
    each built or ran before. A module's paths are read once."""
    from torch import nn

    running: list[Any] = []
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and owner is not layer and (not running or running[-1] is not owner):
                running.append(owner)
        frame = frame.f_back
    for root in reversed(running):
        path = _path_in(root, layer)
        if path is not None:
            return _named(root, path)
    return None


#: the attributes through which wrappers hold the model they run (DDP's ``module``, torch.compile's ``_orig_mod``)
_WRAPPED = ("module", "_orig_mod")


def _named(root: Any, path: str) -> str:
    """``Root.path``, a wrapper's path named by what it wraps (the same whether a rank runs it wrapped or not)."""
    from torch import nn

    unwrapped = True
    while unwrapped:
        unwrapped = False
        for attribute in _WRAPPED:
            inner = getattr(root, attribute, None)
            if path.startswith(attribute + ".") and isinstance(inner, nn.Module):
                root, path, unwrapped = inner, path[len(attribute) + 1 :], True
    return f"{type(root).__name__}.{path}"


def fix_running_layers(frame: Any) -> None:
    """Every layer not named yet, in the modules on the call stack from ``frame`` up, named as its first eager
    synchronized call would name it (its path in the outermost of them). Called as ``torch.compile`` starts
    compiling, outside the trace (the compiled path reads no stack): a layer run compiled on one rank and eagerly on
    another has one name, and layers of equal width keep apart by their paths."""
    from torch import nn

    running: list[Any] = []
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and not any(owner is seen for seen in running):
                running.append(owner)
        frame = frame.f_back
    for root in reversed(running):
        for path, module in root.named_modules():
            identity = module.__dict__.get("_identity")
            if path and isinstance(identity, LayerIdentity) and not identity.fixed:
                identity._fix(_named(root, path), _named(root, path))


def held_as(layer: Any, frame: Any) -> str | None:
    """How the code that calls ``layer`` outside any module holds it: its path in a module that a local variable
    of the nearest calling frame outside torch and bnsurgeon holds (``ModuleDict.first``), else its place in a local
    list, tuple or dict (``layers[1]``), else that variable's name; None where that frame has none of them. The
    ranks run the same code, so they read the same."""
    from torch import nn

    skipped = (_TORCH_DIR, _PACKAGE_DIR)
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame = frame.f_back
    if frame is None:
        return None
    named = held = None
    for name, value in frame.f_locals.items():
        if value is layer:
            named = named or name
        elif isinstance(value, nn.Module):
            path = _path_in(value, layer)
            if path is not None:
                return f"{type(value).__name__}.{path}"
        elif held is None and isinstance(value, (list, tuple)):
            index = next((index for index, item in enumerate(value) if item is layer), None)
            held = None if index is None else f"{name}[{index}]"
        elif held is None and isinstance(value, dict):
            key = next((key for key, item in value.items() if item is layer and isinstance(key, (str, int))), None)
            held = None if key is None else f"{name}[{key!r}]"
    return held or named


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _path_in(root: Any, layer: Any) -> str | None:
    paths = _paths.get(root)
    path = None if paths is None else paths.get(id(layer))
    if path is not None and root.get_submodule(path) is layer:
        return path
    _paths[root] = paths = {id(module): name for name, module in root.named_modules() if name}
    return paths.get(id(layer))


def _group_ranks(group) -> tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def default_name(kind: str, num_features: int) -> str:
    """Name of a layer built directly: class, width, and its construction order in this process."""
    return f"{kind}#{next(_construction_order)}({num_features})"


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


class LayerIdentity:
    """A layer's name, its 64-bit id, the per-device header tensors holding its call count,
    its checkpoint stash, and the token that names it to the compiled path.

    ``fixed=True``: ``name`` is the same on every rank (a module path given at conversion or load).
    ``fixed=False``: ``name`` is this process's own (``SyncBatchNorm#3(64)``), for messages, until the
    layer's first synchronized call fixes the name every rank sends (``fix``; ``header_for`` on the
    compiled path, where no call stack is read)."""

    def __init__(self, name: str, fixed: bool = True) -> None:
        self.name = name
        self.own_name = name  # what a copy starts from
        self.given = fixed  # the name was given (a path), not fixed by a run
        self.fixed = fixed
        self.id = layer_id(name) if fixed else 0
        self._headers: dict = {}
        self.stash = StatsStash()
        self.token = next(_tokens)
        _live[self.token] = self

    def __getstate__(self):
        return {"name": self.own_name, "fixed": self.given}

    def __setstate__(self, state) -> None:
        LayerIdentity.__init__(self, state["name"], state.get("fixed", True))

    def __deepcopy__(self, memo):
        """A copy (an EMA) is another layer: a name that a run fixed is fixed again by what the copy runs."""
        return LayerIdentity(self.own_name, self.given)

    def fix(self, layer: Any, group) -> None:
        """Name the layer at its first synchronized call by what the ranks run in sync: its path in the
        outermost module on the call stack that holds it, else its place among the layers first synchronized
        over ``group``. Never by what this rank did before (built, adopted, ran in eval mode)."""
        if self.fixed:
            return
        caller = sys._getframe(1)
        path = running_path(layer, caller)
        if path is not None:
            self._fix(path, path)
        else:
            self._fix_by_place(group, held_as(layer, caller))

    def _fix_by_place(self, group, held: str | None = None) -> None:
        """Named by its place among the layers first synchronized over ``group`` (the same on ranks that run the
        same layers in sync), and by what holds it where it is called (``held``), where that is known."""
        ranks = _group_ranks(group)
        place = _first_syncs[ranks] = _first_syncs.get(ranks, 0) + 1
        where = f"the {_ordinal(place)} layer to synchronize over ranks {list(ranks)}"
        key = where if held is None else f"{held} ({where})"
        self._fix(f"{held or self.own_name} ({where})", key)

    def _fix(self, name: str, key: str) -> None:
        self.name = name
        self.id = layer_id(key, name)
        self.fixed = True
        self._headers.clear()

    def next_header(
        self, x: torch.Tensor, stats_dtype: torch.dtype, advance: bool = True, group: Any = None
    ) -> torch.Tensor:
        """This call's forward header for input ``x``, on its device in ``stats_dtype`` (see ``header_for``)."""
        return self.header_for(x.device, x.dtype, x.shape[1], stats_dtype, advance, group)

    def header_for(
        self,
        device: torch.device,
        input_dtype: torch.dtype,
        channels: int,
        stats_dtype: torch.dtype,
        advance: bool = True,
        group: Any = None,
    ) -> torch.Tensor:
        """This call's forward header, on ``device`` in ``stats_dtype``; advances the call count
        (``advance=False``: the last call's header, for an unrecognised recompute). A name not fixed yet
        (the compiled path reads no call stack) is fixed here by the layer's place among those first
        synchronized over ``group``.

        Built on the device itself, once per layer and input kind (no host-to-device copy, which
        synchronizes and cannot be captured in a CUDA graph); each call then advances the count
        in place with one add (no host value, so graph replays advance it too).
        """
        if not self.fixed:
            self._fix_by_place(group)
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


def backward_header(forward_row: torch.Tensor, phase: int = BACKWARD) -> list[torch.Tensor]:
    """Pieces that start a CPU backward row: the forward's header with the backward's phase (``BACKWARD``, or
    ``COMPILED_BACKWARD``, whose sums are other quantities: a compiled rank never sums with an eager one) and an
    empty count slot."""
    key = (forward_row.device, forward_row.dtype, phase)
    tail = _BACKWARD_TAILS.get(key)
    if tail is None:
        tail = _BACKWARD_TAILS[key] = filled_on_device([phase, 0], forward_row.dtype, forward_row.device)
    return [forward_row[: HEADER - 1], tail]


def describe_header(header: torch.Tensor | list, name: str | None = None) -> str:
    """'name' forward call 3 (64 channels, float32) from one header row (``name``: the layer's, where known)."""
    values = [int(v) for v in (header.tolist() if isinstance(header, torch.Tensor) else header)]
    ident = (values[0] << 48) | (values[1] << 32) | (values[2] << 16) | values[3]
    if name is None:
        name = _names.get(ident, f"a layer this rank has not run (id {ident:#018x})") if ident else "<anonymous layer>"
    dtype = _DTYPES[values[5] - 1] if 0 < values[5] <= len(_DTYPES) else "unknown dtype"
    phase = _PHASES.get(values[7], f"phase {values[7]}")
    return f"'{name}' {phase} call {values[6]} ({values[4]} channels, {str(dtype).replace('torch.', '')})"


#: bytes of a layer's name in the gather that names every rank's layer after a mismatch
_NAME_BYTES = 240


def _every_ranks_name(headers: torch.Tensor, group) -> list[str | None]:
    """Each rank's own name for the layer in its row, gathered: every rank found the mismatch at the same
    collective, so all of them make this one more (small, bounded) gather, and each names its own layer as only
    it can (another rank may never have run that layer). None for a rank whose name did not come through."""
    import torch.distributed as dist

    from bnsurgeon.runtime.collectives import all_gather_rows

    world_size = headers.shape[0]
    mine = headers[dist.get_rank(group)].tolist()
    ident = (int(mine[0]) << 48) | (int(mine[1]) << 32) | (int(mine[2]) << 16) | int(mine[3])
    text = _names.get(ident, "").encode("utf-8")[:_NAME_BYTES]
    row = torch.zeros(_NAME_BYTES + 1, dtype=torch.uint8, device=headers.device)
    row[0] = len(text)
    row[1 : 1 + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    try:
        rows = all_gather_rows(row, world_size, group).cpu().tolist()
    except Exception:  # the names are a courtesy of the error: the mismatch is raised whatever happens here
        return [None] * world_size
    names = [bytes(values[1 : 1 + values[0]]).decode("utf-8", "replace") for values in rows]
    return [name or None for name in names]


def mismatch_error(headers: torch.Tensor, group, name_ranks: bool = False) -> DistributedMismatchError:
    """The error naming each rank's layer and call, from the gathered (W, HEADER) headers. ``name_ranks``: every
    rank of ``group`` is raising it at this collective, so each rank's own name for its layer is gathered."""
    import torch.distributed as dist

    rows = headers.tolist()
    names = _every_ranks_name(headers, group) if name_ranks else [None] * len(rows)
    seen = []
    for group_rank, row in enumerate(rows):
        rank = dist.get_global_rank(group, group_rank) if group is not None else group_rank
        seen.append(f"rank {rank}: {describe_header(row, names[group_rank])}")
    phases = {int(row[7]) for row in rows}
    mixed = (
        " One rank runs this layer compiled and another eagerly, whose backwards sum different quantities: compile "
        "it on every rank or on none."
        if phases == {BACKWARD, COMPILED_BACKWARD}
        else ""
    )
    return DistributedMismatchError(
        "sync batch norm ranks are at different layers or calls: "
        + "; ".join(seen)
        + ". Every rank must run the same sync layers, in the same order, the same number of times in "
        "train mode (data-dependent control flow, or an extra train-mode forward on one rank?)." + mixed
    )


def check_headers(gathered: torch.Tensor, group, on_host: bool, layer_name: str) -> None:
    """Raise on every rank when the rows' headers differ; ``gathered`` is the (W, row) result."""
    headers = gathered[:, :HEADER]
    if on_host:
        if not torch.equal(headers, headers[:1].expand_as(headers)):
            raise mismatch_error(headers, group, name_ranks=True)
        return
    device_assert((headers == headers[:1]).all(), header_mismatch_message(layer_name))


def header_mismatch_message(layer_name: str) -> str:
    """What a device assert says when ranks met at different layers (within CUDA's message limit)."""
    return (
        f"bnsurgeon: sync layer '{short_name(layer_name)}' met other ranks at a different layer or call "
        "(rerun with BNSURGEON_SYNC_DEBUG=1 to name every rank's layer)"
    )
