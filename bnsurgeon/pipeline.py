"""The commands as library calls: ``inspect``, ``convert_source`` (resolve, convert, check,
write) and ``verify`` (load both sides, run every check)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from bnsurgeon import __version__
from bnsurgeon.checks.eval_check import (
    CHECK_SEED,
    compare_eval,
    is_inexact,
    needs_input_dims,
    observed_input_dims,
    refuse_invalid_weights,
    refuse_non_finite,
    require_same_architecture,
    resolve_check_input,
)
from bnsurgeon.core.errors import (
    ConfirmationError,
    HookedModelError,
    NothingToConvertError,
    UsageError,
    VerificationError,
)
from bnsurgeon.core.option_values import check_atol, check_world_sizes
from bnsurgeon.core.paths import check_reachable
from bnsurgeon.core.running import preserved_modes, run_forward
from bnsurgeon.files.conversion import write_conversion, write_model_directory
from bnsurgeon.files.history import step
from bnsurgeon.files.model_directory import check_directory_output, is_directory_output, write_into_directory
from bnsurgeon.files.reading import describe_checkpoint, read_checkpoint
from bnsurgeon.files.writing import check_output_path, report_paths
from bnsurgeon.loading.architecture import LoadedSource
from bnsurgeon.loading.rebuild import recipe
from bnsurgeon.loading.recorded import read_recorded
from bnsurgeon.loading.resolve import MODEL_DIRECTORY, ResolvedSource, resolve_source
from bnsurgeon.loading.sources import load_source, unwrap_data_parallel
from bnsurgeon.loading.transformers_source import PREPROCESSOR_FILE, read_preprocessor_text
from bnsurgeon.surgery.inspection import Inspection, inspect_model
from bnsurgeon.surgery.walk import ConvertResult, class_map, convert

if TYPE_CHECKING:
    from torch import nn

    from bnsurgeon.checks.check_input import CheckInput
    from bnsurgeon.loading.data import ResolvedData


def inspect(
    source: "str | nn.Module | ResolvedSource",
    *,
    include: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
    **source_options: Any,
) -> Inspection:
    """Inspect a model object or a SOURCE (a string, resolved once, or ``resolve_source``'s value; timm names are
    built on the meta device).

    ``include``/``exclude`` (module-path globs, as for convert) add a note of what they select.
    """
    result = _inspect(source, **source_options)
    if include or exclude:
        result.notes.append(selection_note(result, include, exclude))
    return result


def selection_note(result: Inspection, include, exclude) -> str:
    """How many BN modules --include/--exclude leave to convert, with the first few kept out."""
    from bnsurgeon.surgery.walk import check_filters, filtered_out

    include, exclude = check_filters(include, exclude)
    groups = [(group.cls, path) for group in result.groups for path in group.all_paths]
    out = [path for _, path in groups if filtered_out([path], include, exclude) is not None]
    shown = ", ".join(out[:4]) + (f" (+{len(out) - 4} more)" if len(out) > 4 else "")
    flags = " ".join([f"--include {g}" for g in include] + [f"--exclude {g}" for g in exclude])
    return f"{flags}: {len(groups) - len(out)} of {len(groups)} BN module names selected for conversion" + (
        f"; kept as they are: {shown}" if out else ""
    )


def _inspect(source: "str | nn.Module | ResolvedSource", **source_options: Any) -> Inspection:
    from torch import nn

    if isinstance(source, nn.Module):
        model, wrapper = unwrap_data_parallel(source)
        return inspect_model(model, source=type(source).__name__ + wrapper)
    resolved = resolve_source(source, model=source_options.get("model"))
    if resolved.is_name or resolved.kind == MODEL_DIRECTORY:
        loaded, note = _load_for_inspection(resolved, **source_options)
        result = inspect_model(loaded.model, source=loaded.description)
        result.notes += [note] if note else []
        return result

    assert resolved.weights is not None  # a file: the one it names
    raw = read_checkpoint(resolved.weights, trust_pickle=source_options.get("trust_pickle", False), mmap=True)
    contents = describe_checkpoint(raw)
    try:
        loaded, note = _load_for_inspection(resolved, raw=raw, **source_options)
    except ConfirmationError as error:
        result = Inspection(source=resolved.text, parameters=0, checkpoint=contents)
        result.notes.append(f"{error.message}: {error.hint}")
        return result
    except UsageError as error:
        if source_options.get("model") or isinstance(error, HookedModelError):
            raise
        result = Inspection(source=resolved.text, parameters=0, checkpoint=contents)
        result.notes.append(f"{error.message}: pass --model ARCH to list its BatchNorm modules")
        return result
    result = inspect_model(loaded.model, source=loaded.description)
    result.notes += [note] if note else []
    result.checkpoint = contents
    if loaded.weights_key:
        result.notes.append(f"weights taken from '{loaded.weights_key}' (choose another with --weights)")
    return result


def _load_for_inspection(source: ResolvedSource, **options: Any) -> "tuple[LoadedSource, str | None]":
    """On the meta device (no weights allocated) when the model allows it, else built for real.

    Factories that compute on their weights at init (torchvision RegNet, ultralytics YAML
    models: ``.item()``/copies out of a tensor) cannot be built on meta; ``convert`` falls
    back to a real build for them and so does ``inspect``.
    """
    from bnsurgeon.core.errors import BnSurgeonError, FactoryRaisedError

    try:
        return load_source(source, meta=True, **options), None
    except FactoryRaisedError as error:
        reason = error.message.split(" raised ", 1)[-1][:120]
    except BnSurgeonError:
        raise
    except Exception as error:  # not buildable on meta: build it for real
        reason = str(error).strip().splitlines()[0][:120] if str(error).strip() else type(error).__name__
    loaded = load_source(source, meta=False, **options)  # a factory that fails for real says so here
    return loaded, f"built with real weights: the model cannot be built on the meta device ({reason})"


def verify_timeout_s() -> float:
    """The ranks' collective timeout: ``BNSURGEON_DIST_TIMEOUT`` if set (validated up front), else 120 s."""
    from bnsurgeon.runtime.timeout import ENV_VAR, parse_timeout_s

    raw = os.environ.get(ENV_VAR)
    return parse_timeout_s(raw) if raw and raw.strip() else 120.0


def _check_input(
    loaded: LoadedSource, input_shape: "tuple[int, ...] | None", example_input: "CheckInput | None"
) -> "CheckInput":
    """The input for the eval check (and for finding producers under --to fused)."""
    chosen = resolve_check_input(
        loaded.model,
        input_shape=input_shape,
        example_input=example_input,
        recorded=loaded.check_input,
        own_shape=loaded.input_shape,
    )
    if chosen is None:
        raise UsageError(
            "cannot tell what input the model takes for the equivalence check",
            "pass --input-shape N,C,H,W or --example-input x.pt (or --no-check)",
        )
    return chosen


def _fused_shape(check_input: "CheckInput") -> tuple[int, ...]:
    """--to fused finds producers on one batch-first tensor."""
    if check_input.shape is None:
        raise UsageError(
            f"--to fused needs a single tensor input, not {check_input.describe()}", "pass --input-shape N,C,H,W"
        )
    return tuple(check_input.shape)


def refuse_fused_source(loaded: LoadedSource, role: str) -> None:
    """A fused checkpoint is a deployment end point: its folded BN modules no longer exist, so a
    conversion of it could not be replayed from the original architecture on load, and it cannot
    be the reference that a fold is re-done on."""
    if any(step.get("target") == "fused" for step in loaded.history or ()):
        raise UsageError(
            f"{role} {loaded.description} is a fused checkpoint (eval only; its folded BatchNorm "
            "layers no longer exist)",
            "convert the model it was folded from instead (the unfused checkpoint, timm name "
            "or factory); verify takes it as CONVERTED",
        )


@dataclass
class ConvertOutcome:
    result: ConvertResult
    loaded: LoadedSource
    output: Path | None
    reports: tuple[Path, Path] | None


def convert_source(
    source: "str | ResolvedSource",
    output: "str | Path | None",
    *,
    to: str = "sync",
    frozen: str = "keep",
    allow_unhandled: bool = False,
    model: str | None = None,
    model_args: dict[str, Any] | None = None,
    weights: str | None = None,
    trust_pickle: bool = False,
    accept_recorded_args: bool = False,
    force: bool = False,
    check: bool = True,
    input_shape: tuple[int, ...] | None = None,
    example_input: "CheckInput | str | os.PathLike | None" = None,
    include: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
    verify_world_sizes: tuple[int, ...] = (),
    progress: "Callable[[str], None] | None" = None,
    allow_no_bn: bool = False,
) -> ConvertOutcome:
    """The ``bnsurgeon convert`` pipeline. Writes nothing unless every step succeeded.

    ``progress`` is told the name of each phase as it starts (the CLI shows a spinner).
    A model with no BN-family module raises NothingToConvertError unless ``allow_no_bn``.
    A .pt/.pth/.pth.tar output carries a training checkpoint's other entries
    (``training_checkpoint.carry_entries``). ``example_input`` given as a path (``--example-input``)
    is an input like SOURCE: refused as an output, then read.
    """
    from bnsurgeon.files.training_checkpoint import carry_entries
    from bnsurgeon.rules import check_target

    phase = progress or (lambda text: None)

    check_target(to, frozen)
    if verify_world_sizes and not check:
        raise UsageError("--verify needs the eval check", "drop --no-check")
    timeout = verify_timeout_s() if verify_world_sizes else None
    example_file = example_input if isinstance(example_input, (str, os.PathLike)) else None
    example = None if isinstance(example_input, (str, os.PathLike)) else example_input
    resolved = resolve_source(source, model=model)
    if example_file is not None:
        check_reachable(example_file, "--example-input", UsageError, "pass a file of this machine with a shorter path")
    inputs: list[Any] = [*resolved.inputs()] + (
        [(example_file, "the --example-input file")] if example_file is not None else []
    )
    directory_output = output is not None and is_directory_output(output)
    if directory_output and to == "fused":
        raise UsageError(
            "a fused model is not the class its config.json names, so it cannot be a model directory",
            "write a file instead (-o OUT.safetensors)",
        )
    out: Path | None = None
    if directory_output and output is not None:
        out = check_directory_output(Path(output), inputs, force=force)
    elif output is not None:
        out = check_output_path(output, inputs, force=force)
    if example_file is not None:
        from bnsurgeon.checks.check_input import load_example_input

        example = load_example_input(example_file)
    phase(f"loading {resolved.text}")
    loaded = load_source(
        resolved,
        model=model,
        model_args=model_args,
        weights=weights,
        trust_pickle=trust_pickle,
        accept_recorded_args=accept_recorded_args,
    )
    refuse_fused_source(loaded, "SOURCE")
    if directory_output and loaded.architecture.kind != "transformers":
        raise UsageError(
            f"output {output} names a directory (no file suffix, or an existing directory): a model "
            f"directory is what save_pretrained writes for Hugging Face models, and "
            f"{loaded.description} is not one",
            "write a file instead (-o OUT.safetensors)",
        )
    refuse_invalid_weights(loaded.model, loaded.description)  # the written file must be one verify accepts
    fused = to == "fused"
    # fused finds producers on it before converting; otherwise chosen after the surgery, which
    # refuses an uninitialized lazy BN before any forward (inferring the input runs one)
    check_input = _check_input(loaded, input_shape, example) if fused else None
    shape = _fused_shape(check_input) if check_input is not None else None
    input_dims = None
    if to == "plain" and needs_input_dims(loaded.model):  # _BatchNormXd and SyncBN: which BatchNormNd?
        shown_by = check_input or resolve_check_input(
            loaded.model,
            input_shape=input_shape,
            example_input=example,
            recorded=loaded.check_input,
            own_shape=loaded.input_shape,
        )
        input_dims = observed_input_dims(loaded.model, shown_by) if shown_by is not None else None
        check_input = shown_by
    phase(f"converting to {to}" + (f" (finding producers on {shape})" if fused else ""))
    options: dict[str, Any] = {
        "frozen": frozen,
        "allow_unhandled": allow_unhandled,
        "include": include,
        "exclude": exclude,
        "input_dims": input_dims,
    }  # every carried state dict is converted with the same ones
    result = convert(loaded.model, to, example_input=shape, **options)
    result.report.source = loaded.description
    result.report.tool_version = __version__
    report = result.report
    if not (report.changed or report.kept or report.unhandled) and not allow_no_bn:
        raise NothingToConvertError(f"{loaded.description} has no BatchNorm-family module: there is nothing to convert")
    carried = carry_entries(loaded, result, out, options)
    result.report.carried = carried.summary
    if check:
        check_input = check_input or _check_input(loaded, input_shape, example)
        phase(f"checking eval outputs on {check_input.describe()}")
        if fused:
            from bnsurgeon.checks.fused_check import fused_check_result

            assert shape is not None  # set above for every fused conversion
            result.report.check = fused_check_result(loaded.model, result, shape, CHECK_SEED)
        else:
            result.report.check = compare_eval(loaded.model, result.model, check_input, exact=result.exact)
        check_result = result.report.check
        if not check_result.passed:
            raise VerificationError(
                f"converted model's eval outputs differ from the source's (max |diff| "
                f"{check_result.max_abs_diff:.3g}, {check_result.mode})"
            )
        if verify_world_sizes:
            from bnsurgeon.checks.verify import verify_models

            phase("verifying (train, 2 gloo ranks, perturbed)")
            if fused:
                from bnsurgeon.checks.fused_check import verify_fused

                assert result.report.fusion is not None and shape is not None  # a fused conversion records its folds
                verification = verify_fused(
                    loaded.model, result.model, result.report.fusion["folded"], shape, source_name=loaded.description
                )
            else:
                rebuild = recipe(
                    loaded.architecture, [*loaded.history, step(to, result.report.options)], class_map(result.model)
                )
                verification = verify_models(
                    loaded.model,
                    result.model,
                    check_input,
                    world_sizes=verify_world_sizes,
                    exact=result.exact,
                    source_name=loaded.description,
                    collective_timeout=timeout or 120.0,
                    rebuild_converted=rebuild,
                )
            result.report.verification = verification.to_dict()
            if not verification.passed:
                failed = verification.first_failure
                raise VerificationError(
                    f"verification failed: {failed.name} (max |diff| {failed.max_abs_diff:.3g})"
                    + (
                        f", first divergent module {failed.first_divergence}"
                        if failed.first_divergence
                        else f" ({failed.detail})"
                        if failed.detail
                        else ""
                    )
                )
    reports = None
    if out is not None and directory_output:
        result.report.output = str(out.parent)
        phase(f"writing {out.parent}")
        expected = set(loaded.architecture.build(meta=True).state_dict())  # what from_pretrained(DIR) loads
        reports = write_model_directory(
            result,
            out.parent,
            loaded.architecture,
            expected,
            source=loaded.description,
            force=force,
            check_input=check_input or loaded.check_input,
            history=loaded.history,
        )
        out = out.parent
    elif out is not None:
        result.report.output = str(out)
        phase(f"writing {out}")
        reports = write_conversion(
            result,
            out,
            loaded.architecture,
            source=loaded.description,
            force=force,
            extras=carried.entries,
            check_input=check_input or loaded.check_input,
            history=loaded.history,
            weights=carried.weights_key,
        )
    return ConvertOutcome(result, loaded, out, reports)


def verify(
    source: "str | ResolvedSource",
    converted: "str | ResolvedSource",
    *,
    world_sizes: "tuple[int, ...] | None" = None,
    input_shape: tuple[int, ...] | None = None,
    atol: float | None = None,
    perturb: bool = True,
    model: str | None = None,
    model_args: dict[str, Any] | None = None,
    converted_model: str | None = None,
    converted_model_args: dict[str, Any] | None = None,
    weights: str | None = None,
    converted_weights: str | None = None,
    trust_pickle: bool = False,
    accept_recorded_args: bool = False,
    on_check: "Callable[[Any], None] | None" = None,
    example_input: "CheckInput | str | os.PathLike | None" = None,
    compare_at: str | None = None,
    precision: str = "float64",
    device: str = "auto",
    as_torchrun_rank: bool = False,
):
    """``bnsurgeon verify``: prove CONVERTED behaves like SOURCE (eval, train, N ranks, frozen).

    ``world_sizes`` None: 2 ranks, or under torchrun the ranks torchrun started. ``as_torchrun_rank`` (the CLI
    under torchrun: its variables set; a script calling this keeps its own ranks unless it asks): this process is
    one rank of the N-rank check, on ``device`` (auto: ``cuda:LOCAL_RANK``
    with NCCL where every local rank has a GPU, else gloo on the CPU; cuda: GPUs shared over gloo where
    there are fewer than local ranks) in ``precision`` (float64, float32 or bf16-autocast: judged against
    plain BN's own error, measured in the same run); the ranks first prove they read the same bytes of every
    file (or all stop, exit 4), and every rank returns rank 0's result (or stops with its error's exit code).

    Both arguments are loaded under the same trust rules, each confirmed by what the user
    typed for it: ``model``/``model_args`` for SOURCE, ``converted_model``/
    ``converted_model_args`` for CONVERTED; a CONVERTED that records exactly the model the
    user named for SOURCE (same factory, same arguments) is confirmed by that name, since
    it runs anyway; ``weights``/``converted_weights`` pick a state dict
    of a file that holds several (a training checkpoint's EMA). ``on_check`` is told each check (a
    ``verify.CheckOutcome``) as it finishes. ``example_input`` (a CheckInput, or the path of a
    ``torch.save``'d tensor, tuple, list or dict as for ``--example-input``), or else the input
    recorded in either file, replaces the inferred one; ``compare_at`` names the submodule compared.
    """
    import torch

    from bnsurgeon.checks.check_input import clone_value
    from bnsurgeon.checks.torchrun_ranks import (
        DEVICES,
        PRECISIONS,
        agree_on_files,
        check_device,
        check_torchrun_options,
        files_read,
        join_torchrun_world,
        launched_by_torchrun,
        leave_torchrun_world,
        rank_0_alone,
        ranks_agree,
        said_by,
        unchanged_since_hashed,
    )
    from bnsurgeon.checks.verify import verify_models

    timeout = verify_timeout_s()
    if precision not in PRECISIONS:
        raise said_by(
            UsageError(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)}", "pass one of them"), 0
        )
    if device not in DEVICES:
        raise said_by(UsageError(f"--device {device!r} is not one of {', '.join(DEVICES)}", "pass one of them"), 0)
    torchrun = as_torchrun_rank
    if torchrun and not launched_by_torchrun():
        raise UsageError(
            "verify as a torchrun rank, and torchrun's variables (WORLD_SIZE, RANK) are not set",
            "start it with torchrun (torchrun --nproc-per-node 2 -m bnsurgeon verify ...)",
        )
    if torchrun:
        world_sizes = (check_torchrun_options(world_sizes or (), world_sizes is not None),)
        check_device(device)
    else:
        if precision != "float64" or device != "auto":
            flag = "--precision" if precision != "float64" else "--device"
            raise UsageError(
                f"{flag} applies to the check under torchrun (on the ranks' devices); without torchrun verify "
                "starts its own gloo ranks on this machine's CPU, in float64",
                f"run it under torchrun (torchrun --nproc-per-node 2 -m bnsurgeon verify ...), or drop {flag}",
            )
        world_sizes = world_sizes or (2,)
    if not torchrun:  # torchrun's world is what torchrun started: the cap is on processes verify starts itself
        check_world_sizes(world_sizes)
    check_atol(atol)
    # under torchrun every rank joins first (they start together), then prepares; a rank that fails there stops
    # every rank the same way (ranks_agree), and the check's collectives follow
    world = join_torchrun_world(device, timeout) if torchrun else None
    read: list = []
    with ranks_agree(world):
        resolved = resolve_source(source, model=model)
        resolved_converted = resolve_source(converted, role="CONVERTED", model=converted_model)
        if world is not None:  # every rank proves it reads the same bytes, before it reads them
            read = files_read(_files_verify_reads(resolved, resolved_converted, example_input))
    if world is not None:
        agree_on_files(world, read)
    with ranks_agree(world):
        example = None if isinstance(example_input, (str, os.PathLike)) else example_input
        if isinstance(example_input, (str, os.PathLike)):  # as the CLI's --example-input: read (weights_only)
            from bnsurgeon.checks.check_input import load_example_input

            example = load_example_input(example_input)
        left = load_source(
            resolved,
            model=model,
            model_args=model_args,
            weights=weights,
            trust_pickle=trust_pickle,
            accept_recorded_args=accept_recorded_args,
        )
        right = load_source(
            resolved_converted,
            model=converted_model,
            model_args=converted_model_args,
            weights=converted_weights,
            trust_pickle=trust_pickle,
            accept_recorded_args=accept_recorded_args,
            flag="--converted-model",
            named_elsewhere=left.architecture,
        )
        unchanged_since_hashed(read)
        refuse_fused_source(left, "SOURCE")
        refuse_non_finite(left.model, left.description)
        refuse_non_finite(right.model, right.description)
        recorded = (
            read_recorded(right.checkpoint) if right.checkpoint is not None and right.checkpoint.is_bnsurgeon else None
        )
        fused = recorded is not None and recorded.target == "fused"
        if not fused:  # a fused model lacks the folded BN modules by design
            require_same_architecture(left.model, right.model, left.description, right.description)
        check_input = resolve_check_input(
            left.model,
            input_shape=input_shape,
            example_input=example,
            recorded=left.check_input or right.check_input,
            own_shape=left.input_shape or right.input_shape,
        )
        if check_input is None:
            raise UsageError(
                "cannot tell what input the models take",
                "pass --input-shape N,C,... (e.g. 4,16,32) or --example-input x.pt",
            )
        with preserved_modes(left.model, right.model), torch.no_grad():
            for loaded, what in ((left, "SOURCE"), (right, "CONVERTED")):
                parameter = next(iter(loaded.model.parameters()), None)
                dtype = parameter.dtype if parameter is not None and parameter.is_floating_point() else torch.float32
                run_forward(
                    loaded.model.eval(),
                    clone_value(check_input.make(dtype=dtype)),
                    f"{what} ({loaded.description})",
                    check_input.describe(),
                )
    if fused and recorded is not None:
        from bnsurgeon.checks.fused_check import verify_fused

        def fused_checks():
            if compare_at:
                raise UsageError(
                    "--compare-at does not apply to a fused checkpoint: its checks compare the whole "
                    "model's eval output (folded BN modules no longer exist)",
                    "drop --compare-at",
                )
            return verify_fused(
                left.model,
                right.model,
                recorded.folds,
                _fused_shape(check_input),
                atol=atol,
                perturb=perturb,
                source_name=left.description,
                converted_name=right.description,
                on_check=on_check,
            )

        if world is None:
            return fused_checks()
        leave_torchrun_world(world)  # a fused model has no N-rank check: rank 0 runs the rest alone, and tells
        return rank_0_alone(world, fused_checks)
    return verify_models(
        left.model,
        right.model,
        check_input,
        world_sizes=world_sizes,
        torchrun=world,
        precision=precision,
        atol=atol,
        perturb=perturb,
        exact=not is_inexact(left.model, right.model),
        source_name=left.description,
        converted_name=right.description,
        collective_timeout=timeout,
        on_check=on_check,
        compare_at=compare_at,
        rebuild_converted=recipe(right.architecture, right.history, recorded.classes if recorded is not None else None),
    )


def _files_verify_reads(
    source: "ResolvedSource", converted: "ResolvedSource", example_input: "CheckInput | str | os.PathLike | None"
) -> "list[tuple[str, str | os.PathLike]]":
    """(role, path) of every file verify loads: SOURCE's and CONVERTED's (not the reports beside them, which only
    an output may not replace) and the --example-input file."""
    files: list[tuple[str, str | os.PathLike]] = []
    for resolved in (source, converted):
        beside = set(report_paths(resolved.path)) if resolved.path is not None else set()
        files += [(resolved.role, file) for file in resolved.files if file not in beside]
    if isinstance(example_input, (str, os.PathLike)):
        files.append(("--example-input", example_input))
    return files


@dataclass
class RecalibrateOutcome:
    report: Any  # calibration.recalibrate.RecalibrationReport
    loaded: LoadedSource
    output: Path | None  # None on ranks other than 0 (only rank 0 writes)
    reports: tuple[Path, Path] | None
    rank: int = 0


def recalibrate_source(
    source: "str | ResolvedSource",
    data: "str | ResolvedData",
    output: "str | Path | None",
    *,
    batches: int | None = None,
    samples: int | None = None,
    batch_size: int | None = None,
    include_frozen: bool = False,
    fast_normalization: bool = False,
    model: str | None = None,
    model_args: dict[str, Any] | None = None,
    weights: str | None = None,
    trust_pickle: bool = False,
    accept_recorded_args: bool = False,
    force: bool = False,
    progress: "Callable[[str], None] | None" = None,
    on_batch: "Callable[[int, int], None] | None" = None,
) -> RecalibrateOutcome:
    """The ``bnsurgeon recalibrate`` pipeline: load SOURCE (any kind convert takes), read DATA
    (``loading.data``), compute the exact population BN statistics (``calibration``), write OUT
    (the source file again with only the chosen weights' BN running statistics changed, see
    ``files.recalibrated``) and its reports. Writes nothing unless every step succeeded.

    ``batches``/``samples`` are required amounts: data that holds fewer is an error saying how
    much it holds. Under torchrun (WORLD_SIZE > 1) the default process group is initialised,
    each rank reads batch i of DATA when i % world == rank, and only rank 0 writes.
    """
    from bnsurgeon.calibration.recalibrate import recalibrate
    from bnsurgeon.files.recalibrated import check_output_format, recalibrated_writers, write_recalibrated
    from bnsurgeon.loading.data import max_batch_bytes, open_data, resolve_data

    phase = progress or (lambda text: None)
    if batches is not None and batches < 1:
        raise UsageError(f"--batches must be at least 1 (got {batches})", "pass --batches 1 or more")
    if samples is not None and samples < 1:
        raise UsageError(f"--samples must be at least 1 (got {samples})", "pass --samples 1 or more")
    max_batch_bytes()  # every variable recalibrate reads is checked before any work
    rank, world, device = _torchrun_rank()
    resolved = resolve_source(source, model=model)
    resolved_data = resolve_data(data, check_name=True)
    inputs: list[Any] = [*resolved.inputs()] + [(file, "a --data file") for file in resolved_data.files]
    directory_output = output is not None and is_directory_output(output)
    out: Path | None = None
    if directory_output and output is not None:  # -o DIR: config.json + model.safetensors, as convert writes
        out = check_directory_output(Path(output), inputs, force=force)
    elif output is not None:
        out = check_output_path(output, inputs, force=force)
    phase(f"loading {resolved.text}")
    loaded = load_source(
        resolved,
        model=model,
        model_args=model_args,
        weights=weights,
        trust_pickle=trust_pickle,
        accept_recorded_args=accept_recorded_args,
    )
    refuse_fused_source(loaded, "SOURCE")
    if directory_output and loaded.architecture.kind != "transformers":
        raise UsageError(
            f"output {output} names a directory (no file suffix, or an existing directory): a model "
            f"directory is what save_pretrained writes for Hugging Face models, and "
            f"{loaded.description} is not one",
            "write a file instead (-o OUT.safetensors)",
        )
    refuse_invalid_weights(loaded.model, loaded.description)
    if out is not None:
        check_output_format(out, loaded.checkpoint, loaded.weights_key)
    own_buffers(loaded.model)  # the statistics change in place: never in the tensors the other entries hold
    if device is not None:  # torchrun on GPUs (NCCL): the model and its batches on this rank's device
        loaded.model.to(device)
    parameter = next((p for p in loaded.model.parameters() if p.is_floating_point()), None)
    stream = open_data(
        resolved_data,
        model=loaded.model,
        batch_size=batch_size,
        max_batches=batches,
        max_samples=samples,
        rank=rank,
        world=world,
        dtype=parameter.dtype if parameter is not None else None,
        device=device,
        model_directory=source_directory(loaded),
    )
    phase(f"recalibrating on {stream.description}" + (f" (rank {rank} of {world})" if world > 1 else ""))
    report = recalibrate(
        loaded.model, stream, include_frozen=include_frozen, progress=on_batch, fast_normalization=fast_normalization
    )
    report.source = loaded.description
    report.data = stream.record()
    record = {
        "command": "recalibrate",
        "version": __version__,
        "weights": loaded.weights_key or "",
        "samples": report.samples,
        "batches": report.batches,
        "ranks": report.ranks,
        "data": report.data,
        "include_frozen": include_frozen,
        "fast_normalization": fast_normalization,
        "modules": len(report.modules),
        "unreached": list(report.unreached),
    }
    if rank != 0 or out is None:
        return RecalibrateOutcome(report, loaded, None, None, rank)
    report.output = str(out.parent if directory_output else out)
    phase(f"writing {report.output}")
    writers = recalibrated_writers(
        out,
        loaded.checkpoint,
        loaded.weights_key,
        loaded.stripped_prefix,
        loaded.model,
        [m.path for m in report.modules],
        record,
        report.to_json(),
        report.to_markdown(),
    )
    from bnsurgeon.files.writing import report_paths

    if directory_output:
        writers.update(directory_extras(out.parent, loaded, source_directory(loaded)))
        write_into_directory(out.parent, writers, force=force)
        return RecalibrateOutcome(report, loaded, out.parent, report_paths(out), rank)
    write_recalibrated(writers, force=force)
    return RecalibrateOutcome(report, loaded, out, report_paths(out), rank)


def source_directory(loaded: LoadedSource) -> "Path | None":
    """The model directory SOURCE names (a Hugging Face model's, or one bnsurgeon wrote), or None."""
    if loaded.architecture.kind != "transformers" or loaded.source is None:
        return None
    return loaded.source.directory


def directory_extras(directory: Path, loaded: LoadedSource, source: "Path | None") -> dict:
    """A recalibrated model directory's config.json (the one the model was built from) and, where the source directory
    has one, its preprocessor_config.json unchanged: from_pretrained and AutoImageProcessor read it as they read the
    source."""
    from bnsurgeon.core.json_text import dumps
    from bnsurgeon.files.model_directory import CONFIG_FILE

    text = dumps(loaded.architecture.kwargs["config"], indent=2, sort_keys=True) + "\n"
    writers = {directory / CONFIG_FILE: lambda temp: temp.write_text(text)}
    preprocessor = source / PREPROCESSOR_FILE if source is not None else None
    if preprocessor is not None and os.path.lexists(preprocessor):  # one that is not a regular file is refused
        data = read_preprocessor_text(preprocessor)
        writers[directory / PREPROCESSOR_FILE] = lambda temp: temp.write_text(data)
    return writers


def own_buffers(model: "nn.Module") -> None:
    """Give every buffer memory of its own (buffers one tensor in the model stay one): a model loaded from a
    checkpoint holds the file's tensors, which another entry of the file (the raw state_dict beside
    state_dict_ema, the same dict saved under both names) may hold too, and those entries are written back
    unchanged."""
    copies: dict[int, Any] = {}
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = copies.setdefault(id(buffer), buffer.clone())


#: no torchrun job has more processes
MAX_RANKS = 1 << 20


def _torchrun_rank():
    """(rank, world, device or None) under torchrun (the default process group initialised here),
    else (0, 1, None). The device is set only for a GPU rank (NCCL)."""
    from bnsurgeon.core.environment import whole_number

    world = whole_number("WORLD_SIZE", 1, low=1, high=MAX_RANKS, unit="processes")
    if world <= 1:
        return 0, 1, None
    whole_number("RANK", 0, low=0, high=world - 1)  # torchrun sets them; read again by init_distributed
    whole_number("LOCAL_RANK", 0, low=0, high=world - 1)
    from bnsurgeon.runtime import init_distributed

    info = init_distributed()
    return info.rank, info.world_size, info.device if info.device.type != "cpu" else None
