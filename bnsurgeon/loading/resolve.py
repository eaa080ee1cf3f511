"""The one door into ``loading/``: a SOURCE string resolved once into a ``ResolvedSource``.

What a SOURCE is gets decided here and nowhere else. ``resolve_source`` reads the string and the
filesystem (nothing is opened but a shard index): a timm name, a factory, a checkpoint file, a Hugging
Face model directory (named as the directory or its config.json), or a weights file of one; every file
reading it may open; the architecture the string names; the trust it needs. What only the file's contents
can tell (a bnsurgeon checkpoint, a training checkpoint, a pickled module, a directory bnsurgeon wrote)
is told by ``ResolvedSource.read_as`` once the file is read, here too. The steps below take the value,
never the string: the loaders (``sources.py``, ``rebuild.py``), the output checks (``files``), the reports
(the loaded model's description) and verify's ranks (the recipe of what was loaded).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from bnsurgeon.core.errors import SourceNotFoundError
from bnsurgeon.core.paths import check_reachable
from bnsurgeon.files.model_directory import WEIGHTS_FILE
from bnsurgeon.files.reading import SAFETENSORS_SUFFIXES, TORCH_SUFFIXES, RawCheckpoint, read_checkpoint
from bnsurgeon.loading.transformers_source import (
    CONFIG_NAME,
    PREPROCESSOR_FILE,
    SHARD_PATTERN,
    WEIGHTS_NAMES,
    directory_inputs,
)

#: what the string and the filesystem tell (``resolve_source``)
TIMM = "timm name"
FACTORY = "factory"
CHECKPOINT = "checkpoint file"
MODEL_DIRECTORY = "model directory"  # the directory, or its config.json
DIRECTORY_WEIGHTS = "weights file of a model directory"  # model.safetensors, a shard, ... named without --model
#: what the file's contents tell (``ResolvedSource.read_as``)
BNSURGEON = "bnsurgeon checkpoint"
BNSURGEON_DIRECTORY = "model directory bnsurgeon wrote"
TRANSFORMERS_DIRECTORY = "transformers model directory"
TRAINING_CHECKPOINT = "training checkpoint"
PICKLED_MODULE = "pickled module"
STATE_DICT = "state dict"

NAME_KINDS = (TIMM, FACTORY)
KINDS = (
    TIMM,
    FACTORY,
    CHECKPOINT,
    MODEL_DIRECTORY,
    DIRECTORY_WEIGHTS,
    BNSURGEON,
    BNSURGEON_DIRECTORY,
    TRANSFORMERS_DIRECTORY,
    TRAINING_CHECKPOINT,
    PICKLED_MODULE,
    STATE_DICT,
)


@dataclass(frozen=True)
class SourceTrust:
    """What loading the SOURCE asks the user to have confirmed (``trust.py`` holds the rules)."""

    #: user code the SOURCE names (``pkg.mod:fn``): it runs because the user named it
    factory: str | None = None
    #: a torch pickle file: weights_only, and a whole-module pickle only with ``--trust-pickle``
    pickle: bool = False
    #: the file records an architecture (bnsurgeon's metadata, a training checkpoint's arch/args): a recorded
    #: factory or constructor arguments are used only when the user names the same (``confirm_architecture``)
    recorded: bool = False

    def describe(self) -> str:
        needs = [f"the factory {self.factory} runs (named)"] if self.factory else []
        needs += ["a pickle (code only with --trust-pickle)"] if self.pickle else []
        needs += ["a recorded architecture (confirmed by naming it)"] if self.recorded else []
        return "; ".join(needs) or "none"


@dataclass(frozen=True)
class ResolvedSource:
    """A SOURCE, resolved once: what it is, every file reading it may open, what it names, the trust it needs."""

    #: the SOURCE as typed (messages, the output checks' first input)
    text: str
    kind: str
    #: how the user types it, for messages (SOURCE, CONVERTED)
    role: str = "SOURCE"
    #: the path the SOURCE names (None for a timm name or a factory)
    path: Path | None = None
    #: the checkpoint file read for the model's tensors (None for a name; transformers reads a directory's)
    weights: Path | None = None
    #: the model directory the path belongs to (a Hugging Face model's, or one bnsurgeon wrote), or None
    directory: Path | None = None
    #: every file reading the SOURCE may open: the file itself, a directory's config.json, weights, shards and
    #: index, preprocessor_config.json, and the reports beside a weights file. None may be an output.
    files: tuple[Path, ...] = ()
    #: the architecture the string names (a timm name, a factory, the --model typed for a file), if any
    architecture: str | None = None
    trust: SourceTrust = field(default_factory=SourceTrust)

    @property
    def is_name(self) -> bool:
        return self.kind in NAME_KINDS

    @property
    def names_directory(self) -> bool:
        """SOURCE is a model directory named as the directory or its config.json (not one of its weights files)."""
        directory = self.directory
        return directory is not None and self.path in (directory, directory / CONFIG_NAME)

    @property
    def real_files(self) -> tuple[Path, ...]:
        """``files`` by real path (links followed), as the output checks compare them."""
        return tuple(Path(os.path.realpath(path)) for path in self.files)

    def inputs(self) -> "list[str | tuple[Path, str]]":
        """What an output may not be, ``--force`` or not, each with its label for the messages: the SOURCE as
        typed, then every file it reads."""
        label = f"a file {self.role} {self.path} reads"
        return [self.text, *((file, label) for file in self.files)]

    def read_as(self, raw: RawCheckpoint) -> "ResolvedSource":
        """The same SOURCE, its kind told by what its file holds (``raw``, the file read)."""
        from torch import nn

        if isinstance(raw.obj, nn.Module):
            kind, trust = PICKLED_MODULE, replace(self.trust, pickle=True)
        elif raw.is_bnsurgeon:
            kind = BNSURGEON_DIRECTORY if self.kind == MODEL_DIRECTORY else BNSURGEON
            trust = replace(self.trust, recorded=True)
        elif isinstance(raw.obj, dict) and isinstance(raw.obj.get("arch"), str):
            kind, trust = TRAINING_CHECKPOINT, replace(self.trust, recorded=True)
        else:
            kind, trust = STATE_DICT, self.trust
        return replace(self, kind=kind, weights=Path(raw.path), trust=trust)

    def naming(self, architecture: str) -> "ResolvedSource":
        """The same SOURCE, with the architecture its file names (read from it: recorded, ``arch``, config.json)."""
        return replace(self, architecture=architecture)

    def as_transformers(self) -> "ResolvedSource":
        """The same SOURCE, read as transformers' own model directory (its weights are not bnsurgeon's)."""
        return replace(self, kind=TRANSFORMERS_DIRECTORY, weights=None)

    def describe(self) -> str:
        """One line: the SOURCE, its kind, and the trust it needs."""
        return f"{self.text} ({self.kind}; trust: {self.trust.describe()})"


def looks_like_file(source: str) -> bool:
    path = Path(source)
    return path.exists() or path.is_symlink() or path.suffix in SAFETENSORS_SUFFIXES + TORCH_SUFFIXES or "/" in source


def model_directory(path: Path) -> Path | None:
    """The model directory ``path`` names: itself (holding config.json), config.json's directory, or the
    directory of a save_pretrained weights file; None otherwise."""
    if path.is_dir():
        return path if (path / CONFIG_NAME).is_file() else None
    if path.name == CONFIG_NAME or path.name in WEIGHTS_NAMES or SHARD_PATTERN.match(path.name):
        return path.parent if (path.parent / CONFIG_NAME).is_file() else None
    return None


def _directory_of(path: Path) -> Path | None:
    try:
        return model_directory(path)
    except OSError:  # a name the filesystem refuses: reading it fails with its own message
        return None


def check_source_name(source: "str | os.PathLike", what: str = "SOURCE") -> None:
    """A SOURCE the filesystem refuses as a name (too long, in a directory that cannot be searched) is named as
    such, before any check of what it is."""
    check_reachable(
        source, what, SourceNotFoundError, "check the path (or name a timm model or package.module:function)"
    )


def resolve_source(
    source: "str | os.PathLike | ResolvedSource",
    *,
    role: str = "SOURCE",
    model: str | None = None,
    check_name: bool = True,
) -> ResolvedSource:
    """What SOURCE is, from the string and the filesystem, once (``model``: the --model the user typed for it,
    which makes a weights file of a model directory a plain checkpoint file). A ``ResolvedSource`` passes as it is.
    Nothing is read but a shard index (for the files it names); the contents are told by ``read_as``.
    ``check_name``: a name the filesystem refuses (too long, unsearchable) is refused first, naming ``role``."""
    if isinstance(source, ResolvedSource):
        return source
    text = os.fspath(source)
    if text.startswith(
        "timm:"
    ):  # always timm's model, even where a file of that name exists (a pull request can add one)
        return ResolvedSource(text, TIMM, role, architecture=text)
    if check_name:
        check_source_name(text, role)
    if not looks_like_file(text):
        if text.startswith("timm:") or ":" not in text:
            return ResolvedSource(text, TIMM, role, architecture=text)
        return ResolvedSource(text, FACTORY, role, architecture=text, trust=SourceTrust(factory=text))
    path = Path(text)
    directory = _directory_of(path)
    files = [] if path.is_dir() else [path]
    if directory is not None:
        files += directory_inputs(directory)
        preprocessor = directory / PREPROCESSOR_FILE
        files += [preprocessor] if os.path.lexists(preprocessor) else []
    if not path.is_dir():
        files += [beside for beside in _reports_beside(path) if os.path.lexists(beside)]
    pickle = path.suffix not in SAFETENSORS_SUFFIXES
    listed = tuple(dict.fromkeys(files))
    if directory is not None and (path.is_dir() or path.name == CONFIG_NAME):
        kind, weights, trust = MODEL_DIRECTORY, directory / WEIGHTS_FILE, SourceTrust()
    elif directory is not None and not model:
        kind, weights, trust = DIRECTORY_WEIGHTS, path, SourceTrust(pickle=pickle)
    else:
        kind, weights, trust = CHECKPOINT, path, SourceTrust(pickle=pickle)
    named = None if kind == DIRECTORY_WEIGHTS else model
    return ResolvedSource(text, kind, role, path, weights, directory, listed, named, trust)


def _reports_beside(path: Path) -> tuple[Path, Path]:
    return path.with_name(path.name + ".report.json"), path.with_name(path.name + ".report.md")


def bnsurgeon_weights(resolved: ResolvedSource) -> Path | None:
    """The bnsurgeon-written weights of the model directory SOURCE names (``-o DIR`` wrote it), or None: such a
    directory is the converted model, rebuilt from its metadata, not its config's class. Reads the file."""
    if resolved.kind != MODEL_DIRECTORY or resolved.weights is None:
        return None
    weights = resolved.weights
    return weights if weights.is_file() and read_checkpoint(weights, mmap=True).is_bnsurgeon else None


def peek(resolved: ResolvedSource, raw: RawCheckpoint | None = None) -> ResolvedSource:
    """A weights file of a model directory (``raw``, or read here memory-mapped) tells whether bnsurgeon wrote it
    (its own metadata wins: a bnsurgeon checkpoint) or transformers reads it with its directory."""
    assert resolved.kind == DIRECTORY_WEIGHTS and resolved.weights is not None
    raw = raw or read_checkpoint(resolved.weights, mmap=True)
    return resolved.read_as(raw) if raw.is_bnsurgeon else resolved.as_transformers()
