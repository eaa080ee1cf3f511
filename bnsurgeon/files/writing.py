"""Write checkpoints: where an output may go (never over an input, never half-written), and the
tensors plus bnsurgeon metadata written to a temporary file in the output's directory, fsynced, then
renamed over the target, so that an interrupted write leaves the previous file intact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from bnsurgeon.core.errors import OutputError
from bnsurgeon.core.json_text import dumps
from bnsurgeon.files.reading import OUTPUT_SUFFIXES, PREFIX, symlink_loops

if TYPE_CHECKING:
    import torch
    from torch import nn


def report_paths(output: Path) -> tuple[Path, Path]:
    """The JSON and Markdown reports written next to an output."""
    return output.with_name(output.name + ".report.json"), output.with_name(output.name + ".report.md")


def check_output_path(
    output: str | os.PathLike, inputs: "list[str | os.PathLike | tuple[str | os.PathLike, str]]", *, force: bool
) -> Path:
    """Refuse outputs that would lose data or cannot be written, before any work is done.

    ``inputs`` are every file the command reads (SOURCE, ``--example-input``): none may be an
    output, ``force`` or not. An item ``(path, label)`` is named by its label in the message.
    """
    out = Path(output)
    try:
        str(out).encode("utf-8")
    except UnicodeEncodeError:
        raise OutputError(
            f"output name {str(out)!r} is not valid UTF-8", "choose a name made of UTF-8 characters"
        ) from None
    try:
        return _check_output_path(out, inputs, force=force)
    except OSError as error:
        raise OutputError(
            f"cannot use output {out}: {error.strerror or error}",
            "choose another path (a shorter name, a directory you can write to)",
        ) from None


def check_name_length(out: Path) -> None:
    """Refuse a name that, with the suffixes bnsurgeon adds, would not fit the filesystem (an OSError later)."""
    from bnsurgeon.files.safewrite import NAME_OVERHEAD

    parent = out.parent if str(out.parent) else Path(".")
    try:
        name_max = os.pathconf(parent if parent.is_dir() else ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    length = len(os.fsencode(out.name))
    if length + NAME_OVERHEAD > name_max:
        raise OutputError(
            f"output name is {length} bytes; with the report and temp-file suffixes bnsurgeon adds it would exceed "
            f"this filesystem's {name_max}-byte limit",
            f"use a name of at most {name_max - NAME_OVERHEAD} bytes",
        )


def _check_output_path(
    out: Path, inputs: "list[str | os.PathLike | tuple[str | os.PathLike, str]]", *, force: bool
) -> Path:
    parent = out.parent if str(out.parent) else Path(".")
    check_name_length(out)
    if out.suffix not in OUTPUT_SUFFIXES and not out.name.endswith(".pth.tar"):
        raise OutputError(
            f"cannot tell the format of output {out}",
            f"end it with one of {', '.join(OUTPUT_SUFFIXES)}, .pth.tar (or with / for a model directory)",
        )
    written = (out, *report_paths(out))  # the reports are outputs too: each is checked like the checkpoint
    for entry in inputs:  # the SOURCE as typed and every file it reads (``ResolvedSource.inputs``), other inputs
        given, label = entry if isinstance(entry, tuple) else (entry, "the input file")
        source_path = Path(given)
        for path in written:
            same = _resolved(source_path) == _resolved(path) or (
                source_path.exists() and path.exists() and os.path.samefile(source_path, path)
            )
            if same:
                what = "output" if path == out else "report"
                raise OutputError(
                    f"{what} {path} is {label}",
                    "write to a new path; bnsurgeon never overwrites an input, --force or not",
                )
    for path in written:
        if path.is_dir():
            raise OutputError(
                f"output {path} is a directory",
                "give a file path such as OUT.safetensors"
                if path == out
                else f"move the directory {path} away, or choose another output name",
            )
    if not parent.is_dir():
        blocker = _not_a_directory(parent)
        if blocker is not None:  # "does not exist" would misstate it, and mkdir -p would fail on it
            path, what = blocker
            where = f"output directory {parent}" + ("" if path == parent else f" cannot be created: {path}")
            movable = not what.startswith("is not a directory")  # never advise moving a device such as /dev/null
            raise OutputError(
                f"{where} {what}", "choose an output in a directory" + (f", or move {path} away" if movable else "")
            )
        raise OutputError(f"output directory {parent} does not exist", f"create it first (mkdir -p {parent})")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"output directory {parent} is not writable", "choose a directory you can write to")
    for path in written:  # lexists: a dangling symlink is a name that exists (a hard link onto it fails at the end)
        if os.path.lexists(path) and not force:
            kind = (
                "already exists"
                if path.exists()
                else (
                    "is a symlink that leads back to itself"
                    if symlink_loops(path)
                    else "is a symlink to a missing file"
                )
            )
            raise OutputError(f"output {path} {kind}", "pass --force to replace it (and its reports)")
    return out


def _resolved(path: Path) -> Path:
    """``path.resolve()``, or the absolute path where a symlink loops (resolve raises RuntimeError on it)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError):
        return Path(os.path.abspath(path))


def _not_a_directory(directory: Path) -> "tuple[Path, str] | None":
    """The first existing path on the way to ``directory`` that is not a directory, and what it is instead."""
    for path in (directory, *directory.parents):
        if not os.path.lexists(path):
            continue
        if path.is_dir():
            return None
        if path.is_symlink() and not path.exists():
            return path, "is a symlink to a missing path, not a directory"
        if path.is_file():
            return path, "is a file, not a directory"
        return path, "is not a directory (a pipe, socket or device)"
    return None


def atomic_write(path: Path, write: Callable[[Path], None], *, force: bool = True) -> None:
    """Write one file atomically (see ``safewrite.write_files``); replaces it unless ``force=False``."""
    from bnsurgeon.files.safewrite import write_files

    write_files({path: write}, force=force)


def unique_tensors(model: "nn.Module") -> tuple[dict[str, "torch.Tensor"], dict[str, str]]:
    """The state dict without repeats: a tensor reached by two names is stored once + an alias."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[int, str] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            aliases[key] = seen[id(value)]
            continue
        seen[id(value)] = key
        tensors[key] = value.detach().contiguous()
    return tensors, aliases


def checkpoint_writer(
    path: Path,
    model: "nn.Module",
    metadata: dict[str, Any],
    extras: dict[str, Any] | None = None,
    leave_out: "set[str] | frozenset[str]" = frozenset(),
) -> Callable[[Path], None]:
    """A function writing the model's tensors plus ``bnsurgeon.*`` metadata (format from ``path``) to a temp path.

    In a .pt output the tensors go under ``metadata['weights']`` (default ``state_dict``); ``extras`` (a training
    checkpoint's other entries) may not take that name or ``bnsurgeon``: the file would not load back.
    ``leave_out``: keys whose values the metadata holds instead (``model_directory.pretrained_layout``).
    """
    tensors, aliases = unique_tensors(model)
    tensors = {key: tensor for key, tensor in tensors.items() if key not in leave_out}
    flat = {"format": "pt"}
    flat.update({PREFIX + key: dumps(value) for key, value in metadata.items()})
    flat[PREFIX + "aliases"] = dumps(aliases)
    if path.suffix == ".safetensors":
        import safetensors.torch

        # any temp file safetensors makes lands next to ``temp``: inside our staging directory
        return lambda temp: safetensors.torch.save_file(tensors, str(temp), metadata=flat)
    main = metadata.get("weights", "state_dict")
    payload: dict[str, Any] = {
        main: tensors,
        "bnsurgeon": {k[len(PREFIX) :]: v for k, v in flat.items() if k.startswith(PREFIX)},
    }
    payload["bnsurgeon"]["format"] = "pt"
    clash = sorted(set(extras or {}) & set(payload), key=str)
    if clash:
        raise OutputError(
            f"an entry to carry is named {clash[0]!r}, where the output keeps "
            + ("bnsurgeon's metadata" if clash[0] == "bnsurgeon" else "the model's weights"),
            "write a .safetensors output (the weights only), or rename that entry in the source",
        )
    if extras:
        payload.update(extras)
    return lambda temp: _torch_save(payload, temp)


class _WriteErrorKeeper:
    """A file object for torch.save that keeps the OSError of a failed write.

    torch's zip writer reports a full disk as "unexpected pos N vs M"; the error it swallowed
    (ENOSPC, EDQUOT, EIO) is what the user needs to read.
    """

    def __init__(self, handle) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.handle.flush()


def _torch_save(payload: Any, temp: Path) -> None:
    import torch

    with open(temp, "wb") as handle:
        writer = _WriteErrorKeeper(handle)
        try:
            torch.save(payload, writer)  # type: ignore[arg-type]  # file-like: torch.save only writes and flushes
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise


def write_checkpoint(
    path: Path,
    model: "nn.Module",
    metadata: dict[str, Any],
    extras: dict[str, Any] | None = None,
    *,
    force: bool = True,
) -> None:
    """Write the model's tensors plus ``bnsurgeon.*`` metadata to .safetensors or .pt/.pth (atomic)."""
    atomic_write(path, checkpoint_writer(path, model, metadata, extras), force=force)
