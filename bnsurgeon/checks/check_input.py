"""The input every check feeds a model, as a structure of shapes (values are seeded noise).

Three structures cover the models BN surgery meets: a batch-first tensor (classifiers,
segmentation), a list of per-sample tensors (torchvision detection: ``model([img, ...])``)
and a dict of batch-first tensors. The structure is inferred from the first conv the model
actually reaches, or read from an ``--example-input`` file (loaded with
``weights_only=True``), and recorded in the written checkpoint so later conversions of the
file reuse it. What is read from a file or from metadata is untrusted: it is validated
here before it sizes any tensor.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bnsurgeon.core.errors import CheckpointError, ModelCannotRunError, UsageError
from bnsurgeon.core.layout import counted, shown

if TYPE_CHECKING:
    import torch
    from torch import nn

KINDS = ("tensor", "list", "dict")
MAX_ENTRIES = 64  # samples of a list, keys of a dict
MAX_DIMS = 6
MAX_SIDE = 1 << 14
MAX_ELEMENTS = 1 << 26  # per check batch: 64M values, 256 MiB in float32
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


@dataclass(frozen=True)
class CheckInput:
    """``kind`` tensor: ``shapes == ((N, *S),)``; list: one shape per sample; dict: ``((key, (N, *S)), ...)``."""

    kind: str
    shapes: tuple

    # -- construction -------------------------------------------------------------------
    @classmethod
    def of_shape(cls, shape: "tuple[int, ...] | CheckInput") -> "CheckInput":
        if isinstance(shape, CheckInput):
            return shape
        return cls("tensor", (tuple(int(side) for side in shape),))

    @classmethod
    def from_record(cls, data: Any, origin: str = "the checkpoint metadata") -> "CheckInput":
        """Rebuild from ``to_record()`` output read from an untrusted file, validating every field.

        An empty ``origin`` gives the bare reason (the caller names the file and field)."""

        def bad(why: str) -> CheckpointError:
            return CheckpointError(
                f"{origin}: recorded check input is invalid ({why})" if origin else why,
                "pass --input-shape or --example-input to override it",
            )

        if not isinstance(data, dict) or data.get("kind") not in KINDS or not isinstance(data.get("shapes"), list):
            raise bad("expected {kind: tensor|list|dict, shapes: [...]}")
        kind, raw = data["kind"], data["shapes"]
        try:
            if kind == "dict":
                shapes: tuple = tuple((key, _valid_shape(shape)) for key, shape in raw)
                if any(not isinstance(key, str) or not _KEY.match(key) for key, _ in shapes):
                    raise ValueError("dict keys must be identifiers")
            else:
                shapes = tuple(_valid_shape(shape) for shape in raw)
        except (TypeError, ValueError) as error:
            raise bad(str(error)) from None
        try:
            result = cls(kind, shapes)
            result.validate()
        except UsageError as error:
            raise bad(error.message) from None
        if total_elements(result) > MAX_ELEMENTS:  # refused before anything is allocated: a memory bomb otherwise
            raise bad(f"{total_elements(result):,} values, at most {MAX_ELEMENTS:,}")
        return result

    def recordable(self) -> bool:
        """Whether ``from_record`` reads this back: a file must never record what it refuses on load."""
        try:
            CheckInput.from_record(self.to_record())
        except CheckpointError:
            return False
        return True

    def to_record(self) -> dict[str, Any]:
        if self.kind == "dict":
            return {"kind": "dict", "shapes": [[key, list(shape)] for key, shape in self.shapes]}
        return {"kind": self.kind, "shapes": [list(shape) for shape in self.shapes]}

    def validate(self) -> "CheckInput":
        if self.kind not in KINDS or not self.shapes or len(self.shapes) > MAX_ENTRIES:
            raise UsageError(
                f"check input must be a tensor, or a list/dict of 1-{MAX_ENTRIES} tensors",
                "save one tensor, a list of per-sample tensors, or a dict of batch-first tensors",
            )
        if self.kind == "tensor" and len(self.shapes) != 1:
            raise UsageError("a tensor check input has exactly one shape", "save one tensor")
        shapes = [shape for _, shape in self.shapes] if self.kind == "dict" else list(self.shapes)
        if self.kind != "list" and any(len(shape) < 1 for shape in shapes):
            raise UsageError("batch-first tensors need at least one dimension", "give the batch dimension first")
        if self.kind == "dict" and len({shape[0] for shape in shapes}) != 1:
            raise UsageError(
                "the tensors of a dict check input must share the batch size (first dimension)",
                "give every tensor the same first dimension",
            )
        if self.kind != "list" and shapes[0][0] < 1:
            raise UsageError("the check input needs at least one sample", "give a batch of at least 1")
        if self.kind == "list" and any(len(shape) < 1 for shape in shapes):
            raise UsageError(
                "each sample of a list check input is a tensor with at least one dimension",
                "save per-sample tensors such as images of shape (3, H, W)",
            )
        empty = next((shape for shape in shapes if 0 in shape), None)
        if empty is not None:  # nothing for a model to compute on: every check would fail on the model's error
            raise UsageError(
                f"a check input of shape {tuple(empty)} holds no values", "give every dimension a size of at least 1"
            )
        return self

    # -- what it describes ---------------------------------------------------------------
    @property
    def batch(self) -> int:
        if self.kind == "list":
            return len(self.shapes)
        first = self.shapes[0][1] if self.kind == "dict" else self.shapes[0]
        return int(first[0])

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The tensor shape (tensor kind only; reports and the spatial-size retry use it)."""
        return self.shapes[0] if self.kind == "tensor" else None

    def describe(self) -> str:
        if self.kind == "tensor":
            return str(tuple(self.shapes[0]))
        if self.kind == "list":
            distinct = sorted(set(self.shapes))
            inner = ", ".join(str(s) for s in distinct[:3]) + (", ..." if len(distinct) > 3 else "")
            return f"list of {counted(len(self.shapes), 'sample')} {inner}"
        return "dict {" + ", ".join(f"{key}: {tuple(shape)}" for key, shape in self.shapes) + "}"

    def with_batch(self, batch: int, *, uniform: bool = False) -> "CheckInput":
        """The same structure with ``batch`` samples (list samples cycle; ``uniform``: all the first's shape)."""
        if self.kind == "tensor":
            return CheckInput("tensor", ((batch, *self.shapes[0][1:]),))
        if self.kind == "dict":
            return CheckInput("dict", tuple((key, (batch, *shape[1:])) for key, shape in self.shapes))
        return CheckInput("list", tuple(self.shapes[0 if uniform else i % len(self.shapes)] for i in range(batch)))

    # -- values ----------------------------------------------------------------------------
    def make(
        self,
        *,
        seed: int = 0,
        generator: "torch.Generator | None" = None,
        dtype: "torch.dtype | None" = None,
        device: "torch.device | str | None" = None,
    ) -> Any:
        """Seeded standard-normal values in this structure."""
        import torch

        generator = generator or torch.Generator().manual_seed(seed)
        dtype = dtype or torch.float32
        self._refuse_oversized()

        def noise(shape):
            try:
                return torch.randn(tuple(shape), generator=generator, dtype=torch.float64).to(
                    device=device, dtype=dtype
                )
            except (RuntimeError, MemoryError) as error:
                raise ModelCannotRunError(
                    f"cannot allocate the check input {self.describe()}: {str(error).strip()[:200]}",
                    "pass a smaller --input-shape",
                ) from None

        if self.kind == "tensor":
            return noise(self.shapes[0])
        if self.kind == "list":
            return [noise(shape) for shape in self.shapes]
        return {key: noise(shape) for key, shape in self.shapes}

    def _refuse_oversized(self) -> None:
        """Refused, not attempted: an allocation beyond physical memory can take the machine down with it."""
        from bnsurgeon.files.reading import physical_memory

        needed = total_elements(self) * 8  # drawn in float64, then cast
        physical = physical_memory()
        if physical is not None and needed > physical:
            raise ModelCannotRunError(
                f"the check input {self.describe()} needs {needed / 2**30:,.1f} GiB, more than this machine's "
                f"{physical / 2**30:,.1f} GiB of memory",
                "pass a smaller --input-shape (the batch and spatial size do not change which BN code runs)",
            )

    def split(self, value: Any, sizes: list[int]) -> list[Any]:
        """A value of this structure cut into consecutive per-rank pieces of ``sizes`` samples."""
        pieces, start = [], 0
        for size in sizes:
            rows = slice(start, start + size)
            if self.kind == "tensor":
                pieces.append(value[rows])
            elif self.kind == "list":
                pieces.append(list(value[rows]))
            else:
                pieces.append({key: tensor[rows] for key, tensor in value.items()})
            start += size
        return pieces


def _valid_shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS:
        raise ValueError(f"a shape is a list of at most {MAX_DIMS} integers")
    if not all(isinstance(side, int) and not isinstance(side, bool) and 0 <= side <= MAX_SIDE for side in shape):
        raise ValueError(f"every side is an integer in 0..{MAX_SIDE}")
    return tuple(shape)


def clone_value(value: Any) -> Any:
    """A fresh copy of a check-input value (models may modify their input in place)."""
    if isinstance(value, list):
        return [item.clone() for item in value]
    if isinstance(value, dict):
        return {key: item.clone() for key, item in value.items()}
    return value.clone()


def cast_value(value: Any, device=None, dtype=None) -> Any:
    """``value``'s tensors (nested in lists, tuples, dicts) on ``device``, floating ones in ``dtype`` (either None:
    kept)."""
    import torch

    if device is None and dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype if dtype is not None and value.is_floating_point() else None)
    if isinstance(value, dict):
        return {key: cast_value(item, device, dtype) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cast_value(item, device, dtype) for item in value)
    return value


def leaves(value: Any) -> list:
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return list(value.values())
    return [value]


def total_elements(check_input: CheckInput) -> int:
    import math

    shapes = [shape for _, shape in check_input.shapes] if check_input.kind == "dict" else check_input.shapes
    return sum(math.prod(shape) for shape in shapes)


def load_example_input(path: "str | os.PathLike") -> CheckInput:
    """``--example-input x.pt``: a tensor, a list of tensors or a dict of tensors, read without running code.

    Only the structure (shapes) is kept: the checks feed seeded noise of those shapes, in
    the model's dtype, so that a recorded check input reproduces exactly.
    """
    import pickle
    import warnings

    from bnsurgeon.core.errors import CheckpointError, first_line
    from bnsurgeon.core.paths import check_reachable
    from bnsurgeon.files.reading import (
        UNSUPPORTED_GLOBAL,
        refuse_compressed_records,
        refuse_dtypes_this_torch_lacks,
        unpickler_refusal,
        unsupported_global,
    )
    from bnsurgeon.files.torch_pickle import load_weights_only

    check_reachable(path, "--example-input", UsageError, "pass a file of this machine with a shorter path")
    path = Path(path)
    flag = f"--example-input {path}"
    save_hint = "save it with torch.save(x, 'x.pt'): a tensor, a list of tensors or a dict of str -> tensor"
    if path.is_dir():
        raise UsageError(f"{flag} is a directory, not a file", "pass the .pt file inside it")
    if not path.exists():
        raise UsageError(f"{flag}: no such file", "save one with torch.save(x, 'x.pt')")
    if not path.is_file():
        raise UsageError(f"{flag} is not a regular file (a device, pipe or socket)", save_hint)
    if path.stat().st_size == 0:
        raise UsageError(f"{flag} is empty", save_hint)
    with open(path, "rb") as stream:
        head = stream.read(9)
    if len(head) == 9 and head[8:9] == b"{":  # a safetensors header: 8-byte length, then JSON
        raise UsageError(
            f"{flag} is a .safetensors file; example inputs are read from torch.save files",
            'python -c "import torch; from safetensors.torch import load_file; '
            f"torch.save(load_file('{path}'), 'x.pt')\" and pass x.pt",
        )
    try:  # the bounds every file bnsurgeon reads goes through: a deflated pickle record would inflate in memory
        refuse_compressed_records(path, flag)
    except CheckpointError as error:
        raise UsageError(error.message, error.hint) from None
    try:
        with warnings.catch_warnings():  # torch's notes on pickle protocols and sparse checks: not the user's line
            warnings.simplefilter("ignore")
            value = load_weights_only(path, map_location="meta")  # torch's allow-list as the program left it
    except CheckpointError as error:  # a TorchScript archive, torch's legacy tar format
        raise UsageError(error.message, save_hint) from None
    except pickle.UnpicklingError as error:
        refuse_dtypes_this_torch_lacks(path, flag)  # a dtype of a newer torch: exit 18, not "would run code"
        text = str(error)
        why = (
            unsupported_global(text) + ", which would run code"
            if UNSUPPORTED_GLOBAL.search(text)
            else unpickler_refusal(text)
        )
        raise UsageError(
            f"{flag} is not a plain tensor file ({why})",
            "save only tensors, lists or dicts of tensors: torch.save(x, 'x.pt')",
        ) from None
    except Exception as error:  # truncated or not a torch file
        refuse_dtypes_this_torch_lacks(path, flag)
        raise UsageError(f"{flag} cannot be read ({first_line(error, 'unknown error')[:120]})", save_hint) from None
    structure = _structure_of(value, str(path))
    _refuse_more_than_the_file_holds(value, path, flag)
    return structure


def _refuse_more_than_the_file_holds(value: Any, path: Path, flag: str) -> None:
    """The checks allocate noise of the shapes an example declares: a small file must not declare big
    tensors. Saved values take their bytes in the file, so every tensor's values together fit in it;
    an expanded view (stride 0), many views of one storage, or compressed records declare more."""
    items = list(value) if isinstance(value, (list, tuple)) else leaves(value)
    declared = sum(leaf.numel() * leaf.element_size() for leaf in items)
    size = path.stat().st_size
    if declared > size:
        raise UsageError(
            f"{flag} declares {declared:,} bytes of values but the file holds {size:,} bytes "
            "(expanded or shared views, or compressed records)",
            "save the example itself: torch.save(x.clone(), 'x.pt')",
        )


def _structure_of(value: Any, origin: str) -> CheckInput:
    import torch

    def tensor_shape(item: Any, where: str) -> tuple[int, ...]:
        if not isinstance(item, torch.Tensor):
            raise UsageError(
                f"--example-input {origin}: {where} is a {type(item).__name__}, not a tensor",
                "save a tensor, a list of tensors, or a dict of str -> tensor",
            )
        if not item.is_floating_point():
            raise UsageError(
                f"--example-input {origin}: {where} has dtype {item.dtype}; the checks feed float inputs",
                "save floating-point tensors (the checks use seeded noise of the same shapes)",
            )
        try:
            return _valid_shape(list(item.shape))
        except ValueError as error:
            raise UsageError(
                f"--example-input {origin}: {where} has shape {tuple(item.shape)} ({error})", "save a smaller example"
            ) from None

    if isinstance(value, torch.Tensor):
        result = CheckInput("tensor", (tensor_shape(value, "the tensor"),))
    elif isinstance(value, (list, tuple)):
        result = CheckInput("list", tuple(tensor_shape(item, f"item {i}") for i, item in enumerate(value)))
    elif isinstance(value, dict):
        for key in value:
            if not isinstance(key, str) or not _KEY.match(key):
                raise UsageError(
                    f"--example-input {origin}: dict key {shown(key)} is not an identifier",
                    "use keys like 'image' or 'pixel_values'",
                )
        result = CheckInput("dict", tuple((key, tensor_shape(item, f"entry {key!r}")) for key, item in value.items()))
    else:
        raise UsageError(
            f"--example-input {origin} holds a {type(value).__name__}",
            "save a tensor, a list of tensors, or a dict of str -> tensor",
        )
    try:
        result.validate()
    except UsageError as error:
        raise UsageError(f"--example-input {origin}: {error.message}", error.hint) from None
    if total_elements(result) > MAX_ELEMENTS:
        raise UsageError(
            f"--example-input {origin} has {total_elements(result):,} values (at most {MAX_ELEMENTS:,})",
            "a small example is enough: 1-2 samples at a small size",
        )
    return result


# -- inference -----------------------------------------------------------------------------
_SPATIAL = {1: (64,), 2: (64, 64), 3: (16, 16, 16)}


def _entry_layers(model: "nn.Module") -> list:
    """Convs (subclasses included, e.g. smp's same-padding stem) and linears, in module order."""
    from torch import nn
    from torch.nn.modules.conv import _ConvNd

    return [
        m
        for m in model.modules()
        if isinstance(m, (_ConvNd, nn.Linear))
        and not isinstance(m, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d))
    ]


def _guess(layer: "nn.Module", batch: int) -> CheckInput | None:
    from torch import nn

    if isinstance(layer, nn.Linear):
        return CheckInput.of_shape((batch, layer.in_features))
    dims = len(getattr(layer, "kernel_size", ()))
    if dims not in _SPATIAL:
        return None
    return CheckInput.of_shape((batch, int(getattr(layer, "in_channels")), *_SPATIAL[dims]))  # noqa: B009


def infer_check_input(model: "nn.Module", batch: int = 2, *, attempts: int = 3) -> CheckInput | None:
    """A batch-first tensor sized for the first conv/linear the forward actually reaches.

    Starts from the first such layer in module order and runs the model once (eval, no
    grad) with a pre-hook on every candidate: if the forward fails, the layer it reached
    first is the model's real entry, and the next try is sized for it. None when no try
    runs after a layer was reached (the model wants a size of its own). A model that fails
    before reaching any layer, or sits on the meta device, gets the module-order guess: the
    check then names the model's own error.
    """
    import torch

    from bnsurgeon.core.running import preserved_modes

    layers = _entry_layers(model)
    if not layers:
        return None
    guess = _guess(layers[0], batch)
    reference = next(iter(model.parameters()), None)
    if reference is None or reference.is_meta:
        return guess
    tried: set = set()
    for _ in range(attempts):
        if guess is None or guess in tried:
            break
        tried.add(guess)
        reached: list = []
        handles = [
            layer.register_forward_pre_hook(lambda m, args, reached=reached: reached.append(m) if not reached else None)
            for layer in layers
        ]
        try:
            with preserved_modes(model), torch.no_grad():
                model.eval()(guess.make(dtype=reference.dtype, device=reference.device))
            return guess
        except Exception:  # the guess did not fit: size the next one for the layer actually reached
            if not reached:  # it failed before any conv/linear: not a size problem; the check says what failed
                return guess
            guess = _guess(reached[0], batch)
        finally:
            for handle in handles:
                handle.remove()
    return None
