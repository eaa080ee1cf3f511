"""The ``bnsurgeon`` command line: parse, call one API function, render. No logic here.

Errors from the library become one line on stderr and a distinct exit code; set
BNSURGEON_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import functools
import os
import re
from enum import Enum
from pathlib import Path
from typing import Any, Callable, List, Optional

import click
import typer
import typer.core

from bnsurgeon import __version__
from bnsurgeon.core.errors import BnSurgeonError

EXIT_CODES = {  # the README's table, in short
    0: "success",
    1: "the converted model's outputs differ from the source's (nothing written); verify: a check failed",
    2: "usage: a bad flag or value, a model that cannot be built with its arguments, a malformed factory name",
    3: "SOURCE not found: no such file, timm model or factory",
    4: "not a readable checkpoint (empty, corrupt, no weights, bad metadata, NaN/Inf weights, changed while read)",
    5: "the checkpoint is a pickle that would run code (see --trust-pickle)",
    6: "the weights do not fit the architecture; verify: CONVERTED was not made from SOURCE",
    7: "a BatchNorm-like module no rule claims, or an uninitialized lazy BN",
    8: "the output path (or a report next to it) cannot or must not be written",
    9: "the model cannot run on the check input (it raised, the check failed on NaN outputs, or the input cannot be allocated)",
    10: "the file names code or constructor arguments you have not confirmed (see --model, --accept-recorded-args)",
    11: "the model has no BatchNorm-family module: nothing to convert, nothing written (see --allow-no-bn)",
    12: "recalibrate: DATA missing, unreadable, malformed, too large, or empty (nothing written)",
    13: "recalibrate: DATA holds fewer samples/batches than --samples/--batches asked for (the message says how many)",
    14: "recalibrate: a BN module's input held NaN/Inf (the message names it; nothing written)",
    15: "recalibrate: the forward over DATA reached no BN module (nothing written)",
    17: "a module in the working directory hides an installed one your factory or bnsurgeon imports (it is named)",
    18: "a feature the installed torch is too old for (the message names both versions)",
    70: "internal error: a bug in bnsurgeon, not in the input (the traceback with -v or BNSURGEON_DEBUG=1)",
    129: "interrupted by SIGHUP; the message says what is on disk (nothing partial)",
    130: "interrupted by Ctrl-C (SIGINT); the message says what is on disk (nothing partial)",
    143: "interrupted by SIGTERM (e.g. a scheduler's preemption); the message says what is on disk (nothing partial)",
}


class _NamedArgument(typer.core.TyperArgument):
    """An argument whose metavar says what it takes: no "SOURCE <str>" type label after it."""

    def display_type_rich(self, ctx):  # noqa: ANN001 - Click's signature
        return None if self.metavar else super().display_type_rich(ctx)


class _Command(typer.core.TyperCommand):
    """Typer's command, with named arguments shown by their name alone; under ``--json`` a usage error Click
    words is the one JSON document too."""

    def make_context(self, info_name: Any, args: Any, parent: Any = None, **extra: Any) -> Any:
        from bnsurgeon.cli.render import emit_json_error, want_json

        given = list(args)
        # before Click parses: an unknown option stops it before --json's own callback runs
        options = given[: given.index("--")] if "--" in given else given
        want_json(any(param.name == "as_json" for param in self.params) and "--json" in options)
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except Exception as error:  # Click's UsageError (Typer may vendor its own Click: told by what it has)
            words = getattr(error, "format_message", None)
            if callable(words) and getattr(error, "exit_code", None) == 2:
                emit_json_error(words(), f"see 'bnsurgeon {info_name} --help'", 2)
            raise

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.help and not self.short_help:  # the summary whole: Click would cut it to fit `bnsurgeon --help`
            self.short_help = self.help.strip().splitlines()[0]
        for param in self.params:
            if type(param) is typer.core.TyperArgument:
                param.__class__ = _NamedArgument


app = typer.Typer(
    name="bnsurgeon",
    help="Exact BatchNorm surgery for PyTorch/timm models: inspect, convert to sync / plain / frozen / fused BN, verify.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    # plain Click help, in a terminal and in logs alike: no box drawing, and flags without
    # the "<bool>" type labels that this Typer's Rich panels print for every option
    rich_markup_mode=None,
)


#: an error line quotes file metadata and paths: a 1 MB field must not become a 1 MB "line"
MAX_ERROR_CHARS = 1000


def _bounded(text: str) -> str:
    if len(text) <= MAX_ERROR_CHARS:
        return text
    return f"{text[:MAX_ERROR_CHARS]}... ({len(text) - MAX_ERROR_CHARS:,} more characters)"


def _fail(message: str, hint: str, code: int) -> None:
    from rich.text import Text

    from bnsurgeon.cli.render import console, printable

    # escaped before it is cut: a message quotes keys, paths and metadata from a file (ESC, \r, bidi)
    message, hint = _bounded(printable(message)), _bounded(printable(hint))
    from bnsurgeon.cli.render import emit_json_error

    emit_json_error(message, hint, code)
    out = console()
    # Text, never markup: messages quote paths and file metadata, where "[/]" or ":fire:" is data
    out.print(Text.assemble(("error:", "bold red"), " ", message), highlight=False)
    if hint:
        out.print(Text(f"  fix: {hint}"), highlight=False)
    raise typer.Exit(code)


#: sysexits' EX_SOFTWARE: CI can tell a crash of bnsurgeon (70) from a failed check (1)
INTERNAL_ERROR = 70


def _internal_error(error: Exception, verbose: bool) -> None:
    """Any exception bnsurgeon did not raise on purpose: one line that says it is a bug, exit 70."""
    import traceback

    from bnsurgeon.core.errors import first_line

    if verbose:
        from bnsurgeon.cli.render import console

        console().print("".join(traceback.format_exception(error)), markup=False, highlight=False)
    _fail(
        f"internal error: {type(error).__name__}: {first_line(error)}",
        "this is a bug in bnsurgeon, not a problem with your input: please report it with the traceback"
        + ("" if verbose else " (run again with -v, or BNSURGEON_DEBUG=1, to see it)"),
        INTERNAL_ERROR,
    )


#: how torch and Python say an allocation failed (CPU allocator, CUDA caching allocator, MemoryError)
OUT_OF_MEMORY = re.compile(
    r"can't allocate memory|out of memory|not enough memory|Cannot allocate memory", re.IGNORECASE
)


#: loading a shared library (torch's) failed for want of address space: a machine limit, not a bug
LIBRARY_OUT_OF_MEMORY = re.compile(r"failed to map segment|cannot allocate memory|cannot map zero-fill", re.I)


def _out_of_memory(error: Exception) -> bool:
    return isinstance(error, MemoryError) or (
        isinstance(error, RuntimeError) and bool(OUT_OF_MEMORY.search(str(error)))
    )


def _memory_failure(error: Exception) -> None:
    """Running out of memory is the size of what was asked for, not a crash: exit 9 with the size."""
    from bnsurgeon.core.errors import first_line

    asked = re.search(r"allocate (\d+) bytes", str(error))
    size = f" (an allocation of {int(asked.group(1)) / 2**30:,.1f} GiB failed)" if asked else ""
    _fail(
        f"the model and its check input are larger than this machine's memory{size}: {first_line(error)}",
        "pass a smaller --input-shape or --example-input (the batch and spatial size do not change which BN code "
        "runs), or use a machine with more memory",
        9,
    )


def handle_errors(command: Callable) -> Callable:
    """Turn library errors into one-line messages and exit codes (traceback with BNSURGEON_DEBUG=1);
    anything else is an internal error (exit 70), never exit 1, which means a check failed."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from bnsurgeon.core.interrupts import signals_ignored, signals_raise

        debug = os.environ.get("BNSURGEON_DEBUG", "") not in ("", "0")
        try:
            with signals_raise():
                return command(*args, **kwargs)
        except BnSurgeonError as error:
            if debug:
                raise
            speaker = getattr(error, "speaker", None)
            if speaker is not None:  # every torchrun rank reached it alike: one of them says it
                from bnsurgeon.checks.torchrun_ranks import speaks

                if not speaks(speaker):
                    if speaks(0):  # rank 0 still owes stdout its one JSON document (--json)
                        from bnsurgeon.cli.render import emit_json_error

                        emit_json_error(error.message, error.hint, error.exit_code)
                    raise typer.Exit(error.exit_code) from None
            with signals_ignored():
                _fail(error.message, error.hint, error.exit_code)
        except KeyboardInterrupt as interrupt:
            if debug:
                raise
            if getattr(interrupt, "speaker", None) is not None:  # every torchrun rank was interrupted: one says it
                from bnsurgeon.checks.torchrun_ranks import speaks

                if not speaks(interrupt.speaker):
                    raise typer.Exit(getattr(interrupt, "exit_code", 130)) from None
            name = str(interrupt) or "SIGINT"
            state = getattr(interrupt, "state", "nothing was written")
            with signals_ignored():
                _fail(f"interrupted ({name})", f"{state}; run the command again", getattr(interrupt, "exit_code", 130))
        except (
            typer.Exit,
            typer.Abort,
            click.exceptions.Exit,
            click.exceptions.Abort,
            click.exceptions.ClickException,
        ):
            raise  # Typer's and Click's own ways out (an exit code the command chose, a usage error Click words)
        except SystemExit as stop:  # bnsurgeon never calls sys.exit inside a command: the user's code did
            if debug:
                raise
            with signals_ignored():
                _fail(
                    f"the user's code called sys.exit({stop.code!r}) while {command.__name__} ran it (a factory, a "
                    "model's forward, a --data function or a rule), so the command did not finish: nothing was "
                    "checked or written",
                    "remove the sys.exit call from that code (raise an exception to report a problem)",
                    2,
                )
        except Exception as error:
            if debug:
                raise
            from bnsurgeon.core.user_code import shadowing_error

            shadowed = shadowing_error()  # a safetensors.py beside the user's factory: their environment, not a bug
            if shadowed is not None:
                _fail(shadowed.message, shadowed.hint, shadowed.exit_code)
            if _out_of_memory(error):
                _memory_failure(error)
            if isinstance(error, (ImportError, OSError)) and LIBRARY_OUT_OF_MEMORY.search(str(error)):
                from bnsurgeon.core.errors import first_line

                _fail(
                    f"a library could not be loaded within this process's memory (a limit such as ulimit -v, or "
                    f"the machine's memory): {first_line(error)}",
                    "raise the memory limit (ulimit -v) or free memory, and run again; nothing was written",
                    9,
                )
            _internal_error(error, bool(kwargs.get("verbose")))

    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"bnsurgeon {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """bnsurgeon: convert BatchNorm layers without losing a single behaviour."""


class Target(str, Enum):
    """What every BN-family module becomes (``--to``)."""

    sync = "sync"
    plain = "plain"
    frozen = "frozen"
    fused = "fused"


class FrozenPolicy(str, Enum):
    """What frozen BN becomes under ``--to sync/plain`` (``--frozen``)."""

    keep = "keep"
    unfreeze = "unfreeze"


SourceArgument = typer.Argument(
    ...,
    metavar="SOURCE",
    show_default=False,
    help="timm name (resnet50, timm:resnet50), checkpoint file, or package.module:function.",
)
ModelOption = typer.Option(
    None,
    "--model",
    "-m",
    metavar="ARCH",
    help="Architecture for a checkpoint that does not record one (timm name or pkg.mod:fn).",
)
ModelArgOption = typer.Option(
    None, "--model-arg", metavar="KEY=VALUE", help="Constructor argument (repeatable), e.g. num_classes=10."
)
WeightsOption = typer.Option(
    None, "--weights", metavar="NAME", help="Which state dict to use when the file holds several (e.g. state_dict_ema)."
)
TrustOption = typer.Option(
    False,
    "--trust-pickle",
    help="Allow unpickling arbitrary objects. This RUNS CODE from the file: only for files you trust.",
)
AcceptArgsOption = typer.Option(
    False,
    "--accept-recorded-args",
    help="Use the constructor arguments a file records (shown in the error that asks) without repeating each with --model-arg.",
)


def _judged(check: Callable[[Any], object]) -> Callable[[Any], Any]:
    """A Click callback: the option's value checked as Click reads it, before any argument or file (a hook's
    probe with no SOURCE is refused for it, not each file later); a bad one is the one line it would be later."""

    def callback(value: Any) -> Any:
        if value is not None:
            try:
                check(value)
            except BnSurgeonError as error:
                _fail(error.message, error.hint, error.exit_code)
        return value

    return callback


def _check_world_sizes(values: List[int]) -> None:
    from bnsurgeon.core.option_values import check_world_sizes

    check_world_sizes(values)


def _check_atol(value: float) -> None:
    from bnsurgeon.core.option_values import check_atol

    check_atol(value)


_WORLD_SIZES_JUDGED = _judged(_check_world_sizes)
_ATOL_JUDGED = _judged(_check_atol)

InputShapeOption = typer.Option(
    None,
    "--input-shape",
    callback=_judged(lambda text: _parse_shape(text)),
    metavar="N,C,...",
    help="Input for the checks, e.g. 2,3,224,224 (default: (2, C, 64, 64) when the model accepts it, else its own size).",
)


def _want_json(value: bool) -> bool:
    from bnsurgeon.cli.render import want_json

    return want_json(value)


JsonOption = typer.Option(
    False,
    "--json",
    help="Also print one JSON document on stdout (a failure's is its error); human output stays on stderr (add -q "
    "for JSON only).",
    is_eager=True,
    callback=_want_json,
)
QuietOption = typer.Option(False, "--quiet", "-q", help="No human output; errors only (the exit code says the rest).")
VerboseOption = typer.Option(False, "--verbose", "-v", help="Show every path, not a few examples.")
RulesOption = typer.Option(
    None,
    "--rules",
    metavar="PKG.MOD:OBJ",
    help="Rules for your own BN classes: package.module:object (a Rule, a list, or a callable returning them; repeatable). Imports it: RUNS ITS CODE.",
)


def _use_rules(specs: Optional[List[str]]) -> None:
    from bnsurgeon.rules import use_rules

    use_rules(specs or [])


IncludeOption = typer.Option(
    None,
    "--include",
    metavar="GLOB",
    help="Convert only BN modules whose path matches this glob (repeatable), e.g. 'backbone.body.layer[234].*'.",
)
ExcludeOption = typer.Option(
    None,
    "--exclude",
    metavar="GLOB",
    help="Keep BN modules whose path matches this glob as they are (repeatable), e.g. 'backbone.body.layer1.*'.",
)
ExampleInputOption = typer.Option(
    None,
    "--example-input",
    metavar="FILE",
    help="A torch.save'd tensor, list or dict of tensors (read with weights_only=True) whose shapes the checks use, e.g. a list of images for a detector; recorded in the output.",
)
VerifyExampleInputOption = typer.Option(
    None,
    "--example-input",
    metavar="FILE",
    help="A torch.save'd tensor, list or dict of tensors (read with weights_only=True) whose shapes the checks use, e.g. a list of images for a detector (default: the input either file records).",
)


def _example_input(path: Optional[Path]):
    if path is None:
        return None
    from bnsurgeon.checks.check_input import load_example_input

    return load_example_input(path)


@app.command(cls=_Command)
@handle_errors
def inspect(
    source: str = SourceArgument,
    model: Optional[str] = ModelOption,
    model_arg: Optional[List[str]] = ModelArgOption,
    weights: Optional[str] = WeightsOption,
    trust_pickle: bool = TrustOption,
    include: Optional[List[str]] = IncludeOption,
    exclude: Optional[List[str]] = ExcludeOption,
    rules: Optional[List[str]] = RulesOption,
    accept_recorded_args: bool = AcceptArgsOption,
    verbose: bool = VerboseOption,
    quiet: bool = QuietOption,
    as_json: bool = JsonOption,
) -> None:
    """List BatchNorm-family modules by class: rule, count, targets, and what torch's converter and transformers' replace_batch_norm would break.

    Examples: `bnsurgeon inspect tf_efficientnet_b3`; `bnsurgeon inspect checkpoint.pth.tar` (lists the file's entries too)
    """
    from bnsurgeon import api
    from bnsurgeon.cli.render import console, emit_json, render_inspection
    from bnsurgeon.loading.architecture import parse_model_args

    _use_rules(rules)
    result = api.inspect(
        source,
        model=model,
        model_args=parse_model_args(model_arg),
        weights=weights,
        trust_pickle=trust_pickle,
        accept_recorded_args=accept_recorded_args,
        include=tuple(include or ()),
        exclude=tuple(exclude or ()),
    )
    if as_json:
        emit_json(result.to_dict())
    if not quiet:
        render_inspection(result, console(), verbose=verbose)


def _parse_shape(text: Optional[str]) -> Optional[tuple]:
    if text is None:
        return None
    from bnsurgeon.core.errors import UsageError

    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        raise UsageError(f"--input-shape {text!r} is not a list of integers", "write it like 2,3,224,224") from None
    if len(shape) < 2 or min(shape) < 1:
        raise UsageError(f"--input-shape {text!r} needs at least N,C, all positive", "write it like 2,3,224,224")
    return shape


@app.command(cls=_Command)
@handle_errors
def convert(
    source: str = SourceArgument,
    output: str = typer.Option(  # a string: a Path would drop the trailing / that asks for a model directory
        ...,
        "--output",
        "-o",
        metavar="OUT",
        help="Output checkpoint (.safetensors, .pt, .pth or .pth.tar); reports go next to it. "
        "A .pt/.pth/.pth.tar output carries a training checkpoint's other entries. "
        "For a Hugging Face model, a directory (no suffix, or ending in /) gets what "
        "save_pretrained writes.",
    ),
    to: Target = typer.Option(
        Target.sync,
        "--to",
        help="What every BN-family module becomes (fused: folded into the conv/linear before it; eval only).",
    ),
    frozen: FrozenPolicy = typer.Option(
        FrozenPolicy.keep, "--frozen", help="Frozen BN under --to sync/plain: keep it frozen, or unfreeze it."
    ),
    allow_unhandled: bool = typer.Option(
        False,
        "--allow-unhandled",
        help="Leave BN-like modules no rule claims untouched (listed in the report) instead of refusing.",
    ),
    allow_no_bn: bool = typer.Option(
        False,
        "--allow-no-bn",
        help="Write the model even when it has no BatchNorm-family module (default: exit 11, write nothing).",
    ),
    model: Optional[str] = ModelOption,
    model_arg: Optional[List[str]] = ModelArgOption,
    weights: Optional[str] = WeightsOption,
    trust_pickle: bool = TrustOption,
    accept_recorded_args: bool = AcceptArgsOption,
    force: bool = typer.Option(
        False,
        "--force",
        help="Replace OUTPUT and its reports if they exist (never an input: SOURCE or --example-input).",
    ),
    no_check: bool = typer.Option(False, "--no-check", help="Skip the eval-equivalence check before writing."),
    input_shape: Optional[str] = InputShapeOption,
    example_input: Optional[Path] = ExampleInputOption,
    include: Optional[List[str]] = IncludeOption,
    exclude: Optional[List[str]] = ExcludeOption,
    rules: Optional[List[str]] = RulesOption,
    verify: bool = typer.Option(
        False,
        "--verify",
        help="Before writing, also run `bnsurgeon verify`'s checks (train, 2 ranks, perturbed) and record them.",
    ),
    verbose: bool = VerboseOption,
    quiet: bool = QuietOption,
    as_json: bool = JsonOption,
) -> None:
    """Convert every BatchNorm-family module, check eval outputs are unchanged, write OUTPUT + report.

    Examples: `bnsurgeon convert efficientnet_b0 -o b0.sync.safetensors`;
    `bnsurgeon convert b0.sync.safetensors --to plain -o b0.plain.safetensors`;
    `bnsurgeon convert ckpt.pth -m resnet50 --model-arg num_classes=10 -o r50.sync.safetensors`;
    `bnsurgeon convert train/last.pth.tar -o last.sync.pth.tar` (optimizer, EMA, epoch, args carried)
    """
    from bnsurgeon import api
    from bnsurgeon.cli.render import console, emit_json, phases, render_report, say
    from bnsurgeon.loading.architecture import parse_model_args

    _use_rules(rules)
    outcome = None
    try:
        with phases(console(), enabled=not quiet) as progress:
            outcome = api.convert_source(
                source,
                output,
                to=to.value,
                frozen=frozen.value,
                allow_unhandled=allow_unhandled,
                model=model,
                model_args=parse_model_args(model_arg),
                weights=weights,
                trust_pickle=trust_pickle,
                accept_recorded_args=accept_recorded_args,
                force=force,
                check=not no_check,
                input_shape=_parse_shape(input_shape),
                example_input=example_input,  # a path: checked against the outputs, then read
                include=tuple(include or ()),
                exclude=tuple(exclude or ()),
                verify_world_sizes=(2,) if verify else (),
                progress=progress,
                allow_no_bn=allow_no_bn,
            )
        report = outcome.result.report
        if as_json:
            emit_json(report.to_dict())
        if not quiet:
            out = console()
            render_report(report, out, verbose=verbose)
            say(
                out,
                f"wrote {outcome.output}"
                + (f" (+ {outcome.reports[0].name}, {outcome.reports[1].name})" if outcome.reports else ""),
                indent="  ",
            )
    except KeyboardInterrupt as interrupt:  # after the write, the message must not say nothing was written
        if outcome is not None and outcome.output is not None:
            setattr(interrupt, "state", f"{outcome.output} and its reports were written completely")  # noqa: B010  (read by the CLI's interrupt handler)
        raise


@app.command(cls=_Command)
@handle_errors
def verify(
    source: str = SourceArgument,
    converted: str = typer.Argument(
        ..., metavar="CONVERTED", show_default=False, help="The converted model, in any SOURCE form."
    ),
    world_size: Optional[List[int]] = typer.Option(
        None,
        "--world-size",
        "-w",
        metavar="N",
        help="Ranks for the distributed check (repeatable; default 2; under torchrun, the ranks torchrun started).",
        callback=_WORLD_SIZES_JUDGED,
    ),
    precision: str = typer.Option(
        "float64",
        "--precision",
        metavar="P",
        help="Under torchrun: float64 (exact reference), float32 or bf16-autocast (judged against plain BN's own "
        "error, measured in the same run).",
    ),
    device: str = typer.Option(
        "auto",
        "--device",
        metavar="D",
        help="Under torchrun: auto (cuda:LOCAL_RANK with NCCL where every local rank has a GPU, else CPU with gloo), "
        "cpu, or cuda (GPUs shared over gloo where there are fewer than ranks).",
    ),
    input_shape: Optional[str] = InputShapeOption,
    example_input: Optional[Path] = VerifyExampleInputOption,
    rules: Optional[List[str]] = RulesOption,
    compare_at: Optional[str] = typer.Option(
        None,
        "--compare-at",
        metavar="MODULE",
        help="Compare the output of this submodule (e.g. backbone) instead of the model's: for detectors whose head output is not comparable.",
    ),
    atol: Optional[float] = typer.Option(
        None,
        "--atol",
        metavar="X",
        help="Absolute tolerance instead of bit-identity for eval/train (a fused checkpoint: tolerance relative to the output's scale, default 1e-4).",
        callback=_ATOL_JUDGED,
    ),
    no_perturb: bool = typer.Option(
        False, "--no-perturb", help="Skip the run with perturbed BN statistics and affine parameters."
    ),
    model: Optional[str] = ModelOption,
    model_arg: Optional[List[str]] = ModelArgOption,
    converted_model: Optional[str] = typer.Option(
        None,
        "--converted-model",
        metavar="ARCH",
        help="Like --model, for CONVERTED only (confirms a factory it records).",
    ),
    converted_model_arg: Optional[List[str]] = typer.Option(
        None, "--converted-model-arg", metavar="KEY=VALUE", help="Like --model-arg, for CONVERTED only."
    ),
    weights: Optional[str] = WeightsOption,
    converted_weights: Optional[str] = typer.Option(
        None,
        "--converted-weights",
        metavar="NAME",
        help="Like --weights, for CONVERTED only (e.g. state_dict_ema of a converted training checkpoint).",
    ),
    trust_pickle: bool = TrustOption,
    accept_recorded_args: bool = AcceptArgsOption,
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Also print each check's full detail after the summary."
    ),
    quiet: bool = QuietOption,
    as_json: bool = JsonOption,
) -> None:
    """Prove CONVERTED behaves like SOURCE: eval (bit-identical), train, N gloo ranks, frozen; exit 0 if all pass, 1 if one fails (other codes: Exit codes, in the docs' Checkpoints page).

    Each check's line is printed (to stderr, flushed) the moment it finishes, with its time.

    Example: `bnsurgeon verify efficientnet_b0 b0.sync.safetensors -w 2 -w 3`

    On your devices: `torchrun --nproc-per-node 2 -m bnsurgeon verify efficientnet_b0 b0.sync.safetensors` (each torchrun process is a rank; rank 0 reports)
    """
    from bnsurgeon import api
    from bnsurgeon.cli.render import CheckStream, console, emit_json, render_verification_summary, say, want_json
    from bnsurgeon.loading.architecture import parse_model_args

    out = console()
    _use_rules(rules)
    from bnsurgeon.checks.torchrun_ranks import launched_by_torchrun, speaks

    if not speaks():  # under torchrun rank 0 speaks: one report, one JSON document (the others' errors on stderr)
        quiet, as_json = True, False
        want_json(False)
    result = api.verify(
        source,
        converted,
        world_sizes=tuple(world_size) if world_size else None,
        precision=precision,
        device=device,
        as_torchrun_rank=launched_by_torchrun(),
        input_shape=_parse_shape(input_shape),
        atol=atol,
        perturb=not no_perturb,
        model=model,
        model_args=parse_model_args(model_arg),
        converted_model=converted_model,
        converted_model_args=parse_model_args(converted_model_arg),
        weights=weights,
        converted_weights=converted_weights,
        trust_pickle=trust_pickle,
        accept_recorded_args=accept_recorded_args,
        on_check=None if quiet else CheckStream(out),
        example_input=_example_input(example_input),
        compare_at=compare_at,
    )
    if as_json:
        emit_json(result.to_dict())
    if not quiet:
        render_verification_summary(result, out)
        if verbose:
            for check in result.checks:
                say(
                    out,
                    f"{check.name}: {check.detail}"
                    + (f"; first divergent module {check.first_divergence}" if check.first_divergence else ""),
                )
    raise typer.Exit(0 if result.passed else 1)


@app.command(cls=_Command)
@handle_errors
def rules(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show each rule's classes with their module paths."),
    quiet: bool = QuietOption,
    as_json: bool = JsonOption,
) -> None:
    """List the rule registry: each rule, the exact classes it claims, its targets, and whether eval stays bit-identical.

    Example: `bnsurgeon rules` (or `bnsurgeon rules --json | jq '.[].name'`)
    """
    from bnsurgeon.cli.catalog import describe_rules
    from bnsurgeon.cli.render import console, emit_json, render_rules

    data = describe_rules()
    if as_json:
        emit_json(data)
    if not quiet:
        render_rules(data, console(), verbose=verbose)


@app.command(cls=_Command)
@handle_errors
def recalibrate(
    source: str = SourceArgument,
    data: str = typer.Option(
        ...,
        "--data",
        "-d",
        metavar="DATA",
        help="A tensor file (.pt/.pth/.safetensors: one (N,C,H,W) tensor cut into batches, or a list of batches), "
        "a folder of them, a folder of images (a model directory's own preprocessor_config.json, else the model's timm "
        "preprocessing; each image and batch bounded before it is decoded), or "
        "package.module:function returning an iterable of batches (RUNS ITS CODE).",
    ),
    output: str = typer.Option(  # as convert's: the text as typed
        ...,
        "--output",
        "-o",
        metavar="OUT",
        help="Output: the source file again with only the BN running statistics changed "
        "(a training checkpoint is written back whole); reports go next to it.",
    ),
    batches: Optional[int] = typer.Option(
        None, "--batches", metavar="N", help="Use the first N batches (DATA must hold them)."
    ),
    samples: Optional[int] = typer.Option(
        None, "--samples", metavar="N", help="Use the first N samples, the last batch cut (DATA must hold them)."
    ),
    batch_size: Optional[int] = typer.Option(
        None,
        "--batch-size",
        "-b",
        metavar="N",
        help="Cut tensors of samples (and image folders) into batches of N (default 32).",
    ),
    include_frozen: bool = typer.Option(
        False, "--include-frozen", help="Also recalibrate frozen BN (default: left as it is)."
    ),
    fast_normalization: bool = typer.Option(
        False,
        "--fast-normalization",
        help="Plain BN and BN+act layers normalise in eval mode with the batch's exact statistics instead of running torch's training-mode BN (faster on CPU; activations equal training mode's to float32 rounding).",
    ),
    model: Optional[str] = ModelOption,
    model_arg: Optional[List[str]] = ModelArgOption,
    weights: Optional[str] = WeightsOption,
    trust_pickle: bool = TrustOption,
    accept_recorded_args: bool = AcceptArgsOption,
    rules: Optional[List[str]] = RulesOption,
    force: bool = typer.Option(False, "--force", help="Replace OUTPUT and its reports if they exist (never an input)."),
    verbose: bool = VerboseOption,
    quiet: bool = QuietOption,
    as_json: bool = JsonOption,
) -> None:
    """Write exact BN running statistics (precise BN) computed over DATA: one process, or N ranks under torchrun, same result.

    Examples: `bnsurgeon recalibrate last.pth.tar --weights state_dict_ema --data calib.pt -o last.recal.pth.tar`;
    `torchrun --nproc-per-node 4 -m bnsurgeon recalibrate model.safetensors --data mypkg.data:calibration_batches -o out.safetensors`
    """
    from bnsurgeon import api
    from bnsurgeon.cli.render import batch_progress, console, emit_json, phases, render_recalibration, say
    from bnsurgeon.loading.architecture import parse_model_args

    _use_rules(rules)
    outcome = None
    try:
        out = console()
        with phases(out, enabled=False) as progress, batch_progress(out, enabled=not quiet) as on_batch:
            outcome = api.recalibrate_source(
                source,
                data,
                output,
                batches=batches,
                samples=samples,
                batch_size=batch_size,
                include_frozen=include_frozen,
                fast_normalization=fast_normalization,
                model=model,
                model_args=parse_model_args(model_arg),
                weights=weights,
                trust_pickle=trust_pickle,
                accept_recorded_args=accept_recorded_args,
                force=force,
                progress=progress,
                on_batch=on_batch,
            )
        if outcome.rank != 0:
            return
        if as_json:
            emit_json(outcome.report.to_dict())
        if not quiet:
            render_recalibration(outcome.report, out, verbose=verbose)
            say(
                out,
                f"wrote {outcome.output}"
                + (f" (+ {outcome.reports[0].name}, {outcome.reports[1].name})" if outcome.reports else ""),
                indent="  ",
            )
    except KeyboardInterrupt as interrupt:
        if outcome is not None and outcome.output is not None:
            setattr(interrupt, "state", f"{outcome.output} and its reports were written completely")  # noqa: B010  (read by the CLI's interrupt handler)
        raise


@app.command(cls=_Command, context_settings={"allow_interspersed_args": False})
def run(
    script: str = typer.Argument(
        ..., metavar="SCRIPT", show_default=False, help="The training script (with -m: the module) to run."
    ),
    args: Optional[List[str]] = typer.Argument(
        None, metavar="ARGS", show_default=False, help="The script's own arguments, passed on unchanged."
    ),
    module: bool = typer.Option(False, "-m", "--module", help="SCRIPT is a module, run as `python -m` runs it."),
    report: Optional[str] = typer.Option(  # a string: a Path would drop a trailing / (a directory, refused)
        None,
        "--report",
        metavar="PATH",
        help="Write each conversion's JSON report (the document convert writes as OUT.report.json) to PATH; "
        "a second conversion's to NAME.2.json, and so on (rank 0). Checked before the script starts; a relative "
        "PATH is the working directory's at the start.",
    ),
    stats: Optional[str] = typer.Option(
        None,
        "--stats",
        metavar="PATH",
        help="Measure whether this model and data need sync BN: in the first --stats-steps training steps, how far "
        "each rank's batch mean and variance are from the global batch's, per sync layer (from what each layer "
        "gathers anyway: no extra collective). Rank 0 writes the JSON document to PATH, its picture to PATH with "
        ".html, and says the verdict in one line. Checked as --report is.",
    ),
    stats_steps: Optional[int] = typer.Option(
        None,
        "--stats-steps",
        min=1,
        metavar="N",
        help="Training steps --stats records (a step: a call of the first layer; default 20).",
    ),
    stats_layers: Optional[List[str]] = typer.Option(
        None,
        "--stats-layers",
        metavar="PATTERN",
        help="Only the sync layers whose names match this shell pattern (repeatable), e.g. 'Net.layer1.*'.",
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="Replace reports an earlier run left at PATH, NAME.2.json, ... (removed before the script starts; "
        "only bnsurgeon reports, never the script or another file).",
    ),
    allow_unhandled: bool = typer.Option(
        False,
        "--allow-unhandled",
        help="Leave BN-like modules no rule claims as they are (listed in the report) instead of stopping the run.",
    ),
    rules: Optional[List[str]] = RulesOption,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary line; errors and the script's output only."),
) -> None:
    """Run a training script with bnsurgeon's exact sync BN wherever it converts to sync BN.

    \b
      torchrun --nproc-per-node 2 -m bnsurgeon run train.py --sync-bn ...
      bnsurgeon run train.py ARGS...          bnsurgeon run -m package.train ARGS...

    SCRIPT runs as __main__, as python runs it: its sys.argv, sys.path[0], __file__, output, exit code
    and traceback are its own. While it runs, each sync-BN converter it calls does bnsurgeon's exact
    conversion: torch.nn.SyncBatchNorm.convert_sync_batchnorm (its process_group kept), timm's
    convert_sync_batchnorm (imported by name too), Lightning's Trainer(sync_batchnorm=True) and its
    revert after fit, mmengine's convert_sync_batchnorm and revert_sync_batchnorm (a runner's sync_bn).
    Each converts only what the original converts (frozen BN stays frozen) and returns what it returns;
    BN subclasses keep their activation, and the layers train on CPU (gloo) and GPU alike. A BN-like
    class no rule claims stops the run where it converts, before training, with exit 7 (see
    --allow-unhandled). Rank 0 prints one summary line per conversion on stderr.

    A model that builds torch.nn.SyncBatchNorm itself, with no converter call (OpenMMLab
    norm_cfg=dict(type="SyncBN"), detectron2 norm="SyncBN", its own __init__, a module it unpickles):
    each such layer becomes bnsurgeon's in place, the same object, where DistributedDataParallel wraps
    the model (one summary line per model), at its first train-mode forward under a process group, or
    as torch.compile starts under one. In one process without a process group torch's layer is plain BN
    already and is left as it is.

    Python processes the script starts inherit the replaced converters: the ranks Lightning's
    Trainer(devices=N) starts without torchrun (strategy="ddp" or "ddp_spawn"), a script's own
    torch.multiprocessing.spawn workers (through a start hook written into site-packages for the run and
    removed at its end, as coverage.py's patch = subprocess does; it acts only where BNSURGEON_RUN
    carries this run's token while the run lives).

    --stats PATH answers "do I need sync BN?" for this model and data: per sync layer, how far each rank's
    batch statistics are from the global batch's, against the global batch's own sampling error.

    Not covered: a project's own copy of a converter (apex's convert_syncbn_model): call
    bnsurgeon.convert(model, "sync", inplace=True) after it.
    """
    import sys

    from bnsurgeon.launch.gaps import DEFAULT_STEPS, GapRequest
    from bnsurgeon.launch.script import ScriptNotRunnable, ScriptRaised, run_script

    if stats is None and (stats_steps is not None or stats_layers):
        given = "--stats-steps" if stats_steps is not None else "--stats-layers"
        raise typer.BadParameter("it shapes what --stats records: add --stats PATH", param_hint=f"'{given}'")
    if rules:  # as every command loads them: a module that fails to import is bnsurgeon's error, not the script's
        saved_path = list(sys.path)
        handle_errors(_use_rules)(rules)
        sys.path[:] = saved_path  # the working directory it added is not the script's to import from
    try:
        # restore=False: the script's __main__, sys.argv and converters stay for its threads and atexit handlers
        run_script(
            script,
            args or [],
            module=module,
            allow_unhandled=allow_unhandled,
            report=report,
            force=force,
            quiet=quiet,
            rules=rules or [],
            restore=False,
            stats=None if stats is None else GapRequest(stats, stats_steps or DEFAULT_STEPS, stats_layers or []),
        )
    except ScriptNotRunnable as refused:  # a directory without __main__.py, a package without __main__
        print(f"{sys.executable}: {refused}", file=sys.stderr)
        raise SystemExit(1) from None
    except ScriptRaised as raised:  # the script's own exception: shown and exited as python does
        raised.show()
        if raised.interrupted:
            import signal

            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        raise SystemExit(1) from None
    except BnSurgeonError as error:
        _fail(error.message, error.hint, error.exit_code)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
