"""The ``bnsurgeon`` command line: parse, call one API function, render. No logic here.

Errors from the library become one line on stderr and a distinct exit code; set
BNSURGEON_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Callable, List, Optional

import typer

from . import __version__
from .errors import BnSurgeonError

EXIT_CODES = {
    0: "success",
    1: "the converted model's outputs differ from the source's (nothing written)",
    2: "usage: a bad flag or value",
    3: "SOURCE not found: no such file, timm model or factory",
    4: "not a readable checkpoint (empty, truncated, corrupt, holds no weights)",
    5: "the checkpoint is a pickle that would run code (see --trust-pickle)",
    6: "the weights do not fit the architecture",
    7: "a BatchNorm-like module no rule claims, or an uninitialized lazy BN",
    8: "the output path cannot or must not be written",
    130: "interrupted (Ctrl-C); nothing partial written",
}

app = typer.Typer(
    name="bnsurgeon",
    help="Exact BatchNorm surgery for PyTorch/timm models: inspect, convert to sync / plain / frozen BN.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


def _fail(message: str, hint: str, code: int) -> None:
    from .render import console

    out = console()
    out.print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    if hint:
        out.print(f"  fix: {hint}", markup=False, highlight=False)
    raise typer.Exit(code)


def handle_errors(command: Callable) -> Callable:
    """Turn library errors into one-line messages and exit codes (traceback with BNSURGEON_DEBUG=1)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        debug = os.environ.get("BNSURGEON_DEBUG", "") not in ("", "0")
        try:
            return command(*args, **kwargs)
        except BnSurgeonError as error:
            if debug:
                raise
            _fail(error.message, error.hint, error.exit_code)
        except KeyboardInterrupt:
            if debug:
                raise
            _fail("interrupted", "nothing partial was written; run the command again", 130)

    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"bnsurgeon {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """bnsurgeon: convert BatchNorm layers without losing a single behaviour."""


SourceArgument = typer.Argument(..., help="timm name (resnet50, timm:resnet50), checkpoint file, or package.module:function.")
ModelOption = typer.Option(None, "--model", "-m", help="Architecture for a checkpoint that does not record one (timm name or pkg.mod:fn).")
ModelArgOption = typer.Option(None, "--model-arg", help="Constructor argument key=value (repeatable), e.g. num_classes=10.")
WeightsOption = typer.Option(None, "--weights", help="Which state dict to use when the file holds several (e.g. state_dict_ema).")
TrustOption = typer.Option(False, "--trust-pickle", help="Allow unpickling arbitrary objects. This RUNS CODE from the file: only for files you trust.")
JsonOption = typer.Option(False, "--json", help="Print one JSON document on stdout (human output stays on stderr).")
QuietOption = typer.Option(False, "--quiet", "-q", help="No human output; errors only (the exit code says the rest).")
VerboseOption = typer.Option(False, "--verbose", "-v", help="Show every path, not a few examples.")


@app.command()
@handle_errors
def inspect(
    source: str = SourceArgument,
    model: Optional[str] = ModelOption,
    model_arg: Optional[List[str]] = ModelArgOption,
    weights: Optional[str] = WeightsOption,
    trust_pickle: bool = TrustOption,
    verbose: bool = VerboseOption,
    quiet: bool = QuietOption,
    as_json: bool = JsonOption,
) -> None:
    """List BatchNorm-family modules by class: rule, count, targets, what torch's converter would break.

    Example: `bnsurgeon inspect tf_efficientnet_b3`
    """
    from . import api
    from .render import console, emit_json, render_inspection
    from .sources import parse_model_args

    result = api.inspect(source, model=model, model_args=parse_model_args(model_arg), weights=weights,
                         trust_pickle=trust_pickle)
    if as_json:
        emit_json(result.to_dict())
    elif not quiet:
        render_inspection(result, console(), verbose=verbose)


def _parse_shape(text: Optional[str]) -> Optional[tuple]:
    if text is None:
        return None
    from .errors import UsageError

    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        raise UsageError(f"--input-shape {text!r} is not a list of integers", "write it like 2,3,224,224") from None
    if len(shape) < 2 or min(shape) < 1:
        raise UsageError(f"--input-shape {text!r} needs at least N,C, all positive", "write it like 2,3,224,224")
    return shape


@app.command()
@handle_errors
def convert(
    source: str = SourceArgument,
    output: Path = typer.Option(..., "--output", "-o", help="Output checkpoint (.safetensors, .pt or .pth); reports go next to it."),
    to: str = typer.Option("sync", "--to", help="Target: sync | plain | frozen | fused (folds BN into the conv/linear before it; eval only)."),
    frozen: str = typer.Option("keep", "--frozen", help="Frozen BN under --to sync/plain: keep | unfreeze."),
    allow_unhandled: bool = typer.Option(False, "--allow-unhandled", help="Leave BN-like modules no rule claims untouched (listed in the report) instead of refusing."),
    model: Optional[str] = ModelOption,
    model_arg: Optional[List[str]] = ModelArgOption,
    weights: Optional[str] = WeightsOption,
    trust_pickle: bool = TrustOption,
    force: bool = typer.Option(False, "--force", help="Replace OUTPUT if it exists (never the input)."),
    no_check: bool = typer.Option(False, "--no-check", help="Skip the eval-equivalence check before writing."),
    input_shape: Optional[str] = typer.Option(None, "--input-shape", help="Input for the check, e.g. 2,3,224,224 (timm models know theirs)."),
    verify: bool = typer.Option(False, "--verify", help="Before writing, also run `bnsurgeon verify`'s checks (train, 2 ranks, perturbed) and record them."),
    verbose: bool = VerboseOption,
    quiet: bool = QuietOption,
    as_json: bool = JsonOption,
) -> None:
    """Convert every BatchNorm-family module, check eval outputs are unchanged, write OUTPUT + report.

    Examples: `bnsurgeon convert efficientnet_b0 -o b0.sync.safetensors`;
    `bnsurgeon convert b0.sync.safetensors --to plain -o b0.plain.safetensors`;
    `bnsurgeon convert ckpt.pth -m resnet50 --model-arg num_classes=10 -o r50.sync.safetensors`
    """
    from . import api
    from .render import console, emit_json, phases, render_report
    from .sources import parse_model_args

    with phases(console(), enabled=not quiet) as progress:
        outcome = api.convert_source(
            source, output, to=to, frozen=frozen, allow_unhandled=allow_unhandled, model=model,
            model_args=parse_model_args(model_arg), weights=weights, trust_pickle=trust_pickle, force=force,
            check=not no_check, input_shape=_parse_shape(input_shape), verify_world_sizes=(2,) if verify else (),
            progress=progress,
        )
    report = outcome.result.report
    if as_json:
        emit_json(report.to_dict())
    if not quiet and not as_json:
        out = console()
        render_report(report, out, verbose=verbose)
        out.print(f"wrote {outcome.output}" + (f" (+ {outcome.reports[0].name}, {outcome.reports[1].name})" if outcome.reports else ""))


@app.command()
def verify(
    source: str = SourceArgument,
    converted: str = typer.Argument(..., help="The converted model, in any SOURCE form."),
    world_size: List[int] = typer.Option([2], "--world-size", "-w", help="Ranks for the distributed check (repeatable)."),
    input_shape: Optional[str] = typer.Option(None, "--input-shape", help="e.g. 4,16,32 (timm models know theirs)."),
    atol: Optional[float] = typer.Option(None, "--atol", help="Absolute tolerance instead of bit-identity for eval/train."),
    no_perturb: bool = typer.Option(False, "--no-perturb", help="Skip the run with perturbed BN statistics and affine parameters."),
    model: Optional[str] = ModelOption,
    model_arg: Optional[List[str]] = ModelArgOption,
    trust_pickle: bool = TrustOption,
    quiet: bool = QuietOption,
    as_json: bool = JsonOption,
) -> None:
    """Prove CONVERTED behaves like SOURCE: eval (bit-identical), train, N gloo ranks, frozen; exit 0/1/2 for CI.

    Example: `bnsurgeon verify efficientnet_b0 b0.sync.safetensors --world-size 2 --world-size 3`
    """
    from . import api
    from .errors import VerificationError
    from .render import console, emit_json, render_verification
    from .sources import parse_model_args

    debug = os.environ.get("BNSURGEON_DEBUG", "") not in ("", "0")
    try:
        result = api.verify(source, converted, world_sizes=tuple(world_size), input_shape=_parse_shape(input_shape),
                            atol=atol, perturb=not no_perturb, model=model, model_args=parse_model_args(model_arg),
                            trust_pickle=trust_pickle)
    except BnSurgeonError as error:
        if debug:
            raise
        _fail(error.message, error.hint, 1 if isinstance(error, VerificationError) else 2)
    if as_json:
        emit_json(result.to_dict())
    elif not quiet:
        render_verification(result, console())
    raise typer.Exit(0 if result.passed else 1)


@app.command()
@handle_errors
def rules(as_json: bool = JsonOption) -> None:
    """List the rule registry: each rule, the exact classes it claims, and whether eval stays bit-identical."""
    from .fields import qualname
    from .render import console, emit_json, render_rules
    from .rules import default_registry

    data = [
        {"name": r.name, "classes": [qualname(c) for c in r.classes], "targets": sorted(r.targets),
         "exact": r.exact, "description": r.description}
        for r in default_registry()
    ]
    if as_json:
        emit_json(data)
    else:
        render_rules(data, console())


def main() -> None:
    app()


if __name__ == "__main__":
    main()
