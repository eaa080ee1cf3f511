"""DATA for ``bnsurgeon recalibrate``: batches read from untrusted files, or made by code the user named.

Kinds, told apart by what DATA is:

- a tensor file (``.pt``, ``.pth``, ``.safetensors``): read with ``weights_only=True`` (or
  safetensors), memory-mapped, through the same reader as checkpoints. One tensor holds samples
  (N, C, ...) and is cut into batches of ``batch_size``; a list/tuple of tensors, or a
  safetensors file's tensors in key order, are batches as they are;
- a folder of tensor files: every file, in name order, as above;
- a folder of images (``.jpg``, ``.png``, ``.gif``, ...; any depth, in path order): read with Pillow through
  the model's own preprocessing (a model directory's checked preprocessor_config.json, else timm's data config of
  the model: size, crop, mean, std). What the preprocessing makes of each image, and each batch, is worked out
  from the config and the image's header (``ImagePlan``) and checked against ``MAX_BATCH_BYTES`` before anything
  is decoded; an image over Pillow's pixel limit is refused undecoded; an image with several frames gives its
  first; 16-bit samples are scaled to 8 bits;
- ``package.module:function``: code, imported and called (no arguments) only because the user
  named it; it returns an iterable of batches (tensors, ``(input, target)`` pairs, or dicts).

Everything read from a file is checked before use: each batch is a floating tensor with a batch
dimension, at most ``MAX_BATCH_BYTES`` (``BNSURGEON_MAX_BATCH_BYTES``), and a file nests no
deeper than a list of tensors. Under torchrun, batch i of the whole stream goes to rank
i % world; ``max_batches``/``max_samples`` count the whole stream (the last batch is cut), so
every rank sees the same totals and the same fingerprint: a sha256 over the dtype, shape and
bytes of every batch used, in stream order.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from bnsurgeon.core.errors import (
    BnSurgeonError,
    CheckpointError,
    DataError,
    NotEnoughDataError,
    UnsafeCheckpointError,
    first_line,
)
from bnsurgeon.core.layout import counted, shown

if TYPE_CHECKING:
    import torch
    from torch import nn

TENSOR_SUFFIXES = (".pt", ".pth", ".safetensors")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".tif", ".tiff", ".gif")
DEFAULT_BATCH_SIZE = 32
#: the most one batch may hold unless BNSURGEON_MAX_BATCH_BYTES says otherwise; a file could otherwise declare
#: (or an image folder build) any size
MAX_BATCH_BYTES = 2 * 2**30
BATCH_BYTES_VARIABLE = "BNSURGEON_MAX_BATCH_BYTES"
MAX_FILES = 100_000
#: what Pillow may read an image as (whatever its name says): formats that are decoded in Pillow itself, never one
#: it hands to another program (EPS runs Ghostscript)
IMAGE_FORMATS = ("PNG", "JPEG", "BMP", "WEBP", "PPM", "TIFF", "GIF")


@dataclass
class DataStream:
    """The batches of this rank, and what the whole stream held (filled in as it is read)."""

    description: str
    kind: str
    preprocessing: str = ""  # how an image folder was read ("" for tensors and functions)
    batches: int = 0  # the whole stream's, every rank
    samples: int = 0
    sha256: str = ""
    _hash: Any = field(default=None, repr=False)
    _iterable: Any = field(default=None, repr=False)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._iterable)

    def record(self) -> dict[str, Any]:
        record = {
            "description": self.description,
            "kind": self.kind,
            "batches": self.batches,
            "samples": self.samples,
            "sha256": self.sha256,
        }
        if self.preprocessing:
            record["preprocessing"] = self.preprocessing
        return record


@dataclass(frozen=True)
class ResolvedData:
    """DATA, resolved once (``resolve_data``): what it is and every file it reads (no output may be one of them)."""

    text: str
    #: "tensor-folder", "image-folder", "empty-folder" (neither), "file", "function" (code, run because named),
    #: or "nothing" (no file, folder or package.module:function)
    kind: str
    path: Path
    files: tuple[Path, ...] = ()


def resolve_data(spec: "str | os.PathLike | ResolvedData", *, check_name: bool = False) -> ResolvedData:
    """What DATA is, from the string and the filesystem, once: a folder's files are listed here (bounded), a file is
    named (opened by ``open_data``), a function only named. A ``ResolvedData`` passes as it is. ``check_name``: a
    name the filesystem refuses (too long, unsearchable) is refused first."""
    from bnsurgeon.core.paths import check_reachable
    from bnsurgeon.core.user_code import FACTORY_PATTERN

    if isinstance(spec, ResolvedData):
        return spec
    text = os.fspath(spec)
    if check_name:
        check_reachable(
            text, "--data", DataError, "pass a tensor file, a folder of tensor files or images, or pkg.mod:function"
        )
    path = Path(text)
    try:
        if path.is_dir():
            tensors = _listed(path, TENSOR_SUFFIXES)
            if tensors:
                return ResolvedData(text, "tensor-folder", path, tuple(tensors))
            images = _listed(path, IMAGE_SUFFIXES)
            return ResolvedData(text, "image-folder" if images else "empty-folder", path, tuple(images))
        if path.exists():
            return ResolvedData(text, "file", path, (path,))
        listed = (path,) if os.path.lexists(path) else ()
    except OSError:  # open_data says what is wrong with it
        listed = ()
    return ResolvedData(text, "function" if FACTORY_PATTERN.match(text) else "nothing", path, listed)


def open_data(
    spec: "str | ResolvedData",
    *,
    model: "nn.Module | None" = None,
    batch_size: int | None = None,
    max_batches: int | None = None,
    max_samples: int | None = None,
    rank: int = 0,
    world: int = 1,
    dtype: "torch.dtype | None" = None,
    device: "torch.device | str | None" = None,
    model_directory: "Path | None" = None,
) -> DataStream:
    """DATA (``resolve_data``'s value, or a string resolved here) as this rank's batches (see the module doc). Nothing
    is read until it is iterated. An image folder is read with ``model_directory``'s own preprocessor_config.json where
    it has one, else with timm's data config."""
    max_batch_bytes()  # a bad value is refused before anything is read
    if batch_size is not None and batch_size < 1:
        raise DataError(f"--batch-size must be at least 1 (got {batch_size})", "pass --batch-size 32, for example")
    data = resolve_data(spec)
    path = data.path
    if data.kind == "tensor-folder":
        files = list(data.files)
        stream = DataStream(f"{counted(len(files), 'tensor file')} in {path}", "tensor-folder")
        batches: Iterator[Any] = (b for file in files for b in _file_batches(file, batch_size))
    elif data.kind in ("image-folder", "empty-folder"):
        images = list(data.files)
        if not images:
            raise DataError(f"--data {path} holds no tensor file ({', '.join(TENSOR_SUFFIXES)}) and no image")
        transform, how, plan = image_transform(model, model_directory)
        stream = DataStream(f"{counted(len(images), 'image')} in {path}", "image-folder", preprocessing=how)
        batches = _image_batches(images, transform, batch_size or DEFAULT_BATCH_SIZE, plan)
    elif data.kind == "file":
        _regular_file(path)
        if path.suffix not in TENSOR_SUFFIXES and not path.name.endswith(".pth.tar"):
            raise DataError(f"--data {path} is not a tensor file ({', '.join(TENSOR_SUFFIXES)}) or a folder")
        stream = DataStream(str(path), "tensor-file")
        batches = _file_batches(path, batch_size)
    elif data.kind == "function":
        stream = DataStream(data.text, "function")
        batches = _function_batches(data.text)
    else:
        raise DataError(
            f"--data {shown(data.text, 200)} is no file, folder or package.module:function",
            "pass a tensor file, a folder of tensor files or images, or pkg.mod:function",
        )
    stream._hash = hashlib.sha256()
    stream._iterable = _shard(stream, batches, max_batches, max_samples, rank, world, dtype, device)
    return stream


def max_batch_bytes() -> int:
    """The most one batch may hold: BNSURGEON_MAX_BATCH_BYTES, validated (exit 2 naming it), else MAX_BATCH_BYTES."""
    from bnsurgeon.core.environment import whole_number

    return whole_number(BATCH_BYTES_VARIABLE, MAX_BATCH_BYTES, low=1, high=2**62, unit="bytes")


def _listed(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    found = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        named_like_data = [name for name in dirs if name.lower().endswith(suffixes) and not name.startswith(".")]
        if named_like_data:  # never skipped unsaid: the user may think it is one of the files
            raise DataError(
                f"--data {folder}: {Path(root) / named_like_data[0]} is a directory named like a "
                f"{named_like_data[0].rsplit('.', 1)[-1]} file",
                "rename it, or move it out of the folder",
            )
        for name in sorted(names):
            if name.lower().endswith(suffixes) and not name.startswith("."):
                found.append(_regular_file(Path(root) / name))
                if len(found) > MAX_FILES:
                    raise DataError(
                        f"--data {folder} holds more than {MAX_FILES:,} files",
                        "pass a folder with fewer files, or --data pkg.mod:function",
                    )
        if suffixes == TENSOR_SUFFIXES:  # tensor files: the folder itself only
            break
    return found


def _regular_file(path: Path) -> Path:
    """``path``, refused unless a regular file: a named pipe would block the read forever, a device never end."""
    if not path.is_file():
        raise DataError(
            f"--data file {path} is not a regular file (a pipe, socket or device)",
            "save the batches to a file (torch.save) and pass that file, or a folder of such files",
        )
    return path


def _shard(stream: DataStream, batches: Iterable[Any], max_batches, max_samples, rank, world, dtype, device):
    """The whole stream, counted and hashed on every rank; this rank keeps batch i when i % world == rank."""
    from bnsurgeon.calibration.recalibrate import batch_input, batch_size

    for index, batch in enumerate(batches):
        if max_batches is not None and index >= max_batches:
            break
        if max_samples is not None and stream.samples >= max_samples:
            break
        value = batch_input(batch)
        check_dense(value, f"batch {index} of --data {stream.description}")
        size = batch_size(value)
        if max_samples is not None and stream.samples + size > max_samples:
            value = _cut(value, max_samples - stream.samples)
            size = max_samples - stream.samples
        if dtype is not None:
            value = _cast(value, dtype)
        _hash(stream._hash, value)
        if device is not None:
            value = _to_device(value, device)
        stream.batches += 1
        stream.samples += size
        if index % world == rank:
            yield value
    stream.sha256 = stream._hash.hexdigest()
    if stream.batches == 0:
        raise DataError(f"--data {stream.description} holds no batch", "pass data with at least one sample")
    short = []
    if max_batches is not None and stream.batches < max_batches:
        short.append(f"{counted(max_batches, 'batch')} asked for")
    if max_samples is not None and stream.samples < max_samples:
        short.append(f"{counted(max_samples, 'sample')} asked for")
    if short:
        raise NotEnoughDataError(
            f"--data {stream.description} holds {counted(stream.samples, 'sample')} in "
            f"{stream.batches} batch{'' if stream.batches == 1 else 'es'}, fewer than the {' and '.join(short)}",
            "nothing was written; pass "
            + (f"--samples {stream.samples}" if max_samples is not None else f"--batches {stream.batches}")
            + " (or fewer) to use what there is, or more data",
        )


def _cut(value, count):
    import torch

    if isinstance(value, torch.Tensor):
        return value[:count]
    if isinstance(value, (list, tuple)):
        return type(value)(_cut(v, count) for v in value)
    if isinstance(value, dict):
        return {k: _cut(v, count) for k, v in value.items()}
    return value


def _cast(value, dtype):
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _to_device(value, device):
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _hash(digest, value) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(value, (list, tuple)):
        for item in value:
            _hash(digest, item)
    elif isinstance(value, dict):
        for key in value:
            digest.update(str(key).encode())
            _hash(digest, value[key])


def _check_batch(tensor: Any, origin: str) -> "torch.Tensor":
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise DataError(
            f"{origin} holds {type(tensor).__name__}, not a tensor",
            "save a tensor (N, C, H, W) or a list of them with torch.save",
        )
    check_dense(tensor, origin)
    if not tensor.is_floating_point():
        raise DataError(
            f"{origin} is a {str(tensor.dtype).replace('torch.', '')} tensor; batches must be floating point "
            "(normalised as the model expects)",
            "save the preprocessed float tensors, or pass a folder of images (read with the model's preprocessing)",
        )
    if tensor.dim() < 2:
        raise DataError(
            f"{origin} has shape {tuple(tensor.shape)}; a batch has a batch dimension and at least one more",
            "save batches shaped (N, C, H, W)",
        )
    limit = max_batch_bytes()
    if tensor.numel() * tensor.element_size() > limit:
        raise DataError(
            f"{origin} is a batch of {_size(tensor.numel() * tensor.element_size())}, more than "
            f"{_size(limit)} ({BATCH_BYTES_VARIABLE})",
            "pass --batch-size to cut it, or save smaller batches",
        )
    return tensor


def check_dense(value: Any, origin: str) -> None:
    """Every tensor in a batch is an ordinary dense tensor with data: a sparse, nested or meta tensor has no
    shape or memory that BN statistics can be computed from (torch fails deep inside the model)."""
    import torch

    if isinstance(value, torch.Tensor):
        kind = (
            "nested"
            if value.is_nested
            else "meta-device"
            if value.is_meta
            else None
            if value.layout is torch.strided
            else str(value.layout).replace("torch.", "")
        )
        if kind is not None:
            raise DataError(
                f"{origin} is a {kind} tensor; batches must be dense tensors holding their values",
                "save batches as ordinary tensors (.to_dense(), or torch.stack of the samples)",
            )
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_dense(item, f"{origin} [{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_dense(item, f"{origin} [{shown(key, 40)}]")


def _size(count: int) -> str:
    return f"{count:,} bytes" if count < 2**20 else f"{count / 2**20:,.1f} MiB"


def _file_batches(path: Path, batch_size: int | None) -> Iterator["torch.Tensor"]:
    import zipfile

    from bnsurgeon.files.reading import physical_memory, read_checkpoint

    memory = physical_memory()
    if (
        memory is not None
        and path.suffix != ".safetensors"
        and not zipfile.is_zipfile(path)
        and path.stat().st_size > memory // 2
    ):  # torch's legacy format cannot be memory-mapped: it is read whole
        raise DataError(
            f"--data file {path} is {path.stat().st_size / 2**30:,.1f} GiB in torch's legacy format, "
            "which is read into memory whole (more than half of this machine's)",
            "save it with a current torch.save (memory-mapped) or as .safetensors",
        )

    try:
        raw = read_checkpoint(path, mmap=True)  # weights_only (or safetensors); mapped, never code
    except UnsafeCheckpointError as error:  # data is never unpickled with code: there is no --trust-pickle for it
        raise DataError(
            f"--data file {error.message}",
            "save tensors only (torch.save of a tensor or a list of tensors), or use .safetensors",
        ) from None
    except CheckpointError as error:
        raise DataError(f"--data file {error.message}", error.hint) from None
    obj = raw.obj
    if isinstance(obj, dict):  # safetensors: its tensors in key order; a torch dict: its tensor values
        if not obj or not all(isinstance(key, str) for key in obj):
            raise DataError(f"{path} holds a dict that is not a set of named batches")
        items = [(f"{path} [{key!r}]", obj[key]) for key in sorted(obj)]
    elif isinstance(obj, (list, tuple)):
        items = [(f"{path} [{index}]", value) for index, value in enumerate(obj)]
    else:
        items = [(str(path), obj)]
    single = len(items) == 1 and not isinstance(obj, (list, tuple))
    for origin, value in items:
        if single or batch_size is not None:
            tensor = _check_batch_shape_only(value, origin)
            size = batch_size or DEFAULT_BATCH_SIZE
            for start in range(0, tensor.shape[0], size):
                yield _check_batch(tensor[start : start + size], f"{origin} samples {start}:{start + size}")
        else:
            yield _check_batch(value, origin)


def _check_batch_shape_only(value: Any, origin: str) -> "torch.Tensor":
    """A tensor of samples to be cut into batches: its type, dtype and dims (its size is the cut's)."""
    import torch

    if not isinstance(value, torch.Tensor):
        return _check_batch(value, origin)
    check_dense(value, origin)
    if value.dim() < 2 or not value.is_floating_point():
        return _check_batch(value, origin)
    return value


def _function_batches(spec: str) -> Iterator[Any]:
    from bnsurgeon.core.user_code import check_factory_spec, import_named_module

    check_factory_spec(spec)
    try:
        module, attribute = import_named_module(spec)
    except ImportError as error:
        raise DataError(
            f"--data {spec}: cannot import it ({first_line(error)})",
            "check the module is importable from here (the working directory is on sys.path)",
        ) from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise DataError(f"--data {spec}: {attribute!r} is not a function of {module.__name__}")
    try:
        batches = function()
        iterator = iter(batches)
    except BnSurgeonError:
        raise
    except Exception as error:
        raise DataError(
            f"--data {spec} raised {type(error).__name__}: {first_line(error)}",
            "make it return an iterable of batches (a list, a DataLoader, a generator)",
        ) from None
    index = 0
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except BnSurgeonError:
            raise
        except Exception as error:
            raise DataError(
                f"--data {spec} raised {type(error).__name__} at batch {index}: {first_line(error)}",
                "fix the function's data",
            ) from None
        yield batch
        index += 1


def image_transform(model: "nn.Module | None", directory: "Path | None") -> "tuple[Any, str, ImagePlan]":
    """(PIL image -> tensor, what it is, what it makes of an image): a transformers model directory's own image
    processor where it has a preprocessor_config.json (checked field by field first), else the model's timm data
    config (resize, crop, mean, std), said in the output."""
    from bnsurgeon.loading.transformers_source import PREPROCESSOR_FILE, image_processor

    found = image_processor(directory) if directory is not None else None
    if found is not None and directory is not None:
        processor, how = found
        plan = transformers_plan(processor, str(directory / PREPROCESSOR_FILE))
        return (
            (lambda image: processor(images=image, return_tensors="pt")["pixel_values"][0]),
            f"{how}; {FRAME_NOTE}",
            plan,
        )
    try:
        from timm.data import create_transform, resolve_data_config
    except ImportError as error:  # pragma: no cover - timm is a dependency
        raise DataError(f"reading an image folder needs timm ({first_line(error)})") from None
    config = resolve_data_config({}, model=model)
    transform = create_transform(**config, is_training=False)
    how = (
        f"timm's data config of the model (input {tuple(config.get('input_size', ()))}, "
        f"{config.get('interpolation', '')}, crop {config.get('crop_pct', '')}, mean {tuple(config.get('mean', ()))}, "
        f"std {tuple(config.get('std', ()))})"
    )
    if directory is not None:
        how += f": {directory} has no preprocessor_config.json"
    return transform, f"{how}; {FRAME_NOTE}", timm_plan(config)


#: the most pixels one image may declare: Pillow's own guard against decompression bombs (its default
#: ``MAX_IMAGE_PIXELS``), fixed here so that no library that changes Pillow's setting changes bnsurgeon's
MAX_IMAGE_PIXELS = 89_478_485
#: bytes one pixel value may take while an image is preprocessed (transformers rescales in float64)
WORKING_BYTES = 8
#: a planned side longer is counted as this long: already far past any limit, and its products stay floats
MAX_PLANNED_SIDE = 1 << 40
#: what every image with several frames (an animated GIF, PNG or WebP, a multi-page TIFF) gives
FRAME_NOTE = "an image with several frames (animated, multi-page) gives its first frame"


@dataclass(frozen=True)
class ImagePlan:
    """What the preprocessing makes of an image, known before it runs (sizes are (height, width)): how it resizes
    (``exact``, ``cover`` (keep the ratio, cover both sides), ``shortest`` (shortest side, at most ``longest``),
    ``longest``, ``fit`` (within both sides), or ``None``), its crop, the size it pads to, and what each side is
    rounded up to. ``sizes`` is an upper bound of what it makes: bnsurgeon checks it against
    ``BNSURGEON_MAX_BATCH_BYTES`` before the image is decoded."""

    resize: "tuple[str, int, int] | None" = None
    crop: "tuple[int, int] | None" = None
    pad: "tuple[int, int] | None" = None
    multiple: int = 1
    channels: int = 3
    origin: str = "the preprocessing"  # what to name in an error (the config file and its field)

    def sizes(self, height: int, width: int) -> "tuple[tuple[int, int], tuple[int, int]]":
        """(the largest intermediate, the output), each (height, width), for an image of ``height`` x ``width``."""
        resized = self._resized(height, width)
        resized = (
            min(_round_up(resized[0], self.multiple), MAX_PLANNED_SIDE),
            min(_round_up(resized[1], self.multiple), MAX_PLANNED_SIDE),
        )
        out = self.crop or resized
        if self.pad is not None:
            out = (max(out[0], self.pad[0]), max(out[1], self.pad[1]))
        return (max(resized[0], out[0]), max(resized[1], out[1])), out

    def _resized(self, height: int, width: int) -> "tuple[int, int]":
        if self.resize is None:
            return height, width
        kind, first, second = self.resize
        if kind == "exact":
            return first, second
        short, long = min(height, width), max(height, width)
        if kind == "shortest":  # scale = first / short, unless the long side would pass ``second``
            num, den = first, short
            if second and long * first > second * short:
                num, den = second, long
        elif kind == "longest":
            num, den = first, long
        elif kind == "cover":  # the larger of the two scales
            num, den = (first, height) if first * width >= second * height else (second, width)
        else:  # fit: the smaller of the two scales
            num, den = (first, height) if first * width <= second * height else (second, width)
        return -(-height * num // den) + 1, -(-width * num // den) + 1  # rounded up, and one more for rounding

    def exact_output(self, height: int, width: int) -> "tuple[int, int] | None":
        """The output's (height, width) where the plan knows it exactly (a crop, a resize to one size, no resize;
        padded to a size it fits in), else None: a resize that keeps the ratio rounds as each processor does."""
        if self.multiple != 1:
            return None
        if self.crop is not None:
            base: tuple[int, int] | None = self.crop
        elif self.resize is None:
            base = (height, width)
        else:
            base = (self.resize[1], self.resize[2]) if self.resize[0] == "exact" else None
        if base is None or self.pad is None:
            return base
        return self.pad if base[0] <= self.pad[0] and base[1] <= self.pad[1] else None

    def describe(self, height: int, width: int) -> str:
        """The output's shape for a message: exact where the plan knows it, else the bound, said as one."""
        _, out = self.sizes(height, width)
        exact = self.exact_output(height, width)
        sides = [f"{side:,}" if side < MAX_PLANNED_SIDE else f"over {MAX_PLANNED_SIDE - 1:,}" for side in exact or out]
        return f"{'' if exact else 'up to '}{self.channels} x {sides[0]} x {sides[1]}"


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def timm_plan(config: dict) -> ImagePlan:
    """timm's eval transform for a data config (``transforms_imagenet_eval``): resize to ``input / crop_pct``
    (squashed, or the shortest side, keeping the ratio), then crop to the input size."""
    channels, height, width = (int(v) for v in config["input_size"])
    ratio = Fraction(float(config.get("crop_pct") or 1.0))
    if ratio <= 0:  # timm itself refuses such a config when it builds the transform
        ratio = Fraction(1)
    scaled = [-(-side * ratio.denominator // ratio.numerator) + 1 for side in (height, width)]
    if config.get("crop_mode") == "squash":
        resize: tuple[str, int, int] = ("exact", scaled[0], scaled[1])
    else:  # center (Resize of the shortest side) or border (ResizeKeepRatio): at most the larger scale, kept ratio
        resize = ("shortest", max(scaled), 0)
    # images are read as RGB: 3 channels whatever the model takes (one that takes 1 fails on them, named there)
    return ImagePlan(resize, (height, width), channels=max(channels, 3), origin="timm's data config of the model")


def _image_limits(path: Path, image: Any, plan: ImagePlan, limit: int) -> "tuple[int, int]":
    """The image's declared size checked against Pillow's pixel limit and, with what the preprocessing makes of it,
    against ``limit``: before it is decoded. Returns the output's (height, width) as planned."""
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise DataError(
            f"{path} is {width:,} x {height:,} pixels ({width * height:,}), more than the {MAX_IMAGE_PIXELS:,} "
            "one image may have (Pillow's limit against decompression bombs); it was not decoded",
            "resize the image, or remove it from the folder",
        )
    (mid_h, mid_w), (out_h, out_w) = plan.sizes(height, width)
    bands = len(image.getbands())
    working = height * width * max(bands, 3) * 4 + mid_h * mid_w * plan.channels * WORKING_BYTES
    if working > limit or out_h * out_w * plan.channels * 4 > limit:
        raise DataError(
            f"{path} ({width:,} x {height:,} pixels) would take "
            f"{'over ' if max(mid_h, mid_w) >= MAX_PLANNED_SIDE else ''}{_size(working)} to preprocess, into "
            f"{plan.describe(height, width)} float32 ({_size(out_h * out_w * plan.channels * 4)}): more than "
            f"{_size(limit)} ({BATCH_BYTES_VARIABLE}); nothing was decoded. The sizes are {plan.origin}'s",
            f"check the sizes in {plan.origin}, or resize the image (or raise {BATCH_BYTES_VARIABLE})",
        )
    return out_h, out_w


def _decoded(path: Path, image: Any) -> Any:
    """``image`` (opened, not decoded) as 8-bit RGB: its first frame; 16-bit samples scaled to 8 bits (Pillow's own
    conversion clips them at 255, which whitens the image)."""
    from PIL import ImageFile

    if image.mode in ("I", "F"):  # known from the header: refused before it is decoded
        raise DataError(
            f"{path} holds 32-bit {'integer' if image.mode == 'I' else 'floating-point'} samples, whose range "
            "says nothing of their brightness",
            "save the image with 8 or 16 bits per sample, or pass the preprocessed tensors",
        )
    if image.tell() != 0:  # Pillow opens at the first frame; frames are never counted (a GIF decodes each to count)
        image.seek(0)
    saved, ImageFile.LOAD_TRUNCATED_IMAGES = ImageFile.LOAD_TRUNCATED_IMAGES, False  # a truncated file is refused
    try:
        image.load()
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = saved
    if image.mode.startswith("I;16"):
        import numpy as np
        from PIL import Image

        values = np.asarray(image, dtype=np.uint32)
        return Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8)).convert("RGB")
    return image.convert("RGB")


def _image_batches(images: list[Path], transform: Any, batch_size: int, plan: ImagePlan) -> Iterator["torch.Tensor"]:
    """Images through ``transform`` (``image_transform``), into batches. Each image's size, and what the
    preprocessing makes of it (``plan``), is checked before it is decoded; a batch's size before its first image is
    read (its tensor is made once, and each image copied into it)."""
    import warnings

    import torch

    try:
        from PIL import Image
    except ImportError as error:  # pragma: no cover - Pillow is a dependency
        raise DataError(f"reading an image folder needs Pillow ({first_line(error)})") from None
    Image.init()  # every format registered, so that IMAGE_FORMATS names only known ones
    limit = max_batch_bytes()
    batch: torch.Tensor | None = None
    filled, count, first = 0, 0, images[0]
    for index, path in enumerate(images):
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            try:
                image = Image.open(path, formats=IMAGE_FORMATS)  # never a format that runs a program (EPS)
            except (Image.DecompressionBombError, Image.DecompressionBombWarning):
                # Pillow's own text quotes its setting (twice it, past which it raises), which another library
                # may have changed: bnsurgeon's limit is the one fixed here, said as everywhere else
                raise DataError(
                    f"{path} declares more than the {MAX_IMAGE_PIXELS:,} pixels one image may have (Pillow's limit "
                    "against decompression bombs); it was not decoded",
                    "resize the image, or remove it from the folder",
                ) from None
            except Image.UnidentifiedImageError:
                raise DataError(
                    f"{path} is not a {', '.join(IMAGE_FORMATS)} image",
                    "remove it from the folder, or convert it to PNG",
                ) from None
            except Exception as error:
                raise DataError(
                    f"{path} is not a readable image ({type(error).__name__}: {first_line(error)})",
                    "remove it from the folder, or pass tensors",
                ) from None
            with image:
                planned = _image_limits(path, image, plan, limit)
                if batch is None:  # a new batch: all of it, as planned, before any of it is read
                    count = min(batch_size, len(images) - index)
                    need = count * plan.channels * planned[0] * planned[1] * 4
                    if need > limit:
                        raise DataError(
                            f"a batch of {count} images from {path} on would be {_size(need)} "
                            f"({plan.describe(image.size[1], image.size[0])} float32 each), more than {_size(limit)} "
                            f"({BATCH_BYTES_VARIABLE}); nothing was decoded",
                            f"pass --batch-size {max(1, limit // max(1, need // count))} or smaller, or check the "
                            f"sizes in {plan.origin}",
                        )
                try:
                    tensor = transform(_decoded(path, image))
                except DataError:
                    raise
                except Exception as error:
                    raise DataError(
                        f"{path} is not a readable image ({type(error).__name__}: {first_line(error)})",
                        "remove it from the folder, or pass tensors",
                    ) from None
        if not isinstance(tensor, torch.Tensor) or tensor.numel() > plan.channels * planned[0] * planned[1]:
            raise DataError(
                f"{plan.origin} made {path} into {_shape(tensor)}, larger than bnsurgeon foresaw "
                f"({plan.channels} x {planned[0]:,} x {planned[1]:,}): its preprocessing is not one bnsurgeon knows",
                "pass the preprocessed batches as a tensor file",
            )
        if batch is None:
            first = path
            batch = torch.empty((count, *tensor.shape), dtype=tensor.dtype)
        elif tensor.shape != batch.shape[1:]:
            raise DataError(
                f"{plan.origin} made {first} into {_shape(batch[0])} but {path} into {_shape(tensor)}: "
                "the images of a batch must come out the same size",
                f"make the preprocessing crop to one size (crop_size / do_center_crop in {plan.origin}), "
                "or pass --batch-size 1",
            )
        batch[filled] = tensor
        filled += 1
        del tensor
        if filled == len(batch):
            yield _check_batch(batch, f"images ending at {path}")
            batch, filled = None, 0


def _shape(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return " x ".join(f"{side:,}" for side in shape) if shape is not None else type(value).__name__


#: ConvNeXt's image processor squashes to a square from this shortest_edge on, and crops below it
CONVNEXT_SQUASH_FROM = 384


def _scaled(shortest: int, crop_pct: Any) -> int:
    """``shortest / crop_pct`` rounded up, and one more for the processor's own rounding (exact arithmetic: 12 /
    5e-324 is no float); ``shortest`` where there is no crop_pct below 1."""
    if not isinstance(crop_pct, (int, float)) or isinstance(crop_pct, bool) or not 0 < crop_pct < 1:
        return shortest
    ratio = Fraction(crop_pct)
    return -(-shortest * ratio.denominator // ratio.numerator) + 1


def transformers_plan(processor: Any, origin: str) -> ImagePlan:
    """What a transformers image processor makes of an image, from its own settings (``size``, ``crop_pct``,
    ``crop_size``, ``pad_size``, ...), as ``ImagePlan``. A setting it does not read (a processor that makes
    patches, say) is caught after the first image: a larger output than planned is refused."""
    from bnsurgeon.loading.transformers_source import MAX_SIDE

    def field(value: Any, key: str) -> Any:
        found = value.get(key) if isinstance(value, dict) else getattr(value, key, None)
        return found if isinstance(found, int) and not isinstance(found, bool) and found > 0 else None

    size = getattr(processor, "size", None)
    resize: tuple[str, int, int] | None = None
    inner_crop: tuple[int, int] | None = None
    if getattr(processor, "do_resize", True) is not False and size is not None:
        height, width = field(size, "height"), field(size, "width")
        shortest, longest = field(size, "shortest_edge"), field(size, "longest_edge")
        if isinstance(size, int) and not isinstance(size, bool):
            resize = ("exact", size, size)
        elif height and width:
            resize = ("cover" if getattr(processor, "keep_aspect_ratio", False) else "exact", height, width)
        elif shortest and type(processor).__name__.startswith("ConvNext"):
            # ConvNeXt's own resize: below 384, the shortest side to shortest / crop_pct, then a crop of
            # shortest x shortest; from 384, squashed to shortest x shortest (then any crop_size crop)
            if shortest >= CONVNEXT_SQUASH_FROM:
                resize = ("exact", shortest, shortest)
            else:
                resize = ("shortest", _scaled(shortest, getattr(processor, "crop_pct", None)), 0)
                inner_crop = (shortest, shortest)
        elif shortest:
            resize = ("shortest", _scaled(shortest, getattr(processor, "crop_pct", None)), longest or 0)
        elif longest:
            resize = ("longest", longest, 0)
        elif field(size, "max_height") and field(size, "max_width"):
            resize = ("fit", field(size, "max_height"), field(size, "max_width"))
    crop_size, pad_size = getattr(processor, "crop_size", None), getattr(processor, "pad_size", None)
    crop = (
        (field(crop_size, "height"), field(crop_size, "width"))
        if getattr(processor, "do_center_crop", False) and field(crop_size, "height") and field(crop_size, "width")
        else inner_crop  # a crop_size crop comes after ConvNeXt's own
    )
    pad = (
        (field(pad_size, "height"), field(pad_size, "width"))
        if getattr(processor, "do_pad", False) and field(pad_size, "height") and field(pad_size, "width")
        else None
    )
    multiple = max(
        [1]
        + [
            value
            for value in (getattr(processor, name, None) for name in ("size_divisor", "ensure_multiple_of"))
            if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_SIDE
        ]
    )
    return ImagePlan(resize, crop, pad, multiple, origin=origin)
