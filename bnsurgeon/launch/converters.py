"""Every known sync-BN converter, replaced by bnsurgeon's exact conversion while a script runs.

=========================================================  =============================================
converter the script (or its framework) calls              what runs instead
=========================================================  =============================================
``torch.nn.SyncBatchNorm.convert_sync_batchnorm``          ``convert(module, "sync", process_group=...,
(classmethod; Lightning's ``sync_batchnorm=True`` calls    inplace=True)``: children converted in place,
it from ``TorchSyncBatchNorm.apply``)                      the (possibly new) root returned, as torch does
``timm.layers.convert_sync_batchnorm``                     the same, with its ``process_group``
``mmengine.model.utils.convert_sync_batchnorm``            the same for ``implementation="torch"``
                                                           (``"mmcv"``, a CUDA op: mmengine's own)
Lightning's ``TorchSyncBatchNorm.revert``,                 ``convert(module, "plain")`` of bnsurgeon's
``mmengine.model.utils.revert_sync_batchnorm``             layers (the exact original classes), then the
                                                           original for any other SyncBatchNorm
=========================================================  =============================================

A model that builds torch's ``nn.SyncBatchNorm`` itself (a registry's ``'SyncBN'``, detectron2's ``get_norm``,
its own ``__init__``) calls no converter: torch's class and DDP's check adopt those layers in place
(``built.py``), patched here with torch's classmethod.

Only what the original would convert is converted: each replacement runs the surgery with a
registry in which the classes the original leaves alone are kept (torch's, timm's and
mmengine's converters take ``_BatchNorm`` subclasses: frozen BN stays frozen; the reverts take
bnsurgeon's sync layers). A BN-like module that no rule claims is refused as ``convert``
refuses it, so the script stops where it converts, before it trains.

Nothing is imported to patch it: a finder on ``sys.meta_path`` patches each converter's module
the moment that module has executed, so a script that never imports Lightning does not pay
for it, and ``bnsurgeon run`` starts without torch.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Iterator

from bnsurgeon.core.after_import import after_import
from bnsurgeon.core.errors import BnSurgeonError
from bnsurgeon.launch import built
from bnsurgeon.launch.log import ConversionLog, called_at

__all__ = ["PATCHES", "ConversionLog", "install", "patched_converters", "swap_function"]

TORCH = "torch.nn.SyncBatchNorm.convert_sync_batchnorm"
TIMM = "timm.layers.convert_sync_batchnorm"
LIGHTNING_REVERT = "Lightning TorchSyncBatchNorm.revert"
MMENGINE = "mmengine.model.utils.convert_sync_batchnorm"
MMENGINE_REVERT = "mmengine.model.utils.revert_sync_batchnorm"


def _scoped_registry(target: str, converts: Callable[[Any], bool], reason: str) -> Any:
    """The process-wide registry, except that for a module the original converter would leave alone
    the ``target`` builder keeps it (and the report says why). Under ``sync``, a layer that is already
    bnsurgeon's takes the process group given, ``None`` (the default group) included: torch's and
    timm's converters rebuild every ``_BatchNorm``, an ``nn.SyncBatchNorm`` too, with the group given."""
    from dataclasses import replace

    from bnsurgeon.rules import Registry, default_registry
    from bnsurgeon.runtime.layers import SyncBatchNorm

    base = default_registry()

    def regroup(module: Any, context: Any) -> Any:
        if module.process_group is context.process_group:
            return context.keep(module, "already bnsurgeon's sync BN over the process group given")
        module.process_group = context.process_group
        return context.keep(module, "already bnsurgeon's sync BN; now syncs over the process group given")

    class Scoped(Registry):
        def __bool__(self) -> bool:  # it holds no rules of its own: empty, it would read as "no registry given"
            return True

        def lookup(self, cls: type) -> Any:
            rule = base.lookup(cls)
            if rule is None or target not in rule.targets:
                return rule
            build = regroup if target == "sync" and issubclass(cls, SyncBatchNorm) else rule.targets[target]

            def scoped(module: Any, context: Any) -> Any:
                return build(module, context) if converts(module) else context.keep(module, reason)

            return replace(rule, targets={**rule.targets, target: scoped})

    return Scoped()


def _surgery(
    log: ConversionLog,
    converter: str,
    module: Any,
    target: str,
    converts: Callable[[Any], bool],
    *,
    process_group: Any = None,
    allow_unhandled: bool,
) -> Any:
    """bnsurgeon's conversion in place under the name of ``converter``; a refusal is kept in the log."""
    from bnsurgeon.surgery.walk import convert

    where = called_at()
    registry = _scoped_registry(target, converts, f"{converter} does not convert this class")
    try:
        result = convert(
            module,
            target,
            allow_unhandled=allow_unhandled,
            process_group=process_group,
            inplace=True,
            registry=registry,
        )
        log.record(converter, where, result.report)  # a report that cannot be written stops the run too
    except BnSurgeonError as error:
        error.message = f"{converter} (called at {where}): {error.message}"
        error.args = (error.message,)
        log.refusal = error
        raise
    return result.model


def _sync(log: ConversionLog, converter: str, module: Any, process_group: Any, batch_norm: type) -> Any:
    return _surgery(
        log,
        converter,
        module,
        "sync",
        lambda layer: isinstance(layer, batch_norm),
        process_group=process_group,
        allow_unhandled=log.allow_unhandled,
    )


def _converted_by_us(layer: Any) -> bool:
    """A bnsurgeon sync layer made from a class that is not sync itself: the layers a sync converter
    made under ``bnsurgeon run``. One the model built as ``nn.SyncBatchNorm`` (or timm's act variant)
    is not: the original revert treats it as it treats that class."""
    from bnsurgeon.runtime.layers import SyncBatchNorm

    if not isinstance(layer, SyncBatchNorm) or layer.bnsurgeon_origin is None:
        return False
    return not layer.bnsurgeon_origin.rsplit(".", 1)[-1].startswith("SyncBatchNorm")


def _plain(log: ConversionLog, converter: str, module: Any) -> Any:
    """bnsurgeon's sync layers back to their exact original classes; nothing else touched (after
    training, a class no rule claims is left as it is rather than stopping the script)."""
    return _surgery(log, converter, module, "plain", _converted_by_us, allow_unhandled=True)


def _as_timm_layers(module: Any, timm_sync_act: Any) -> Any:
    """``module`` with each bnsurgeon ``SyncBatchNormAct`` shown as the timm ``SyncBatchNormAct`` that timm's
    converter would have built (the same Parameters, buffers, activation and dropout), for a timm function that
    tells layers apart by timm's classes: ``freeze_batch_norm_2d`` replaces every one of them. In place for
    children; the root returned."""
    from bnsurgeon.runtime.layers import SyncBatchNormAct

    def shown(layer: Any) -> Any:
        if not isinstance(layer, SyncBatchNormAct):
            return layer
        shell = timm_sync_act.__new__(timm_sync_act)
        shell.__dict__.update(layer.__dict__)
        return shell

    root = shown(module)
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, SyncBatchNormAct):
                setattr(parent, name, shown(child))
    return root


_local = threading.local()


def _passing_through() -> bool:
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def _pass_through() -> Iterator[None]:
    """While an original revert runs on what bnsurgeon left: its recursive calls reach the
    original again, not the replacement."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _modules_holding(value: object) -> Iterator[tuple[dict, str]]:
    """(namespace, name) of every imported module's global bound to ``value``."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, held in list(namespace.items()):
            if held is value:
                yield namespace, name


def swap_function(home: ModuleType, name: str, replacement: Callable, *, fresh: bool = False) -> Callable[[], None]:
    """Bind ``replacement`` in place of ``home.name`` in every module namespace that holds the original.

    Why names and not the function's ``__code__``: a swapped code object would run with the
    original's globals (timm's namespace) and closure, so it could reach bnsurgeon only through
    names planted in that namespace; it would change a function object everyone shares for good,
    with a traceback through it naming timm's file at bnsurgeon's line numbers; and restoring it
    means swapping the code of a live function. Replacing the name is visible and reversible,
    and it covers every way a script reaches the function: attribute look-ups at call time
    (``timm.layers.convert_sync_batchnorm(m)``), names bound by ``from ... import`` after the
    patch (the finder patches ``timm.layers.norm_act`` the moment it has executed, before
    ``timm.layers`` re-exports it, so a script's module-level import gets the replacement), and
    names bound before (the scan of ``sys.modules`` below). It misses only a reference kept
    outside any module namespace before the run started; neither timm nor mmengine keeps one,
    and the patch is in place before the script's first line. ``fresh``: ``home`` has just executed,
    so nothing else can hold the function yet and the scan is skipped (it costs ~40 ms with torch loaded).
    """
    original = getattr(home, name)
    functools.update_wrapper(replacement, original)
    for namespace, bound in [(vars(home), name), *([] if fresh else _modules_holding(original))]:
        namespace[bound] = replacement

    def undo() -> None:
        for namespace, bound in _modules_holding(replacement):
            namespace[bound] = original

    return undo


def _patch_torch(module: ModuleType, log: ConversionLog, fresh: bool) -> Callable[[], None]:
    """torch's classmethod; and torch's class adopts the layers a model builds itself (built.py)."""
    sync_class = module.SyncBatchNorm
    original = sync_class.__dict__["convert_sync_batchnorm"]
    batch_norm = module._BatchNorm

    def convert_sync_batchnorm(cls: type, module: Any, process_group: Any = None) -> Any:
        """torch's classmethod, as bnsurgeon's exact conversion (children in place, the root returned)."""
        if not log.active:  # kept by the script after the run ended: torch's own, as under python
            return original.__func__(cls, module, process_group)
        return _sync(log, TORCH, module, process_group, batch_norm)

    functools.update_wrapper(convert_sync_batchnorm, original.__func__)
    sync_class.convert_sync_batchnorm = classmethod(convert_sync_batchnorm)
    undo_built = built.patch_sync_class(module, log)

    def undo() -> None:
        undo_built()
        sync_class.convert_sync_batchnorm = original

    return undo


def _patch_ddp(module: ModuleType, log: ConversionLog, fresh: bool) -> Callable[[], None]:
    return built.patch_ddp(module, log)


def _patch_compile_start(module: ModuleType, log: ConversionLog, fresh: bool) -> Callable[[], None]:
    return built.patch_compile_start(module, log)


def _batch_norm_class() -> type:
    from torch.nn.modules.batchnorm import _BatchNorm

    return _BatchNorm


def _patch_timm(module: ModuleType, log: ConversionLog, fresh: bool) -> Callable[[], None]:
    """timm's converter, and its ``freeze_batch_norm_2d``, which knows the act variant only as timm's class:
    bnsurgeon's would become torchvision's ``FrozenBatchNorm2d``, its activation dropped."""
    convert_original = module.convert_sync_batchnorm
    freeze_original = module.freeze_batch_norm_2d
    timm_sync_act = module.SyncBatchNormAct

    def convert_sync_batchnorm(module: Any, process_group: Any = None) -> Any:
        if not log.active:
            return convert_original(module, process_group)
        return _sync(log, TIMM, module, process_group, _batch_norm_class())

    def freeze_batch_norm_2d(module: Any) -> Any:
        if not log.active:
            return freeze_original(module)
        return freeze_original(_as_timm_layers(module, timm_sync_act))

    return _swap_functions(
        module,
        {"convert_sync_batchnorm": convert_sync_batchnorm, "freeze_batch_norm_2d": freeze_batch_norm_2d},
        fresh,
    )


def _swap_functions(home: ModuleType, replacements: dict[str, Callable], fresh: bool) -> Callable[[], None]:
    """``swap_function`` for each name, in order; the undo puts them back in the reverse order."""
    undos = [swap_function(home, name, replacement, fresh=fresh) for name, replacement in replacements.items()]

    def undo() -> None:
        for step in reversed(undos):
            step()

    return undo


def _patch_lightning(module: ModuleType, log: ConversionLog, fresh: bool) -> Callable[[], None]:
    """Lightning's apply calls torch's classmethod (replaced above); its revert would rebuild every
    SyncBatchNorm, bnsurgeon's act variant included, as a dimension-less ``_BatchNormXd``."""
    cls = module.TorchSyncBatchNorm
    original = cls.__dict__["revert"]

    def revert(self: Any, model: Any) -> Any:
        if _passing_through() or not log.active:
            return original(self, model)
        model = _plain(log, LIGHTNING_REVERT, model)
        with _pass_through():
            return original(self, model)

    functools.update_wrapper(revert, original)
    cls.revert = revert
    return lambda: setattr(cls, "revert", original)


def _patch_mmengine(module: ModuleType, log: ConversionLog, fresh: bool) -> Callable[[], None]:
    convert_original = module.convert_sync_batchnorm
    revert_original = module.revert_sync_batchnorm

    def convert_sync_batchnorm(module: Any, implementation: str = "torch") -> Any:
        if implementation != "torch" or not log.active:  # mmcv's: a CUDA op of its own, left to mmengine
            return convert_original(module, implementation)
        return _sync(log, MMENGINE, module, None, _batch_norm_class())

    def revert_sync_batchnorm(module: Any) -> Any:
        if _passing_through() or not log.active:
            return revert_original(module)
        module = _plain(log, MMENGINE_REVERT, module)
        with _pass_through():
            return revert_original(module)

    return _swap_functions(
        module,
        {"convert_sync_batchnorm": convert_sync_batchnorm, "revert_sync_batchnorm": revert_sync_batchnorm},
        fresh,
    )


#: module whose execution defines the converter -> how to replace it (given whether the module has just
#: executed; returns how to undo it)
PATCHES: dict[str, Callable[[ModuleType, ConversionLog, bool], Callable[[], None]]] = {
    "torch.nn.modules.batchnorm": _patch_torch,
    "torch.nn.parallel.distributed": _patch_ddp,
    "torch._dynamo": _patch_compile_start,
    "timm.layers.norm_act": _patch_timm,
    "lightning.pytorch.plugins.layer_sync": _patch_lightning,
    "pytorch_lightning.plugins.layer_sync": _patch_lightning,
    "mmengine.model.utils": _patch_mmengine,
}


def install(log: ConversionLog) -> Callable[[], None]:
    """Every converter in ``PATCHES`` replaced from now on (those already imported at once, the others
    when imported); returns the function that restores them all."""
    undo: list[Callable[[], None]] = []
    done: set[str] = set()

    def patch(name: str, module: ModuleType, fresh: bool = True) -> None:
        if name not in done:
            done.add(name)
            undo.append(PATCHES[name](module, log, fresh))

    stop_watching = after_import(list(PATCHES), patch, already=functools.partial(patch, fresh=False))

    def restore() -> None:
        log.active = False  # a replacement the script kept (in a dict, a closure) is the original from now on
        stop_watching()
        for step in reversed(undo):
            step()

    return restore


@contextlib.contextmanager
def patched_converters(log: ConversionLog) -> Iterator[ConversionLog]:
    """Every converter in ``PATCHES`` replaced while the block runs; all restored afterwards."""
    restore = install(log)
    try:
        yield log
    finally:
        restore()
