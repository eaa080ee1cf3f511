"""The torch ``nn.SyncBatchNorm`` layers a script's model builds itself, trained as bnsurgeon's exact layer.

OpenMMLab's ``norm_cfg=dict(type='SyncBN')`` (a registry that captured the class when mmcv was imported),
detectron2's ``get_norm("SyncBN")``, a model's own ``nn.SyncBatchNorm(C)`` and a whole module unpickled
call no converter, so ``converters.py`` never sees them, and torch's class refuses CPU tensors once a
process group exists.

torch's class itself is never replaced: registries captured it, and frameworks test ``isinstance`` with
it. Instead each instance built (or unpickled, or copied) while the script runs is remembered with where
it came from, and is *adopted* (``SyncBatchNorm.adopt``: made bnsurgeon's layer in place, the same object
with the same Parameters, buffers, keys and hooks) at the first of three moments:

- ``DistributedDataParallel`` wraps a model that holds it (Lightning's, mmengine's and detectron2's
  wrappers are DDP): every such layer of that model at once, in one summary line and report listing their
  paths. A BN class no rule claims stops the script there, before it trains, as ``convert`` refuses it.
- It runs in train mode while a process group exists (a model used without DDP): every remembered layer
  not yet adopted, at once. An eval-mode forward adopts nothing: torch's layer syncs nothing in eval mode.
- ``torch.compile`` starts compiling while a process group exists (dynamo's start callback, before it
  traces anything): every remembered layer, so that no adoption ever runs inside a trace.

When or on which rank a layer was adopted never names it: the name its rows carry is fixed at its first
synchronized call by what the ranks run in sync (``runtime/identity.py``).

In one process without a process group torch's layer already computes plain BN, bit for bit, so it is
left alone. Only classes a rule converts as torch's class are adopted (torch's, mmengine's ``SyncBatchNorm``
that changes only the input check); a subclass with a forward of its own is refused, never run as ours.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import weakref
from types import ModuleType
from typing import Any, Callable

from bnsurgeon.core.errors import BnSurgeonError, UnhandledModuleError
from bnsurgeon.launch.log import ConversionLog, called_at

AT_WRAP = "torch.nn.SyncBatchNorm layers the model built, adopted at DistributedDataParallel"
AT_FORWARD = "torch.nn.SyncBatchNorm layers the model built, adopted at their first forward under a process group"
_BEFORE = "built before bnsurgeon run started"

AT_COMPILE = "torch.nn.SyncBatchNorm layers the model built, adopted as torch.compile started under a process group"

#: torch SyncBatchNorm layers built, unpickled or copied while the script runs -> where
_remembered: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def _remember(layer: Any, where: str) -> None:
    _remembered[layer] = where


def _foreign(layer: Any) -> bool:
    """A SyncBatchNorm that is not (yet) bnsurgeon's."""
    return not type(layer).__module__.startswith("bnsurgeon.")


def _group_exists() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _torch_dirs(batchnorm: ModuleType) -> tuple[str, ...]:
    """Directories whose frames are not where a layer was built: torch's, and copy's for a deep copy."""
    torch_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(str(batchnorm.__file__)))))
    return (torch_dir + os.sep, os.path.abspath(copy.__file__))


def patch_sync_class(batchnorm: ModuleType, log: ConversionLog) -> Callable[[], None]:
    """torch's ``nn.SyncBatchNorm`` remembers each instance made while the script runs and adopts it when it
    first runs under a process group; returns the undo."""
    cls = batchnorm.SyncBatchNorm
    skipped = _torch_dirs(batchnorm)
    originals = {name: cls.__dict__.get(name) for name in ("__init__", "__setstate__", "forward")}
    init, forward = originals["__init__"], originals["forward"]
    torch = batchnorm.torch  # still being imported here: its compiler is read when the forward runs

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if log.active and _foreign(self):
            _remember(self, f"built at {called_at(*skipped)}")

    def __setstate__(self: Any, state: dict) -> None:
        super(cls, self).__setstate__(state)
        if log.active and _foreign(self):
            _remember(self, f"unpickled or copied at {called_at(*skipped)}")

    def adopting_forward(self: Any, input: Any) -> Any:
        # never inside a trace (dynamo's start callback adopted first: a layer it adopted while this very forward
        # was the frame being compiled runs as what it now is); never in eval mode, where torch's layer syncs
        # nothing: one rank's shape print or look at an EMA copy must not change what it trains with
        if torch.compiler.is_compiling():
            return forward(self, input) if _foreign(self) else type(self).forward(self, input)
        if not (self.training and log.active and _foreign(self) and _group_exists()):
            return forward(self, input)
        adopt_remembered(log, called_at(*skipped), self)
        return self.forward(input)

    replacements = {"__init__": __init__, "__setstate__": __setstate__, "forward": adopting_forward}
    for name, replacement in replacements.items():
        if originals[name] is not None:
            functools.update_wrapper(replacement, originals[name])
        setattr(cls, name, replacement)

    def undo() -> None:
        for name, original in originals.items():
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        _remembered.clear()  # a later run (run_script again) remembers its own

    return undo


def patch_ddp(distributed: ModuleType, log: ConversionLog) -> Callable[[], None]:
    """``DistributedDataParallel`` adopts the torch SyncBatchNorm layers of the model it wraps, where it checks
    them (its own refusal of CPU modules; the Parameters are unchanged, so its buckets are too). Patching the
    check rather than ``__init__`` leaves DDP's own warnings pointing at the script's line."""
    cls = distributed.DistributedDataParallel
    name = "_passing_sync_batchnorm_handle"
    check = cls.__dict__.get(name)
    skipped = (os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(str(distributed.__file__))))) + os.sep,)

    def passing_sync_batchnorm_handle(self: Any, module: Any) -> Any:
        if log.active and _holds_foreign_sync(module):
            adopt_model(log, module, called_at(*skipped))
        # torch's check refuses every SyncBatchNorm on CPU, bnsurgeon's too: it sees what remains foreign
        return check(self, module) if check is not None and _holds_foreign_sync(module) else None

    if check is not None:
        functools.update_wrapper(passing_sync_batchnorm_handle, check)
    setattr(cls, name, passing_sync_batchnorm_handle)
    return lambda: setattr(cls, name, check) if check is not None else delattr(cls, name)


def _holds_foreign_sync(model: Any) -> bool:
    from torch import nn

    return isinstance(model, nn.Module) and any(
        isinstance(layer, nn.SyncBatchNorm) and _foreign(layer) for layer in model.modules()
    )


def _refused(log: ConversionLog, label: str, where: str, error: BnSurgeonError) -> BnSurgeonError:
    """The refusal, named by the moment it happened, kept in the log (the runner shows it in one line)."""
    error.message = f"{label} (at {where}): {error.message}"
    error.args = (error.message,)
    log.refusal = error
    return error


def _adoptable(rule: Any) -> bool:
    """Whether the rule converts the layer's class as torch's class (so the same object can become ours)."""
    from bnsurgeon.rules.builders import to_sync

    return rule is not None and rule.targets.get("sync") is to_sync


def adopt_model(log: ConversionLog, model: Any, where: str) -> None:
    """Every torch SyncBatchNorm of ``model`` made bnsurgeon's in place, said in one line and one report; a BN
    class no rule claims (unless the run allows it), or a SyncBatchNorm subclass that cannot be adopted, stops
    the script before anything changes."""
    from bnsurgeon.core.anatomy import qualname
    from bnsurgeon.runtime.layers import SyncBatchNorm
    from bnsurgeon.surgery.report import ModuleChange, ModuleKept, Report
    from bnsurgeon.surgery.walk import plan

    entries = plan(model)
    unhandled = [entry for entry in entries if entry.rule is None]
    if unhandled and not log.allow_unhandled:
        names = ", ".join(f"{entry.path} ({entry.cls_name})" for entry in unhandled[:12])
        raise _refused(log, AT_WRAP, where, UnhandledModuleError(f"no rule for these BatchNorm-like modules: {names}"))
    from torch import nn

    syncs = [entry for entry in entries if isinstance(entry.module, nn.SyncBatchNorm) and _foreign(entry.module)]
    _refuse_unadoptable(log, AT_WRAP, where, [(entry.module, entry.rule, entry.path) for entry in syncs])
    report = Report(target="sync", options={"allow_unhandled": log.allow_unhandled, "inplace": True})
    for entry in entries:
        if entry.rule is None:
            report.unhandled.append(
                ModuleKept(
                    entry.path, entry.paths[1:], entry.cls_name, None, "no rule claims this class (left untouched)"
                )
            )
        elif entry in syncs:
            built_where = _remembered.pop(entry.module, _BEFORE)
            origin = entry.cls_name
            SyncBatchNorm.adopt(entry.module)  # named by what runs in sync, not by this path (identity.py)
            report.changed.append(
                ModuleChange(
                    entry.path,
                    entry.paths[1:],
                    origin,
                    qualname(SyncBatchNorm),
                    entry.rule.name,
                    [],
                    [built_where, "adopted in place: the same module object"],
                )
            )
        else:
            reason = "not built as a SyncBatchNorm: left as the model built it"
            report.kept.append(ModuleKept(entry.path, entry.paths[1:], entry.cls_name, entry.rule.name, reason))
    log.record(AT_WRAP, where, report)


def adopt_remembered(log: ConversionLog, where: str, layer: Any = None, label: str = AT_FORWARD) -> None:
    """``layer`` and every other remembered torch SyncBatchNorm not yet adopted, in one line and one report."""
    from bnsurgeon.core.anatomy import qualname
    from bnsurgeon.rules import default_registry
    from bnsurgeon.runtime.layers import SyncBatchNorm
    from bnsurgeon.surgery.report import ModuleChange, Report

    registry = default_registry()
    first = [] if layer is None else [layer]
    pending = [*first, *(other for other in list(_remembered) if other is not layer and _foreign(other))]
    if not pending:
        return
    candidates = [(module, registry.lookup(type(module)), _remembered.get(module, _BEFORE)) for module in pending]
    _refuse_unadoptable(log, label, where, [(module, rule, f"<{site}>") for module, rule, site in candidates])
    report = Report(target="sync", options={"allow_unhandled": log.allow_unhandled, "inplace": True})
    for module, rule, site in candidates:
        origin = qualname(type(module))
        SyncBatchNorm.adopt(module)
        _remembered.pop(module, None)
        report.changed.append(
            ModuleChange(
                f"<{site}>",
                [],
                origin,
                qualname(SyncBatchNorm),
                "" if rule is None else rule.name,
                [],
                [site, "adopted in place"],
            )
        )
    log.record(label, where, report)


def patch_compile_start(dynamo: ModuleType, log: ConversionLog) -> Callable[[], None]:
    """Every remembered layer adopted as ``torch.compile`` starts compiling under a process group, before dynamo
    traces anything: adoption calls Python that dynamo cannot trace (``sys._getframe``), so inside the trace it
    failed a ``fullgraph=True`` compile and warned otherwise. dynamo's own start callback; registered again after
    ``torch._dynamo.reset()``, which clears the callbacks; returns the undo."""
    handler = dynamo.callback_handler
    import contextlib

    torch_dir = os.path.dirname(os.path.dirname(os.path.abspath(str(dynamo.__file__)))) + os.sep
    skipped = (torch_dir, os.path.abspath(contextlib.__file__))  # the script's line that called the compiled code

    def adopt_before_tracing(*_: Any) -> None:  # torch >= 2.5 passes the compile's details; 2.4 nothing
        if not (log.active and _group_exists()):
            return
        if any(_foreign(layer) for layer in list(_remembered)):
            adopt_remembered(log, called_at(*skipped), label=AT_COMPILE)
        from bnsurgeon.runtime.identity import fix_running_layers

        fix_running_layers(sys._getframe(1))  # as the eager path names them: the compiled one reads no stack

    reset: Callable[..., Any] = dynamo.reset

    def reset_keeping_the_callback(*args: Any, **kwargs: Any) -> Any:
        result = reset(*args, **kwargs)
        if adopt_before_tracing not in handler.start_callbacks:
            handler.register_start_callback(adopt_before_tracing)
        return result

    handler.register_start_callback(adopt_before_tracing)
    setattr(dynamo, "reset", functools.update_wrapper(reset_keeping_the_callback, reset))  # noqa: B010

    def undo() -> None:
        if adopt_before_tracing in handler.start_callbacks:
            handler.remove_start_callback(adopt_before_tracing)
        setattr(dynamo, "reset", reset)  # noqa: B010

    return undo


def _refuse_unadoptable(log: ConversionLog, label: str, where: str, layers: list[tuple[Any, Any, str]]) -> None:
    refused = [(path, layer) for layer, rule, path in layers if not _adoptable(rule)]
    if not refused:
        return
    from bnsurgeon.core.anatomy import qualname

    names = ", ".join(f"{path} ({qualname(type(layer))})" for path, layer in refused[:12])
    raise _refused(
        log,
        label,
        where,
        UnhandledModuleError(
            f"no rule converts these SyncBatchNorm subclasses as torch's class, so they cannot train as "
            f"bnsurgeon's layer: {names}",
            "if the class's forward is torch's, register a rule for it whose sync builder is "
            "bnsurgeon.rules.builders.to_sync; else build those layers as BatchNorm and convert the model in "
            "the script (nn.SyncBatchNorm.convert_sync_batchnorm)",
        ),
    )
