"""A Hugging Face model directory as an output (``-o DIR``): what ``save_pretrained`` writes.

``from_pretrained(DIR)`` builds the class config.json names, which holds the source's BN classes, so
the weights are written with exactly that class's keys: it loads them with nothing missing and nothing
unexpected. bnsurgeon's metadata goes inside ``model.safetensors`` (safetensors metadata, which
transformers ignores beside ``format``), so ``bnsurgeon.load(DIR)`` rebuilds the converted model.
Batch counters the class has no key for (a frozen BN unfrozen to sync gains ``num_batches_tracked``)
are recorded as metadata (``bnsurgeon.counts``); any other difference (a fused model lacks its BN) is
refused, because the directory could not be both models.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from bnsurgeon.core.errors import OutputError
from bnsurgeon.core.layout import shown
from bnsurgeon.files.writing import check_name_length, check_output_path

if TYPE_CHECKING:
    from torch import nn

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
#: weights save_pretrained may have left in a directory; from_pretrained would read them instead of, or with, ours
OTHER_WEIGHTS = re.compile(
    r"^(model\.safetensors\.index\.json|pytorch_model(-\d+-of-\d+)?\.bin(\.index\.json)?"
    r"|model-\d+-of-\d+\.safetensors)$"
)
#: counters that may live in the metadata instead of the weights
COUNTER_SUFFIX = "num_batches_tracked"


def is_directory_output(output: "str | os.PathLike") -> bool:
    """``-o DIR``: an existing directory, a path ending in a separator, or a name with no file suffix."""
    text = os.fspath(output)
    path = Path(text)
    try:
        existing = path.is_dir()
    except OSError:  # a name too long for the filesystem: check_directory_output says so
        existing = False
    return text.endswith(("/", os.sep)) or existing or (path.suffix == "" and path.name not in ("", ".", ".."))


def check_directory_output(directory: Path, inputs: "list", *, force: bool) -> Path:
    """Refuse a directory output that would lose data or mislead from_pretrained; its weights file's path.

    Nothing is created here: the directory is made when writing starts (``conversion.write_model_directory``).
    """
    check_name_length(directory)
    try:
        return _checked_directory(directory, inputs, force=force)
    except OSError as error:  # the filesystem refused to look at the path at all
        raise OutputError(
            f"cannot use output {directory}: {error.strerror or error}",
            "choose another path (a shorter name, a directory you can write to)",
        ) from None


def _checked_directory(directory: Path, inputs: "list", *, force: bool) -> Path:
    if os.path.lexists(directory) and not directory.is_dir():
        what = (
            "is a symlink to a missing path"
            if directory.is_symlink() and not directory.exists()
            else "exists and is not a directory"
        )
        raise OutputError(
            f"output {directory} {what}", "choose a new directory name, or a file name such as OUT.safetensors"
        )
    for source in inputs:
        source = Path(source[0] if isinstance(source, tuple) else source)
        if (
            source.exists()
            and directory.exists()
            and (os.path.samefile(source, directory) or os.path.samefile(source.parent, directory))
        ):
            raise OutputError(
                f"output directory {directory} holds the input {source}",
                "write to a new directory; bnsurgeon never overwrites an input, --force or not",
            )
    if directory.is_dir():
        others = sorted(p.name for p in directory.iterdir() if OTHER_WEIGHTS.match(p.name))
        if others:
            raise OutputError(
                f"output directory {directory} holds other weights ({shown(others[0], 80)}) that "
                "from_pretrained would read",
                "choose a new or empty directory",
            )
        config = directory / CONFIG_FILE
        if os.path.lexists(config) and not force:
            raise OutputError(f"output {config} already exists", "pass --force to replace it (and the weights)")
        return check_output_path(directory / WEIGHTS_FILE, inputs, force=force)
    parent = directory.parent
    if not parent.is_dir():
        raise OutputError(f"output directory {parent} does not exist", f"create it first (mkdir -p {parent})")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"output directory {parent} is not writable", "choose a directory you can write to")
    return directory / WEIGHTS_FILE


def write_into_directory(directory: Path, writers: dict, *, force: bool) -> None:
    """Every file of ``writers`` (paths inside ``directory``) written as one unit; the directory is created only for
    them, and removed again when the write fails, so that nothing of the run is left behind."""
    from bnsurgeon.files.safewrite import write_files

    try:
        os.mkdir(directory)
        created = True
    except FileExistsError:  # it existed (checked before any work), or another run made it since: ours to fill
        created = False
    except OSError as error:
        raise OutputError(
            f"cannot create output directory {directory}: {error.strerror or error}; nothing was written",
            "choose a directory you can write to",
        ) from None
    if not directory.is_dir():
        raise OutputError(
            f"output {directory} is no longer a directory (changed while bnsurgeon worked); nothing was written",
            "choose another output",
        )
    try:
        write_files(writers, force=force)
    except BaseException:
        if created:
            try:
                os.rmdir(directory)
            except OSError:
                pass
        raise


def pretrained_layout(model: "nn.Module", expected: Iterable[str]) -> tuple[set[str], dict[str, int]]:
    """(keys to leave out of the weights, the counters recorded instead) for ``model`` written where the
    class with state-dict keys ``expected`` will load it; refuses what from_pretrained could not load."""
    state = model.state_dict()
    expected = set(expected)
    missing = sorted(key for key in expected if key not in state)
    extra = sorted(key for key in state if key not in expected)
    others = [key for key in extra if not key.endswith(COUNTER_SUFFIX)]
    if missing or others:
        key, what = (missing[0], "needs") if missing else (others[0], "does not have")
        raise OutputError(
            f"the converted model does not fit the class config.json names ({len(missing)} keys missing, "
            f"{len(others)} extra; from_pretrained {what} {shown(key, 120)}), so a model directory would not load it",
            "write a file instead (-o OUT.safetensors); bnsurgeon.load(OUT) rebuilds it",
        )
    return set(extra), {key: int(state[key].item()) for key in extra}
