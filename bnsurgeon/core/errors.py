"""Errors raised by bnsurgeon's library code.

Each error carries the exit code the CLI turns it into and a one-line hint that tells
the user how to fix the problem. Library code raises; only ``cli.py`` exits.
"""

from __future__ import annotations

import re
from typing import Any

#: hints are written for the command line; from Python each flag reads as its keyword argument
FLAG_KEYWORDS = {
    "--allow-unhandled": "allow_unhandled=True",
    "--allow-no-bn": "allow_no_bn=True",
    "--trust-pickle": "trust_pickle=True",
    "--force": "force=True",
    "--no-check": "check=False",
    "--model": "model=",
    "--model-arg": "model_args=",
    "--weights": "weights=",
    "--input-shape": "input_shape=",
    "--to": "to=",
    "--frozen": "frozen=",
    "--world-size": "world_sizes=",
    "--accept-recorded-args": "accept_recorded_args=True",
    "--example-input": "example_input=",
    "--include": "include=",
    "--exclude": "exclude=",
    "--verify": "verify_world_sizes=",
    "--converted-model": "converted_model=",
    "--converted-model-arg": "converted_model_args=",
    "--converted-weights": "converted_weights=",
    "--compare-at": "compare_at=",
    "--precision": "precision=",
    "--device": "device=",
    "--atol": "atol=",
    "--no-perturb": "perturb=False",
    "--data": "data=",
    "--batches": "batches=",
    "--samples": "samples=",
    "--batch-size": "batch_size=",
    "--include-frozen": "include_frozen=True",
    "--fast-normalization": "fast_normalization=True",
}

#: flags whose keyword argument takes the flag's value as a string
STRING_VALUED = (
    "--model",
    "--weights",
    "--to",
    "--frozen",
    "--converted-model",
    "--converted-weights",
    "--compare-at",
    "--example-input",
)
#: words that follow a flag in prose ("check --model and --model-arg"): never its value
PROSE_WORDS = frozenset(
    {
        "and",
        "or",
        "to",
        "with",
        "for",
        "if",
        "is",
        "in",
        "on",
        "the",
        "a",
        "an",
        "then",
        "when",
        "instead",
        "too",
        "also",
        "as",
        "at",
        "by",
        "of",
    }
)


def python_hint(hint: str) -> str:
    """A command-line hint with every known flag written as the keyword argument.

    ``--force`` -> ``force=True``; ``--model ARCH`` -> ``model=ARCH``; a valued flag with
    no placeholder after it (``check --model-arg``) -> the bare name (``check model_args``).
    """

    def keyword(match: re.Match) -> str:
        flag, placeholder = match.group(1), match.group(2)
        if placeholder in PROSE_WORDS:  # a word of the sentence, not the flag's value: keep it as it is
            return _keyword_alone(flag) + f" {placeholder}"
        replacement = FLAG_KEYWORDS.get(flag)
        if replacement is None:
            return match.group(0)
        if not replacement.endswith("="):
            return replacement + (f" {placeholder}" if placeholder else "")
        if placeholder and placeholder.isupper():  # --model ARCH -> model=ARCH
            return replacement + placeholder
        if placeholder and flag in STRING_VALUED:  # --model pkg.mod:fn -> model='pkg.mod:fn'
            return replacement + repr(placeholder)
        return replacement[:-1] + (f" {placeholder}" if placeholder else "")

    return re.sub(r"(--[a-z][a-z0-9-]*)(?: ([^\s(),;]+))?", keyword, hint)


def _keyword_alone(flag: str) -> str:
    """The keyword for a flag written without its value (``--model`` -> ``model``, ``--force`` -> ``force=True``)."""
    replacement = FLAG_KEYWORDS.get(flag)
    if replacement is None:
        return flag
    return replacement[:-1] if replacement.endswith("=") else replacement


#: no message or hint is longer: names, keys and values in them come from files and users
MAX_TEXT = 1000
_CUT_MARK = re.compile(r"\.\.\. \(([\d,]+) more characters?\)$")


def bounded(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` cut to ``limit`` characters, ending in ``... (N more characters)`` when cut.

    Idempotent, and the count stays true when a cut text is cut again.
    """
    if len(text) <= limit:
        return text
    earlier, match = 0, _CUT_MARK.search(text)
    if match:
        earlier, text = int(match.group(1).replace(",", "")), text[: match.start()]
    keep = max(0, limit - len(f"... ({len(text) + earlier:,} more characters)"))
    return f"{text[:keep]}... ({len(text) - keep + earlier:,} more characters)"


class BnSurgeonError(Exception):
    """Base class: a problem with the user's input or environment, never a bug.

    ``python`` is the hint for a Python caller where ``python_hint`` cannot derive it from
    the command-line hint (a whole dict of arguments rather than a flag per value).
    """

    exit_code: int = 2
    default_hint: str = ""

    def __init__(self, message: str, hint: str | None = None, *, python: str | None = None) -> None:
        message = bounded(message)
        super().__init__(message)
        self.message = message
        self.hint = bounded(hint if hint is not None else self.default_hint)
        self.python = bounded(python) if python else None

    def __str__(self) -> str:
        """What a Python caller sees: the hint names keyword arguments, not flags (the CLI prints ``hint``)."""
        hint = self.python or bounded(python_hint(self.hint))
        return f"{self.message} ({hint})" if hint else self.message


class UsageError(BnSurgeonError):
    """A flag or argument value that cannot be used."""

    exit_code = 2


class HookedModelError(UsageError):
    """A model with hooks that a fused file's folds would change what they see (the file is fine)."""

    default_hint = (
        "remove the hooks before loading (their RemovableHandle.remove()), load, then register them "
        "again where they still make sense; or load a file converted --to sync or --to plain"
    )


class FactoryRaisedError(UsageError):
    """The user's factory raised while building the model (on the meta device it may build for real)."""


class RuleRaisedError(UsageError):
    """A user's rule raised while building its replacement (the user's code, like a factory; a built-in
    rule that raises is a bug in bnsurgeon and is not wrapped)."""


class UnshippableModelError(UsageError):
    """The N-rank check cannot give the ranks the converted model: it does not pickle, and it was not
    built from a recipe (timm name, factory, model directory, bnsurgeon file) a rank can repeat."""

    default_hint = (
        "pass SOURCE as something a process can build again: a timm name, a model directory "
        "or a factory (package.module:function) that builds it"
    )


class SourceNotFoundError(BnSurgeonError):
    """A SOURCE that names no file, timm model or importable factory."""

    exit_code = 3


class ShadowedModuleError(BnSurgeonError):
    """A module in the working directory (first on the import path for the user's factory) hides an installed
    module of the same name: ``safetensors.py`` beside ``mymodels.py``. The user's environment, not a bug."""

    exit_code = 17  # 16: HostFailureError


class CheckpointError(BnSurgeonError):
    """A file that exists but is not a checkpoint bnsurgeon can read."""

    exit_code = 4


class UnsafeCheckpointError(CheckpointError):
    """A pickle that would execute code when loaded."""

    exit_code = 5
    default_hint = (
        "only if you trust the file's origin, pass --trust-pickle (unpickling runs code); "
        "otherwise ask for a state dict or a .safetensors file"
    )


class MetadataError(CheckpointError):
    """bnsurgeon metadata that is malformed, from a newer schema, or inconsistent with the tensors."""

    default_hint = "the file's bnsurgeon.* metadata was edited or damaged; convert the original again"


class InputChangedError(CheckpointError):
    """An input file rewritten while bnsurgeon was reading it: the tensors may mix two versions."""

    default_hint = "nothing was written; run again once nothing else is writing the file"


class NonFiniteWeightsError(CheckpointError):
    """Weights holding NaN or Inf: no output comparison can prove anything about them."""

    default_hint = "nothing was written; use a checkpoint saved before training diverged"


class PreprocessorConfigError(CheckpointError):
    """A model directory's preprocessor_config.json whose values cannot be preprocessing (a size of 0, a mean of
    two values for three channels): named with the field, before any image is read."""

    default_hint = "fix the field in preprocessor_config.json, or save the image processor again with save_pretrained"


class WeightsMismatchError(BnSurgeonError):
    """Weights whose keys or shapes do not fit the architecture."""

    exit_code = 6


class UnhandledModuleError(BnSurgeonError):
    """A BatchNorm-like module that no rule claims (converting it silently would lose behaviour)."""

    exit_code = 7
    default_hint = (
        "register a rule for the class (bnsurgeon.rules.register), or pass --allow-unhandled "
        "to leave such modules untouched"
    )


class LazyModuleError(BnSurgeonError):
    """An uninitialized LazyBatchNorm whose size is not known yet."""

    exit_code = 7
    default_hint = "run one forward pass (or load the weights) before converting"


class OutputError(BnSurgeonError):
    """An output path that cannot or must not be written."""

    exit_code = 8


class ModelCannotRunError(BnSurgeonError):
    """The model raised on the check input, or the input cannot even be allocated."""

    exit_code = 9
    default_hint = "pass --input-shape with the input the model takes (N,C,H,W), or --no-check"


class ConfirmationError(UsageError):
    """A file names code to import or constructor arguments the user has not confirmed."""

    exit_code = 10


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived; raised like KeyboardInterrupt so every cleanup runs."""

    def __init__(self, signum: int, state: str = "nothing was written") -> None:
        import signal

        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        self.state = state  # what is on disk, said exactly


class NothingToConvertError(BnSurgeonError):
    """A model with no BatchNorm-family module: a conversion would only copy it."""

    exit_code = 11  # 9 and 10 are taken by issue 12 (check input, unconfirmed code)
    default_hint = "nothing was written; pass --allow-no-bn to write the unchanged model anyway"


class VerificationError(BnSurgeonError):
    """A converted model whose outputs differ from the source's."""

    exit_code = 1
    default_hint = "nothing was written; run `bnsurgeon inspect` on the source and report the module named here"


class DistributedMismatchError(RuntimeError):
    """Ranks reached different sync layers: they would otherwise hang or mix statistics."""


class DistributedTimeoutError(RuntimeError):
    """A sync layer's collective did not complete within BNSURGEON_DIST_TIMEOUT, or the process group's own
    timeout where that is shorter (the message names which), or was cut off by a rank that left: a rank is
    elsewhere or gone."""


class ReplicaFailedError(RuntimeError):
    """A DataParallel replica failed inside a sync layer: the other replicas stop instead of waiting for it."""


class GraphCaptureError(RuntimeError):
    """A sync layer's first training call ran inside CUDA graph capture: its device constants would be
    recorded instead of made (garbage for eager calls, re-made at every replay)."""


def first_line(error: "BaseException | str", default: str = "no message") -> str:
    """The first line of an exception's (or a text's) message, at most 200 characters: what a one-line
    error quotes of a third party's message. A message that cannot be made (a ``__str__`` that raises) is
    said so, never a second error that hides the first."""
    try:
        text = str(error).strip()
    except Exception:  # noqa: BLE001 - third-party code: whatever it raises, the caller's one line goes on
        return f"({type(error).__name__}'s message cannot be shown)"
    return (text.splitlines()[0] if text else default)[:200]


class TorchTooOldError(BnSurgeonError):
    """A feature the installed torch does not have (older than the release that brought it): said with both
    versions, never as a fault of the user's input (``core/torch_versions.py``)."""

    exit_code = 18
    default_hint = "install a newer torch (pip install -U torch)"


class DataError(BnSurgeonError):
    """Recalibration data that cannot be used: missing, unreadable, malformed, too large, or empty."""

    exit_code = 12
    default_hint = "nothing was written; pass --data with batches the model takes (a tensor file, a folder of them, or pkg.mod:function)"


class NotEnoughDataError(DataError):
    """The data holds fewer samples or batches than --samples/--batches asked for (the message says how many)."""

    exit_code = 13


class NonFiniteActivationsError(BnSurgeonError):
    """A BN module's input held NaN or Inf during recalibration: its statistics would be meaningless."""

    exit_code = 14
    default_hint = (
        "nothing was written; check the data (normalised? NaN pixels?) and the weights feeding the module named here"
    )


class StatisticsOverflowError(NonFiniteActivationsError):
    """Recalibrated statistics larger than the dtype that must store them can hold: they would be written as Inf."""

    default_hint = (
        "nothing was written; pass the data normalised as the model expects (pixels scaled, mean and std "
        "applied), or recalibrate a copy of the model in a wider dtype (float32)"
    )


def statistics_overflow(path: str, values: "dict[str, Any]", dtype: Any) -> "StatisticsOverflowError | None":
    """The error for the first of ``values`` (buffer name -> float64 tensor) that ``dtype`` turns into Inf, or None."""
    import torch

    for name, value in values.items():
        if bool(torch.isfinite(value).all()) and not bool(torch.isfinite(value.to(dtype)).all()):
            largest = float(value.abs().max())
            kind = str(dtype).replace("torch.", "")
            return StatisticsOverflowError(
                f"the recalibrated {name} of {path} reaches {largest:.3g}, more than {kind} holds "
                f"({torch.finfo(dtype).max:.3g}): it would be written as Inf"
            )
    return None


class NoBatchNormReachedError(BnSurgeonError):
    """The forward passes over the data never called any BN module that recalibration tracks."""

    exit_code = 15
    default_hint = (
        "nothing was written; the data must go through the BN layers (a backbone's input, not its "
        "features), or check which BN modules the forward calls"
    )


class RankEndedError(BnSurgeonError):
    """Another rank of a torchrun check ended with an error of its own (which it printed): this rank stops with its
    exit code, saying nothing more."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None, *, exit_code: int = 1) -> None:
        super().__init__(message, hint)
        self.exit_code = exit_code


class HostFailureError(BnSurgeonError):
    """The machine stopped a check's rank process: killed it (SIGKILL, as the out-of-memory killer does), or
    the rank ran out of memory, open files or disk. Not a verdict on the model: the checks that ran passed."""

    exit_code = 16
    default_hint = "nothing was written; free the resource named (memory, open files: ulimit -n) and run again"
