"""Read checkpoints: tensors + bnsurgeon metadata, and the state dicts a file holds.

Every file is untrusted: torch's weights_only load with only harmless globals admitted
(``argparse.Namespace`` of timm training checkpoints), for that one load (``files.torch_pickle``:
torch's process-wide allow-list is never touched); arbitrary pickles need ``trust_pickle=True``.
Writing is ``files.writing``'s job.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bnsurgeon.core.errors import CheckpointError, SourceNotFoundError, UnsafeCheckpointError, UsageError, first_line
from bnsurgeon.core.json_text import RepeatedKeyError, unique_keys
from bnsurgeon.core.layout import counted, shown
from bnsurgeon.core.torch_versions import FEATURES, installed_text, require
from bnsurgeon.files.torch_pickle import global_name, globals_named, load_weights_only, weights_only_forced

if TYPE_CHECKING:
    import torch

PREFIX = "bnsurgeon."
SCHEMA_VERSION = "1"
SAFETENSORS_SUFFIXES = (".safetensors",)
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".tar", ".ckpt")
OUTPUT_SUFFIXES = (".safetensors", ".pt", ".pth")
#: containers in which training frameworks nest the model's state dict, in order of preference
NESTED_KEYS = ("state_dict", "model", "module", "net", "network", "state_dict_ema", "model_ema", "ema")
PREFIXES = ("module.", "model.", "_orig_mod.")


@dataclass
class RawCheckpoint:
    """What a file holds: the loaded object, its string metadata, and the tensors candidates."""

    path: Path
    obj: Any
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def is_bnsurgeon(self) -> bool:
        return PREFIX + "architecture" in self.metadata


def _check_readable(path: Path) -> None:
    if not path.exists():
        if path.is_symlink():  # "no such file" would misstate a name that is there
            target = os.readlink(path)
            raise SourceNotFoundError(
                f"{path} is a symlink to {target}, which "
                + ("leads back to itself" if symlink_loops(path) else "does not exist"),
                "fix the link, or pass the checkpoint file itself",
            )
        raise SourceNotFoundError(f"no such file: {path}", "check the path (or name a timm model)")
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a checkpoint file", "pass the checkpoint file inside it")
    if not path.is_file():  # a FIFO would block the read forever, /dev/zero never ends: refused before opening
        raise CheckpointError(
            f"{path} is not a regular file (a pipe, socket or device)",
            "save the checkpoint to a file and pass that file",
        )
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes)", "the file was not written completely; use an intact copy")


def read_checkpoint(path: str | os.PathLike, *, trust_pickle: bool = False, mmap: bool = False) -> RawCheckpoint:
    """Load a checkpoint file without running code from it (unless ``trust_pickle``).

    The tensors are private copies in memory: a file rewritten or truncated later changes
    nothing (and cannot kill the process with SIGBUS). A file rewritten *while* it is read
    is detected and refused. ``mmap=True`` maps the file instead (no copy; for reading
    shapes, or huge read-only uses where the file will not change).
    """
    path = Path(path)
    _check_readable(path)
    if not mmap:
        _refuse_larger_than_memory(path)
    before = file_identity(path)
    if path.suffix in SAFETENSORS_SUFFIXES or _looks_like_safetensors(path):
        raw = _read_safetensors(path, mmap)
    else:
        refuse_compressed_records(path, str(path))
        raw = _read_torch(path, trust_pickle, mmap)
    if not mmap and file_identity(path) != before:
        from bnsurgeon.core.errors import InputChangedError

        raise InputChangedError(f"{path} changed while bnsurgeon was reading it (size, mtime or inode differ)")
    return raw


def physical_memory() -> int | None:
    """This machine's RAM in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _refuse_larger_than_memory(path: Path) -> None:
    """Reading copies every tensor into memory: a file larger than RAM (or a sparse file declaring
    that much) would end in a traceback or the OOM killer, not a message."""
    size, physical = path.stat().st_size, physical_memory()
    if physical is not None and size > physical:
        raise CheckpointError(
            f"{path} is {size / 2**30:,.1f} GiB, more than this machine's {physical / 2**30:,.1f} GiB of memory, "
            "and its tensors are read into memory",
            "convert it on a machine with more memory",
        )


#: torch.save stores every record uncompressed; an archive may compress small records (the pickle) by
#: at most this much before it reads as a zip bomb
MAX_EXPANSION = 16
#: records up to this size may be compressed at any ratio (a few KB of pickle)
SMALL_RECORD = 1 << 20


def refuse_compressed_records(path: Path, what: str) -> None:
    """A torch zip whose records are compressed expands in memory when read: 260 KB of deflated zeros is
    a 256 MB tensor. torch.save never compresses, so a record that expands more than ``MAX_EXPANSION``
    times (or beyond memory) is refused before anything is read."""
    import zipfile

    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return  # torch's own reader says what is wrong with it
    declared = sum(record.file_size for record in records)
    physical = physical_memory()
    if physical is not None and declared > physical:
        raise CheckpointError(
            f"{what} declares {declared / 2**30:,.1f} GiB of records, more than this machine's "
            f"{physical / 2**30:,.1f} GiB of memory",
            "convert it on a machine with more memory",
        )
    for record in records:
        if record.file_size > SMALL_RECORD and record.file_size > MAX_EXPANSION * max(record.compress_size, 1):
            raise CheckpointError(
                f"{what} holds a compressed record {shown(record.filename, 80)} that expands "
                f"{record.file_size / max(record.compress_size, 1):,.0f} times, to {record.file_size / 2**20:,.1f} MiB "
                "(torch.save never compresses; a zip bomb would fill memory before the load fails)",
                "save it again with torch.save (records stored, not compressed)",
            )


def file_identity(path: Path) -> tuple[int, ...]:
    """What changes when a file is rewritten, replaced or truncated."""
    stat = os.stat(path)
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def _looks_like_safetensors(path: Path) -> bool:
    with open(path, "rb") as handle:
        head = handle.read(9)
    return len(head) == 9 and head[8:9] == b"{"


def _read_safetensors(path: Path, mmap: bool) -> RawCheckpoint:
    from safetensors import SafetensorError, safe_open

    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:  # safetensors opens paths as UTF-8 only: the name is at fault, not the file
        raise CheckpointError(
            f"{shown(str(path), 200)}: its name is not UTF-8, and the safetensors library opens only UTF-8 paths",
            "rename the file (its contents were not read, and are not at fault)",
        ) from None
    try:
        with safe_open(str(path), framework="pt") as handle:  # validates the header and offsets
            metadata = handle.metadata() or {}
            header = _safetensors_header(path)
            for key, info in header.items():  # before any tensor is made: name what torch cannot hold
                _torch_layout(path, key, info)
            if mmap:
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        if not mmap:
            tensors = _read_safetensors_copy(path, header)
    except SafetensorError as error:
        # serde's "unknown variant `X`, expected one of `BOOL`, ..., `F32`, ...": the dtype enum; safetensors
        # before 0.5 says only "InvalidHeaderDeserialization", so the header is read here to find the dtype
        unknown = re.search(r"unknown variant `([^`]{1,40})`, expected one of [^\n]*`F32`", str(error))
        newer = unknown.group(1) if unknown is not None else _dtype_this_safetensors_lacks(path, str(error))
        if newer is not None:  # a dtype newer than this safetensors: not a damaged file
            import safetensors

            raise CheckpointError(
                f"{path} has a tensor of dtype {newer!r}, which safetensors {safetensors.__version__} does not know",
                "save the tensors in a common dtype (F32, F16, BF16), or upgrade safetensors",
            ) from None
        raise CheckpointError(
            f"{path} is not a readable .safetensors file ({error})",
            "the file is truncated or corrupt; re-download or re-export it",
        ) from None
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"{path} is not a readable .safetensors file ({error})",
            "the file is truncated or corrupt; re-download or re-export it",
        ) from None
    except (MemoryError, RuntimeError) as error:  # mapping or copying more than this machine can hold
        raise CheckpointError(
            f"{path} cannot be read into memory ({first_line(error, 'unknown error') or 'out of memory'})",
            "free memory, or read it on a machine with more memory",
        ) from None
    return RawCheckpoint(path, tensors, dict(metadata))


#: safetensors dtype names -> torch dtype attribute names (every dtype safetensors 0.8 knows)
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
    "F4": "float4_e2m1fn_x2",  # two 4-bit values per byte: the last dimension is halved, as safetensors does
}
#: dtypes stored packed, several values per torch element: values per element
PACKED = {"F4": 2}
#: what the dtypes torch has no type for are, for the message
NO_TORCH_DTYPE = {"F6_E2M3": "6-bit float", "F6_E3M2": "6-bit float"}


def _torch_layout(path: Path, key: str, info: dict[str, Any]) -> "tuple[torch.dtype, list[int]]":
    """The torch dtype and shape of a safetensors tensor entry; CheckpointError naming the dtype when
    torch cannot hold it."""
    import torch

    name, shape = info["dtype"], list(info["shape"])
    torch_name = SAFETENSORS_DTYPES.get(name, "") if isinstance(name, str) else ""
    if torch_name in FEATURES:  # a dtype of a newer torch than this one: the version is the problem, not the file
        require(torch_name, f"reading {path} (tensor {key[:200]!r} is {name})")
    dtype = getattr(torch, torch_name, None)
    if not isinstance(dtype, torch.dtype):
        what = f" ({NO_TORCH_DTYPE[name]})" if name in NO_TORCH_DTYPE else ""
        raise CheckpointError(
            f"{path}: tensor {key[:200]!r} has dtype {str(name)[:40]}{what}, which is not supported by torch "
            f"{installed_text()}",
            "save that tensor in a dtype torch has (F32, F16, BF16), or use a torch that supports it",
        )
    packed = PACKED.get(name, 1)
    if packed > 1:
        if not shape or shape[-1] % packed:
            raise CheckpointError(
                f"{path}: tensor {key[:200]!r} has dtype {name} and shape {tuple(shape)}; torch holds {name} only "
                f"{packed} values to an element, along a last dimension divisible by {packed}",
                "save that tensor in a dtype torch has (F32, F16, BF16)",
            )
        shape[-1] //= packed
    return dtype, shape


#: the dtypes every safetensors bnsurgeon supports reads (0.4.3, the floor); newer ones added F8_E8M0, F4, F6_*, C64...
OLDEST_SAFETENSORS_DTYPES = {
    "BOOL",
    "U8",
    "I8",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "F64",
    "I64",
    "U64",
    "F8_E5M2",
    "F8_E4M3",
}


def _dtype_this_safetensors_lacks(path: Path, message: str) -> str | None:
    """The first dtype of ``path``'s header outside what the oldest supported safetensors reads, where this one
    refused the header without saying why (before 0.5: "InvalidHeaderDeserialization"); None otherwise."""
    if "InvalidHeaderDeserialization" not in message:
        return None
    try:
        header = _safetensors_header(path)
    except (OSError, ValueError, CheckpointError, struct.error):
        return None
    for info in header.values():
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if isinstance(dtype, str) and dtype not in OLDEST_SAFETENSORS_DTYPES:
            return dtype[:40]
    return None


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The tensors' entries of a safetensors header (already validated by ``safe_open``). A name that
    appears twice is refused: safetensors and Python keep the last entry, other readers may keep the first,
    so the file means different tensors to different tools."""
    with open(path, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        try:
            header = json.loads(stream.read(length), object_pairs_hook=unique_keys)
        except RepeatedKeyError as error:
            raise CheckpointError(
                f"{path}: its header names {shown(error.key, 200)} twice, and readers disagree on which entry "
                "counts (safetensors keeps the last)",
                "re-export the file from the model's state_dict (its names are unique)",
            ) from None
    header.pop("__metadata__", None)
    return header


def _read_safetensors_copy(path: Path, header: dict[str, Any]) -> dict[str, "torch.Tensor"]:
    """Every tensor read into memory of its own, one at a time (peak: the tensors, no second copy).

    safetensors' own readers return views of a memory map; ``safetensors.torch.load``
    needs the whole file as bytes besides the tensors. The header was validated by
    ``safe_open`` just before.
    """
    import struct

    import torch

    tensors = {}
    with open(path, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        for key, info in header.items():
            start, end = info["data_offsets"]
            dtype, shape = _torch_layout(path, key, info)
            data = torch.empty(end - start, dtype=torch.uint8)
            stream.seek(8 + length + start)
            if stream.readinto(data.numpy().data) != end - start:
                raise ValueError(f"tensor {key!r} ends past the end of the file")
            tensors[key] = data.view(dtype).reshape(shape)
    return tensors


def harmless_globals() -> list[Any]:
    """What a read admits beyond torch's weights_only defaults and the program's own allow-list, for itself only:
    ``argparse.Namespace``, what timm's train.py saves its arguments as."""
    import argparse

    return [argparse.Namespace]


def _read_torch(path: Path, trust_pickle: bool, mmap: bool = False) -> RawCheckpoint:
    import pickle
    import zipfile

    import torch

    try:
        if trust_pickle:
            obj = torch.load(path, map_location="cpu", weights_only=False)
        else:  # torch's weights_only load with Namespace admitted for this load only (torch's list untouched)
            obj = load_weights_only(path, also_allowed=harmless_globals(), mmap=mmap and zipfile.is_zipfile(path))
    except CheckpointError:
        raise
    except pickle.UnpicklingError as error:
        refuse_dtypes_this_torch_lacks(path, f"reading {path}")
        text = str(error)
        if UNSUPPORTED_GLOBAL.search(text):  # the pickle imports something: code would run
            _refuse_harmless_global_when_forced(path, text)
            culprit = unsupported_global(text)
            raise UnsafeCheckpointError(f"{path} is a pickle that would run code when loaded ({culprit})") from None
        if "WeightsUnpickler error:" in text:  # torch's safe loader refused a construct: say which, not its advice
            raise CheckpointError(
                f"{path} is not a readable PyTorch checkpoint ({unpickler_refusal(text)})",
                "the file is corrupt, or holds objects beyond tensors and plain values: use an "
                "intact copy, or re-save the state dict alone (or as .safetensors)",
            ) from None
        raise CheckpointError(
            f"{path} is not a readable PyTorch checkpoint ({first_line(text, 'unknown error')})",
            "the file is truncated or corrupt; use an intact copy",
        ) from None
    except Exception as error:  # garbage makes the unpickler raise anything: IndexError, KeyError, ...
        refuse_dtypes_this_torch_lacks(path, f"reading {path}")
        raise CheckpointError(
            f"{path} is not a readable PyTorch checkpoint ({first_line(error, 'unknown error')})",
            "the file is truncated, corrupt, or not a checkpoint; use an intact .pt/.pth/.safetensors file",
        ) from None
    metadata = {}
    if isinstance(obj, dict) and isinstance(obj.get("bnsurgeon"), dict):
        odd = next((key for key in obj["bnsurgeon"] if not isinstance(key, str)), None)
        if odd is not None:  # metadata fields are named; PREFIX + 5 would be a TypeError traceback
            from bnsurgeon.core.errors import MetadataError

            raise MetadataError(
                f"{path}: metadata 'bnsurgeon' has an entry keyed by {_a(type(odd).__name__)}, "
                f"{repr(odd)[:80]} (its fields are named by strings)"
            )
        metadata = {PREFIX + k: v for k, v in obj["bnsurgeon"].items()}
    return RawCheckpoint(path, obj, metadata)


def _refuse_harmless_global_when_forced(path: Path, text: str) -> None:
    """Under TORCH_FORCE_WEIGHTS_ONLY_LOAD a read is torch's own load, which admits no Namespace of bnsurgeon's:
    the variable is the reason, not the file."""
    match = UNSUPPORTED_GLOBAL.search(text)
    harmless = {global_name(value) for value in harmless_globals()}
    if match is None or match.group(1) not in harmless or not weights_only_forced():
        return
    raise UnsafeCheckpointError(
        f"{path} holds {match.group(1)}, which bnsurgeon's reads admit, but TORCH_FORCE_WEIGHTS_ONLY_LOAD is set "
        "and makes every read torch's own weights_only load, which refuses it",
        "unset TORCH_FORCE_WEIGHTS_ONLY_LOAD for this command (bnsurgeon's reads are weights_only loads already)",
    )


def refuse_dtypes_this_torch_lacks(path: Path, what: str) -> None:
    """A torch.save file that names a dtype of a newer torch (``torch.float8_e8m0fnu`` on torch 2.4): one line,
    exit 18, naming both versions (as a .safetensors file holding it gets), not "would run code" or "corrupt"."""
    newer = {name.partition(".")[2] for name in globals_named(path) if name.partition(".")[0] == "torch"}
    for dtype in sorted(newer & set(SAFETENSORS_DTYPES.values()) & set(FEATURES)):
        require(dtype, f"{what} (it holds {dtype} tensors)")


#: torch's weights_only refusals of a GLOBAL ("Unsupported global: GLOBAL m.f was not an allowed global",
#: "Trying to load unsupported GLOBAL posix.system whose module posix is blocked"); garbage bytes say otherwise
UNSUPPORTED_GLOBAL = re.compile(r"unsupported global(?:: GLOBAL)? ([\w.]+)", re.IGNORECASE)


def unpickler_refusal(text: str) -> str:
    """What torch's weights_only unpickler could not read ("Unsupported operand 105"), without torch's
    advice around it (which is to turn the safe loader off)."""
    detail = text.partition("WeightsUnpickler error:")[2] or text
    return first_line(detail, "unknown error")[:120]


def unsupported_global(text: str) -> str:
    """What a refused pickle references, for the one-line error."""
    match = UNSUPPORTED_GLOBAL.search(text)
    return f"it references {match.group(1)}" if match else "it references globals outside the safe allow-list"


def _is_tensor_dict(value: Any) -> bool:
    import torch

    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    )


def entry_name(key: Any) -> str:
    """How an entry of a loaded dict is named in listings and reports: a string key as it is, any other
    key (an int, a tuple: weights_only loads them) with its type, so that 5 and '5' stay apart."""
    return key if isinstance(key, str) else f"{shown(key, 200)} ({type(key).__name__} key)"


def _a(word: str) -> str:
    return ("an " if word[:1].lower() in "aeiou" else "a ") + word


def why_not_a_state_dict(obj: Any) -> str | None:
    """For a file with tensors but no state dict: the first entry that keeps a dict from being one.

    The usual containers (``state_dict``, ``model``, ...) are looked at before the top level, so that
    a training checkpoint whose ``state_dict`` has one bad key is described by that key, not by its
    ``state_dict`` entry being a dict.
    """
    import torch

    candidates = []
    if isinstance(obj, dict):
        for key in NESTED_KEYS:
            value = obj.get(key)
            candidates.append((key, value))
            if isinstance(value, dict) and isinstance(value.get("state_dict"), dict):
                candidates.append((f"{key}.state_dict", value["state_dict"]))
    candidates.append(("", obj))
    for where, value in candidates:
        if not isinstance(value, dict):
            continue
        tensors = sum(isinstance(item, torch.Tensor) for item in value.values())
        if not tensors:
            continue
        for key, item in value.items():
            if not isinstance(key, str) or not isinstance(item, torch.Tensor):
                place = f"'{where}' " if where else ""
                what = (
                    f"is {_a(type(item).__name__)}" if isinstance(key, str) else f"is keyed by {_a(type(key).__name__)}"
                )
                return (
                    f"its {place}dict holds {counted(tensors, 'tensor')}, but entry {shown(key)} {what}"
                    " (a state dict maps names to tensors only)"
                )
    nested = count_tensors(obj)
    if nested:  # tensors deeper down, or in a Namespace: "holds no tensors" would misstate the file
        return (
            f"its top level is {_a(type(obj).__name__)} holding {counted(nested, 'tensor')}, not a dict "
            "of names to tensors (nor one under state_dict, model, ...)"
        )
    return None


def state_dict_candidates(obj: Any) -> dict[str, dict[str, "torch.Tensor"]]:
    """Every model-like state dict a loaded object holds, by the key it sits under ('' = top level)."""
    from torch import nn

    if isinstance(obj, nn.Module):
        return {"": obj.state_dict()}
    if _is_tensor_dict(obj):
        return {"": obj}
    found: dict[str, Any] = {}
    if isinstance(obj, dict):
        for key in NESTED_KEYS:
            value = obj.get(key)
            if isinstance(value, nn.Module):
                value = value.state_dict()
            if _is_tensor_dict(value):
                found[key] = value
            elif isinstance(value, dict) and _is_tensor_dict(value.get("state_dict")):
                found[f"{key}.state_dict"] = value["state_dict"]
    return found


def _children(value: Any) -> "Any":
    """What a loaded container holds (weights_only gives dicts, lists, tuples, sets and argparse.Namespace)."""
    import argparse

    if isinstance(value, dict):
        return value.values()
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    if isinstance(value, argparse.Namespace):
        return vars(value).values()
    return ()


def count_tensors(value: Any) -> int:
    """Tensors anywhere inside ``value`` (an optimizer state nests them in dicts of dicts).

    Iterative, and each container is looked into once: a file can nest lists 100,000 deep or
    make a list that holds itself (the unpickler builds both without recursion), which a
    recursive walk turns into a RecursionError.
    """
    import torch
    from torch import nn

    count, stack, seen = 0, [value], set()
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            count += 1
        elif isinstance(item, nn.Module):
            count += len(item.state_dict())
        elif id(item) not in seen:
            seen.add(id(item))
            stack.extend(_children(item))
    return count


def nesting_depth(value: Any, limit: int) -> int:
    """How deep containers nest inside ``value``, counted up to ``limit + 1`` (iterative, cycle-safe)."""
    deepest, stack, seen = 0, [(value, 0)], set()
    while stack:
        item, depth = stack.pop()
        children = _children(item)
        if not children or id(item) in seen:
            continue
        seen.add(id(item))
        deepest = max(deepest, depth + 1)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def describe_checkpoint(raw: RawCheckpoint) -> dict[str, Any]:
    """What a file holds: top-level entries, which of them look like model weights, its metadata."""

    def entry(key: str, value: Any) -> dict[str, Any]:
        return {"key": key, "type": type(value).__name__, "tensors": count_tensors(value)}

    obj = raw.obj
    if isinstance(obj, dict) and not _is_tensor_dict(obj):
        entries = [entry(entry_name(k), v) for k, v in obj.items()]
    else:
        entries = [entry("<top level>", obj)]
    weights = {name or "<top level>": len(state) for name, state in state_dict_candidates(obj).items()}
    return {
        "path": str(raw.path),
        "format": "safetensors" if raw.path.suffix in SAFETENSORS_SUFFIXES else "torch",
        "entries": entries,
        "model_weights": weights,
        "bnsurgeon": raw.is_bnsurgeon,
        "metadata_keys": sorted(raw.metadata),
    }


def strip_common_prefix(state: dict[str, "torch.Tensor"], expected: set[str]) -> tuple[dict[str, "torch.Tensor"], str]:
    """Remove a wrapper prefix (``module.``, ``model.``, or any single shared one) when that fits better."""

    def matches(candidate: dict) -> int:
        return len(expected.intersection(candidate))

    best, best_prefix = state, ""
    first_parts = {key.split(".", 1)[0] + "." for key in state if "." in key}
    prefixes = list(PREFIXES) + sorted(first_parts if len(first_parts) == 1 else [])
    for prefix in prefixes:
        if all(key.startswith(prefix) for key in state):
            stripped = {key[len(prefix) :]: value for key, value in state.items()}
            if matches(stripped) > matches(best):
                best, best_prefix = stripped, prefix
    return best, best_prefix


def expand_aliases(tensors: dict[str, "torch.Tensor"], aliases: dict[str, str]) -> dict[str, "torch.Tensor"]:
    full = dict(tensors)
    for alias, key in aliases.items():
        if key in tensors:
            full[alias] = tensors[key]
    return full


def pick_weights(path: Path, candidates: dict[str, dict], weights: str | None) -> str:
    """The name of the state dict to use: the one asked for (it must exist), else the first found."""
    if weights is not None:
        if weights not in candidates:
            raise UsageError(
                f"{path} has no weights named {weights!r}",
                f"choose one of: {', '.join(repr(k or '<top level>') for k in candidates)}",
            )
        return weights
    return next(iter(candidates))


def symlink_loops(path: Path) -> bool:
    """A symlink whose chain of targets leads back to itself (ELOOP), told apart from a dangling one."""
    import errno

    try:
        os.stat(path)
    except OSError as error:
        return error.errno == errno.ELOOP
    return False
