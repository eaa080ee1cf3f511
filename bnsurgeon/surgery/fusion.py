"""The ``fused`` target: which BN can be folded into the conv/linear that feeds it, and the fold.

A fold is exact (in exact arithmetic) only when the BN's input IS the producer's output,
nothing else reads that output, and nothing else reads the producer's weights. Both are
read from the real dataflow, never from module order:

- forward hooks + a TorchFunctionMode on one eval run of the check input: every module
  call and every torch function that touches the producer's output tensor object (or
  its weight/bias) is recorded, so an in-place add, a second branch, or a returned
  feature map counts as a second consumer;
- ``torch.fx`` (BN and conv/linear as leaves) when the model is traceable: the graph must
  agree (the producer node has the BN as its only user, each called once). Without a graph,
  the hooks run is one path: a value read into Python (``if x.mean() > 0``) before the
  producer ran, or while its output was alive, may have chosen it, so that BN stays.

A BN is folded only where every available method agrees; everything else stays, with the
reason. The fold itself is computed in float64 and cast back.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from bnsurgeon.core.anatomy import qualname
from bnsurgeon.core.errors import CheckpointError, HookedModelError, UsageError
from bnsurgeon.core.layout import counted, shown
from bnsurgeon.core.module_copy import BACKWARD_HOOKS, FORWARD_HOOKS, STATE_DICT_HOOKS, hook_kinds
from bnsurgeon.rules.fold import is_mixed_conv, out_features, producer_types

if TYPE_CHECKING:
    import torch
    from torch import nn

#: tensor attribute reads that do not consume values (shape checks in forward are fine)
_METADATA = frozenset(
    {
        "shape",
        "size",
        "dim",
        "ndim",
        "ndimension",
        "dtype",
        "device",
        "is_contiguous",
        "stride",
        "numel",
        "is_floating_point",
        "layout",
        "requires_grad",
        "is_cuda",
        "is_meta",
        "element_size",
        "is_complex",
        "names",
    }
)


def batched_rank(module: "nn.Module") -> int:
    """Rank of the producer's batched output; only there is dim 1 its channel dim."""
    from torch import nn

    if isinstance(module, nn.Linear):
        return 2
    if is_mixed_conv(module):
        return 4
    return 2 + len(getattr(module, "kernel_size"))  # noqa: B009  (typed: Module.__getattr__ is Tensor | Module)


@dataclass
class Fold:
    """One BN (by path) folded into its producer (by path); classes recorded for load-time validation."""

    bn: str
    producer: str
    bn_class: str = ""
    producer_class: str = ""

    def to_dict(self) -> dict[str, str]:
        return {
            "bn": self.bn,
            "producer": self.producer,
            "bn_class": self.bn_class,
            "producer_class": self.producer_class,
        }


@dataclass
class FoldPlan:
    """Which BN modules fold into which producer, and why the others stay."""

    folds: list[Fold] = field(default_factory=list)
    left: dict[str, str] = field(default_factory=dict)
    method: str = ""

    def fold_for(self, bn_path: str) -> Fold | None:
        return next((f for f in self.folds if f.bn == bn_path), None)

    def prepare(self, context: Any, model: "nn.Module", bn_path: str, rule: Any) -> None:
        """Tell one BN's builder its producer, or why it has none."""
        fold = self.fold_for(bn_path)
        if "fused" not in rule.targets:
            context.kept_reason = f"rule {rule.name!r} has no fused builder"
        elif fold is None:
            context.fold_reason = self.left.get(bn_path, "not folded when the checkpoint was written")
        else:
            context.producer = model.get_submodule(fold.producer)

    def summary(self, report: Any) -> dict[str, Any]:
        """For the report and the checkpoint: the folds that happened and the reason for each BN left."""
        done = {change.path for change in report.changed}
        folded = [f.to_dict() for f in self.folds if f.bn in done]
        left = {kept.path: kept.reason for kept in report.kept}
        return {
            "method": self.method,
            "folded": folded,
            "left": left,
            "bn_before": len(report.changed) + len(report.kept) + len(report.unhandled),
            "bn_after": len(report.kept) + len(report.unhandled),
        }


def fusion_plan(model: "nn.Module", example: Any, records: Any) -> FoldPlan:
    """The fold plan: from a checkpoint's records (validated), else discovered on ``example``."""
    if records is not None:
        return plan_from_records(model, records)
    if example is None:
        raise UsageError(
            "--to fused needs an example input to find which layer feeds each BatchNorm",
            "pass example_input= (a tensor or an input shape such as (2, 3, 64, 64))",
        )
    return plan_folds(model, example_tensor(model, example))


# --------------------------------------------------------------------------- discovery


def _tensors_in(value: Any) -> list["torch.Tensor"]:
    import torch
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _func_name(func: Any) -> str:
    owner = getattr(func, "__self__", None)
    return getattr(owner, "__name__", None) or getattr(func, "__name__", "") or ""


#: tensor -> Python value conversions: the forward may branch on them, so the rest of the run is one
#: path of several (torch.fx cannot trace such a forward; the hooks run sees only the path taken)
_VALUE_READS = frozenset(
    {
        "__bool__",
        "item",
        "tolist",
        "__int__",
        "__float__",
        "__index__",
        "__complex__",
        "numpy",
        "__array__",
        "__contains__",
        "equal",
        "allclose",
        "is_nonzero",
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "unique_consecutive",
    }
)


@dataclass
class _Observed:
    """What one instrumented eval run saw."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ranks: dict[str, int] = field(default_factory=dict)  # producer path -> rank of its output
    produced_at: dict[str, int] = field(default_factory=dict)  # producer path -> id of its (first) call
    bn_source: dict[str, str | None] = field(default_factory=dict)  # bn path -> producer whose output it read
    bn_single_input: dict[str, bool] = field(default_factory=dict)  # bn path -> called with one positional arg
    bn_call: dict[str, int] = field(default_factory=dict)  # bn path -> id of its (first) call
    bn_ancestors: dict[str, frozenset] = field(default_factory=dict)  # bn path -> ids of the calls it runs inside
    #: producer path -> (what, call ids on the stack, id of the consuming module's call or None for an op)
    uses: dict[str, list[tuple[str, frozenset, int | None]]] = field(default_factory=lambda: defaultdict(list))
    weight_reads: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    hooked_calls: set[int] = field(default_factory=set)  # ids of calls of modules with forward or backward hooks
    first_value_read: tuple[int, str] | None = None  # (calls started before it, op) of the first value read
    value_read_while_alive: dict[str, str] = field(default_factory=dict)  # producer path -> op read meanwhile
    #: producers whose output something still holds once the forward has returned (stashed on a module, ...)
    held_after: set[str] = field(default_factory=set)


@contextmanager
def compiled_wrappers_bypassed(model: "nn.Module") -> Iterator[None]:
    """Each ``torch.compile`` wrapper in ``model`` runs its original module eagerly while the hooks watch: dynamo
    runs graph modules of its own, so the hooks of the modules it compiled fire from its copies (torch 2.4: the
    observation then failed with a KeyError, or saw no BN called), or not at all. Put back afterwards."""
    import sys

    wrappers = []
    if "torch._dynamo" in sys.modules:  # nothing was compiled in a process that never imported dynamo
        from torch._dynamo.eval_frame import OptimizedModule

        wrappers = [module for module in model.modules() if isinstance(module, OptimizedModule)]
    saved = [(wrapper, wrapper.__dict__.get("forward")) for wrapper in wrappers]
    for wrapper in wrappers:
        wrapper.__dict__["forward"] = wrapper._orig_mod.__call__  # the wrapper's own forward is an instance attribute
    try:
        yield
    finally:
        for wrapper, forward in saved:
            if forward is None:
                wrapper.__dict__.pop("forward", None)
            else:
                wrapper.__dict__["forward"] = forward


def observe(model: "nn.Module", example: "torch.Tensor", bn_paths: dict[int, str]) -> _Observed:
    """One eval forward recording who produces, who consumes and who reads what (see module doc).

    Producer outputs are watched through weak references: once nothing holds an output, no
    later code can consume it, so a value read after that cannot change where it went.
    """
    import weakref

    import torch
    from torch.overrides import TorchFunctionMode

    from bnsurgeon.core.running import run_forward

    producers = producer_types()
    paths: dict[int, str] = {}
    for path, module in model.named_modules():
        paths.setdefault(id(module), path or "<root>")
    seen = _Observed()
    stack: list[tuple[int, str]] = []  # (call id, path) of module calls in progress
    counter = [0]
    watched: dict[int, tuple[str, Any]] = {}  # id(output tensor) -> (producer path, weak reference to it)
    params: dict[int, str] = {}
    hooked = {id(m) for m in model.modules() if hook_kinds(m, FORWARD_HOOKS + BACKWARD_HOOKS)}  # the user's, not ours
    #: modules whose hooks see what they return (forward hooks, and backward hooks: the gradient at the output)
    sees_output = {id(m) for m in model.modules() if hook_kinds(m, ("_forward_hooks",) + BACKWARD_HOOKS)}
    for module in model.modules():
        if type(module) in producers:
            for tensor in module._parameters.values():
                if tensor is not None:
                    params[id(tensor)] = paths[id(module)]

    def producer_of(tensor) -> str | None:
        entry = watched.get(id(tensor))
        return entry[0] if entry is not None and entry[1]() is tensor else None

    def use(tensors, what: str, exclude_top: bool) -> None:
        frames = stack[:-1] if exclude_top else stack
        on_stack = frozenset(call for call, _ in frames)
        consumer = stack[-1][0] if exclude_top and stack else None
        for tensor in tensors:
            source = producer_of(tensor)
            if source is not None:
                seen.uses[source].append((what, on_stack, consumer))

    def pre_hook(module, args, kwargs):
        counter[0] += 1
        path = paths[id(module)]
        stack.append((counter[0], path))
        seen.calls[path] += 1
        if id(module) in hooked:
            seen.hooked_calls.add(counter[0])
        if id(module) in bn_paths and path not in seen.bn_call:
            seen.bn_call[path] = counter[0]
            seen.bn_ancestors[path] = frozenset(call for call, _ in stack[:-1])
            seen.bn_single_input[path] = len(args) == 1 and not kwargs
            seen.bn_source[path] = producer_of(args[0]) if args else None
        use(_tensors_in((args, kwargs)), f"module {path}", exclude_top=True)

    def post_hook(module, args, kwargs, output):
        call, path = stack.pop() if stack else (0, paths[id(module)])
        if type(module) in producers and isinstance(output, torch.Tensor):
            seen.ranks[path] = output.dim()
            seen.produced_at.setdefault(path, call)
            watched[id(output)] = (path, weakref.ref(output))
        elif id(module) in sees_output:  # a wrapper returning the producer's output: folded, its hooks see the BN's
            for tensor in _tensors_in(output):
                source = producer_of(tensor)
                if source is not None:
                    seen.uses[source].append((f"module {path} returns it (with hooks)", frozenset(), None))

    def value_read(name: str) -> None:
        if seen.first_value_read is None:
            seen.first_value_read = (counter[0], name)
        for source, ref in list(watched.values()):
            if ref() is not None:
                seen.value_read_while_alive.setdefault(source, name)

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = _func_name(func)
            if name in _VALUE_READS:
                value_read(name)
            if name not in _METADATA:
                tensors = _tensors_in((args, kwargs))
                use(tensors, f"op {name}", exclude_top=False)
                inside = {p for _, p in stack}
                for tensor in tensors:
                    owner = params.get(id(tensor))
                    if owner is not None and owner not in inside:
                        seen.weight_reads[owner].append(name)
            return func(*args, **kwargs)

    handles = []
    for module in {id(m): m for m in model.modules()}.values():
        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(post_hook, with_kwargs=True, always_call=True))
    try:
        with torch.no_grad(), Recorder(), compiled_wrappers_bypassed(model):
            outputs = run_forward(model, example, "the source model")
    finally:
        for handle in handles:
            handle.remove()
    use(_tensors_in(outputs), "the model's output", exclude_top=False)
    seen.held_after = {source for source, ref in watched.values() if ref() is not None}
    return seen


def _hook_reason(seen: _Observed, bn_path: str, producer_path: str | None, *, hooks_only: bool) -> str | None:
    """None when the hooks run proves the BN reads exactly its producer's output, and nothing else does.

    ``hooks_only``: no fx graph vouches for the other paths of the forward, so a value read
    before the producer ran, or while its output was still held, leaves the BN as it is.
    """
    if seen.calls.get(bn_path, 0) == 0:
        return "not called in eval mode on the check input (a train-only or unused path)"
    if seen.calls[bn_path] > 1:
        return f"called {seen.calls[bn_path]} times per forward (one fold cannot serve several inputs)"
    if not seen.bn_single_input[bn_path]:
        return "called with more than one argument"
    source = seen.bn_source[bn_path]
    if source is None:
        return "its input is not the output of a Conv1d/2d/3d, ConvTranspose or Linear (e.g. pre-activation BN)"
    if producer_path is not None and source != producer_path:
        return f"hooks and torch.fx disagree on its producer ({source} vs {producer_path})"
    if seen.calls[source] > 1:
        return f"its producer {source} is called {seen.calls[source]} times per forward"
    ancestors = seen.bn_ancestors[bn_path]
    direct, others = 0, []
    for what, on_stack, consumer in seen.uses.get(source, []):
        if what == f"module {bn_path}":
            direct += 1
        elif seen.bn_call[bn_path] in on_stack:
            continue  # inside the BN's own call: its own F.batch_norm
        elif consumer in ancestors and consumer not in seen.hooked_calls:
            continue  # a container the BN runs inside, handing the tensor on (its uses are recorded themselves)
        else:
            others.append(what + (" (with hooks)" if consumer in seen.hooked_calls else ""))
    if others:  # listed, not counted: a container and the module inside it are two uses of one hand-over
        return f"its producer {source} feeds other consumers besides it ({', '.join(sorted(set(others)))[:120]})"
    if direct != 1:
        return f"its producer {source} feeds it {counted(direct, 'time')} (one fold needs exactly one)"
    reads = [
        op
        for owner, ops in seen.weight_reads.items()
        if owner == source or owner.startswith(source + ".")
        for op in ops
    ]
    if reads:
        return f"the weights of {source} are also read outside its forward ({', '.join(sorted(set(reads)))[:80]})"
    if source in seen.held_after:
        return (
            f"the output of {source} is still held after the forward (stored on a module or elsewhere), "
            "which would then hold the folded values"
        )
    if hooks_only:
        first = seen.first_value_read
        if first is not None and first[0] < seen.produced_at[source]:
            return (
                f"the forward reads tensor values into Python ({first[1]}) before its producer {source} runs: "
                "a value-dependent path torch.fx could not trace, and the hooks saw only the path taken"
            )
        if source in seen.value_read_while_alive:
            return (
                f"the forward reads tensor values into Python ({seen.value_read_while_alive[source]}) while "
                f"the output of {source} is still held: a value-dependent path torch.fx could not trace, and "
                "the hooks saw only the path taken"
            )
    return None


def _fx_plan(
    model: "nn.Module", bn_modules: dict[int, str]
) -> tuple[dict[str, tuple[str | None, str | None]] | None, str]:
    """bn path -> (producer path or None, reason or None) from a torch.fx trace; None when untraceable."""
    import torch.fx as fx

    from bnsurgeon.core.anatomy import is_bn_like

    producers = producer_types()

    class LeafTracer(fx.Tracer):
        def is_leaf_module(self, module, qualified_name):
            return type(module) in producers or is_bn_like(module) or super().is_leaf_module(module, qualified_name)

    try:
        with warnings.catch_warnings():  # a module's backward hooks cannot run on a Proxy: said by torch, not news
            warnings.filterwarnings("ignore", message="For backward hooks to be called")
            graph = LeafTracer().trace(model)
    except Exception as error:  # control flow on values, unsupported Python: use the hooks run alone
        return None, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:160]
    modules = dict(model.named_modules())
    calls: dict[str, int] = defaultdict(int)
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] += 1
    read_attrs = {node.target for node in graph.nodes if node.op == "get_attr"}
    result: dict[str, tuple[str | None, str | None]] = {}
    bn_paths = set(bn_modules.values())
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in bn_paths:
            continue
        path = node.target
        if calls[path] > 1:
            result[path] = (None, f"called {calls[path]} times in the traced graph")
            continue
        source = node.args[0] if len(node.args) == 1 and not node.kwargs else None
        if (
            source is None
            or getattr(source, "op", None) != "call_module"
            or type(modules.get(source.target)) not in producers
        ):
            called = modules.get(source.target) if source is not None and source.op == "call_module" else None
            result[path] = (None, _not_a_producer(called, getattr(source, "target", None), producers))
            continue
        producer = source.target
        if calls[producer] > 1:
            result[path] = (None, f"its producer {producer} is called {calls[producer]} times in the traced graph")
        elif len(source.users) != 1:
            users = ", ".join(str(u.target) for u in source.users)[:120]
            result[path] = (None, f"its producer {producer} feeds {len(source.users)} consumers ({users})")
        elif any(a.startswith(producer + ".") for a in read_attrs):
            result[path] = (None, f"the weights of {producer} are also read directly in forward")
        else:
            result[path] = (producer, None)
    return result, ""


def _not_a_producer(module: "nn.Module | None", target: str | None, producers: tuple) -> str:
    """Why the module feeding a BN is not a producer: named where it is a conv/linear in disguise."""
    from torch.nn.utils import parametrize

    if module is not None and parametrize.is_parametrized(module):
        return (
            f"its producer {target} has parametrized weights (torch.nn.utils.parametrize), which a fold cannot change"
        )
    if module is not None and isinstance(module, producers):
        return (
            f"its producer {target} is a {qualname(type(module))}, a subclass whose forward bnsurgeon "
            f"does not know (folds go into Conv1d/2d/3d, ConvTranspose, Linear and known subclasses)"
        )
    return "its input is not the output of a Conv1d/2d/3d, ConvTranspose or Linear (e.g. pre-activation BN)"


def plan_folds(model: "nn.Module", example: "torch.Tensor", *, use_fx: bool = True) -> FoldPlan:
    """Find, for every BN-like module of ``model``, its producer or the reason it has none (eval mode)."""
    from bnsurgeon.core.anatomy import is_bn_like

    bn_modules: dict[int, str] = {}
    for path, module in model.named_modules():
        if is_bn_like(module):
            bn_modules.setdefault(id(module), path or "<root>")
    saved = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        seen = observe(model, example, bn_modules)
        fx_result, fx_error = _fx_plan(model, bn_modules) if use_fx else (None, "torch.fx not tried")
    finally:
        for module, training in saved:
            module.training = training
    plan = FoldPlan(
        method="torch.fx graph + hooks on the check input"
        if fx_result is not None
        else f"hooks on the check input (not traceable by torch.fx: {fx_error})"
    )
    modules = dict(model.named_modules())
    global_hooks = global_hook_reason()
    for path in bn_modules.values():
        module = modules[path] if path != "<root>" else model
        producer_path, reason = (None, None)
        if fx_result is not None:
            producer_path, reason = fx_result.get(
                path, (None, "not called in eval mode (absent from the traced graph: a train-only or unused path)")
            )
        reason = (
            bn_hook_reason(module) or reason or _hook_reason(seen, path, producer_path, hooks_only=fx_result is None)
        )
        if reason is None:
            producer = producer_path or seen.bn_source[path]
            assert producer is not None, f"{path}: no producer and no reason"  # the hooks saw every BN's source
            reason = _static_reason(module, modules[producer], seen.ranks.get(producer)) or global_hooks
            if reason is None:
                plan.folds.append(Fold(path, producer, qualname(type(module)), qualname(type(modules[producer]))))
                continue
        plan.left[path] = reason
    return plan


def _static_reason(bn: "nn.Module", producer: "nn.Module", rank: int | None) -> str | None:
    """Checks that need no dataflow: channel axis, eval semantics, hooks that would see different values."""
    return _shape_reason(bn, producer, rank) or producer_hook_reason(producer) or bn_hook_reason(bn)


def _shape_reason(bn: "nn.Module", producer: "nn.Module", rank: int | None) -> str | None:
    """Whether the BN's eval transform is a per-output-channel affine map of the producer's output."""
    from torch import nn

    features = getattr(bn, "num_features", None)
    running = bn._buffers.get("running_mean")
    if running is None or bn._buffers.get("running_var") is None:
        return "no running statistics: in eval it normalizes with batch statistics, which no weight can hold"
    if features is None:
        features = running.shape[0]
    if int(features) != out_features(producer):
        return f"{features} features but its producer has {out_features(producer)} output channels"
    if rank != batched_rank(producer):
        if isinstance(producer, nn.Linear):
            return f"its Linear producer outputs rank {rank}: BatchNorm normalizes dim 1, not the Linear's features"
        return f"its producer's output has rank {rank} (unbatched): dim 1 is not the channel dim"
    return None


_HOOK_NAMES = {
    "_forward_pre_hooks": "forward pre-hooks",
    "_forward_hooks": "forward hooks",
    "_backward_pre_hooks": "backward pre-hooks",
    "_backward_hooks": "backward hooks",
    "_state_dict_hooks": "state_dict hooks",
    "_state_dict_pre_hooks": "state_dict pre-hooks",
    "_load_state_dict_pre_hooks": "load_state_dict pre-hooks",
    "_load_state_dict_post_hooks": "load_state_dict post-hooks",
}


def _named(kinds: list[str]) -> str:
    names = [_HOOK_NAMES[kind] for kind in kinds]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def producer_hook_reason(producer: "nn.Module") -> str | None:
    """Forward hooks on the producer (or inside it) would see the folded output; backward hooks
    the gradient of the BN's output instead of the producer's. Its state_dict hooks still see
    its own (folded) weights under its own keys, so they do not stop a fold."""
    kinds = sorted(
        {kind for module in producer.modules() for kind in hook_kinds(module, FORWARD_HOOKS + BACKWARD_HOOKS)},
        key=list(_HOOK_NAMES).index,
    )
    if kinds:
        return f"its producer has {_named(kinds)}, which would see the folded weights, output or gradients"
    return _parameter_hook_reason(producer, "its producer")


def _parameter_hook_reason(module: "nn.Module", who: str) -> str | None:
    """Tensor hooks on a weight or bias (``register_hook``, ``register_post_accumulate_grad_hook``) stay on
    the old Parameter: the fold makes new ones, so they would silently stop running."""
    for name, parameter in module.named_parameters():
        if parameter is not None and (
            getattr(parameter, "_backward_hooks", None) or getattr(parameter, "_post_accumulate_grad_hooks", None)
        ):
            return (
                f"{who}'s parameter {name} has tensor hooks (register_hook or register_post_accumulate_grad_hook), "
                "which the folded Parameters would not carry"
            )
    return None


def bn_hook_reason(bn: "nn.Module") -> str | None:
    """A hook on the BN would, after a fold, run on what takes its place: forward and backward
    hooks would see the folded values, state_dict and load hooks would find no BatchNorm keys.
    The hook is the reason, whatever the dataflow says."""
    kinds = hook_kinds(bn, FORWARD_HOOKS[::-1] + BACKWARD_HOOKS[::-1] + STATE_DICT_HOOKS)
    if kinds:
        return (
            f"it has {_named(kinds)}, which would run on what replaces it (the folded input and gradients, "
            "no BatchNorm state or keys)"
        )
    return _parameter_hook_reason(bn, "the BN")


@dataclass
class _HookedModule:
    path: str
    kinds: list[str]
    inside: set[int]  # ids of the module and everything below it


def _hooked_modules(model: "nn.Module") -> list[_HookedModule]:
    """Every module with forward or backward hooks, found once per plan (not once per fold)."""
    return [
        _HookedModule(path or "<root>", kinds, {id(m) for m in module.modules()})
        for path, module in model.named_modules()
        if (kinds := hook_kinds(module, FORWARD_HOOKS + BACKWARD_HOOKS))
    ]


def _wrapper_hook_reason(hooked: list[_HookedModule], bn: "nn.Module", producer: "nn.Module") -> str | None:
    """Loading has no dataflow to consult: a hooked module around the producer or the BN but not both
    may see the producer's output (returned, or handed on), so it refuses the fold. A block holding
    the whole pair sees the same values either way."""
    for module in hooked:
        if (id(bn) in module.inside) != (id(producer) in module.inside):
            holds = "the BN" if id(bn) in module.inside else "the producer"
            return (
                f"{module.path} holds {holds} but not the other and has {_named(module.kinds)}, which may see "
                "the producer's output (folded: the BN's)"
            )
    return None


def global_hook_reason() -> str | None:
    """Global module hooks run on every module's call, so, like a hook on one BN or producer, they
    would see folded outputs or gradients and BNs that are gone. Named as registered."""
    from torch.nn.modules import module as torch_module

    registered = [
        name
        for name, registry in (
            ("register_module_forward_pre_hook", "_global_forward_pre_hooks"),
            ("register_module_forward_hook", "_global_forward_hooks"),
            ("register_module_full_backward_pre_hook", "_global_backward_pre_hooks"),
            ("register_module_full_backward_hook or register_module_backward_hook", "_global_backward_hooks"),
        )
        if getattr(torch_module, registry, None)
    ]
    if not registered:
        return None
    kinds = " and ".join(kind for kind in ("forward", "backward") if any(f"_{kind}" in name for name in registered))
    return (
        f"global module {kinds} hooks are registered ({'; '.join(registered)}), which would see the folded "
        "outputs or gradients and no BatchNorm; remove them to fold"
    )


def plan_from_records(model: "nn.Module", records: Any) -> FoldPlan:
    """A FoldPlan from a checkpoint's recorded folds, each validated against ``model`` (untrusted data)."""
    from bnsurgeon.core.anatomy import is_bn_like

    def bad(what: str) -> CheckpointError:
        return CheckpointError(
            f"recorded fold {what}",
            "the file's bnsurgeon.folds metadata does not fit the "
            "architecture; re-create it with bnsurgeon convert --to fused",
        )

    if not isinstance(records, list):
        raise bad(f"list is a {type(records).__name__}, not a list")
    plan = FoldPlan(method="recorded in the checkpoint")
    modules = dict(model.named_modules())
    wrappers = _hooked_modules(model)
    used: set[str] = set()
    for record in records:
        keys = ("bn", "producer", "bn_class", "producer_class")
        if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in keys):
            raise bad(f"{shown(record)} is not a record with string fields {', '.join(keys)}")
        fold = Fold(*(record[k] for k in keys))
        bn, producer = modules.get(fold.bn), modules.get(fold.producer)
        if bn is None or producer is None:
            raise bad(f"{fold.bn} -> {fold.producer}: no such module path in the model")
        if fold.bn in used or fold.producer in used or fold.bn == fold.producer:
            raise bad(f"{fold.bn} -> {fold.producer}: a module appears in more than one fold")
        used.update((fold.bn, fold.producer))
        if not is_bn_like(bn):
            raise bad(f"{fold.bn}: the model has {qualname(type(bn))} there, not a BatchNorm-family module")
        if qualname(type(bn)) != fold.bn_class:
            raise bad(f"{fold.bn}: the model has {qualname(type(bn))} there, the file says {fold.bn_class}")
        if type(producer) not in producer_types() or qualname(type(producer)) != fold.producer_class:
            raise bad(
                f"{fold.producer}: the model has {qualname(type(producer))} there, the file says "
                f"{fold.producer_class} (must be a Conv/ConvTranspose/Linear)"
            )
        reason = _shape_reason(bn, producer, batched_rank(producer))
        if reason is not None:
            raise bad(f"{fold.bn} -> {fold.producer}: {reason}")
        hooked = producer_hook_reason(producer) or bn_hook_reason(bn) or _wrapper_hook_reason(wrappers, bn, producer)
        if hooked is not None:
            raise HookedModelError(
                f"cannot load the fused file into this model: {fold.bn} -> {fold.producer}: {hooked}"
            )
        plan.folds.append(fold)
    global_hooks = global_hook_reason()
    if plan.folds and global_hooks is not None:
        raise HookedModelError(f"cannot load the fused file: {global_hooks}")
    return plan


def example_tensor(model: "nn.Module", example: "torch.Tensor | tuple[int, ...]", seed: int = 0) -> "torch.Tensor":
    import torch

    if isinstance(example, torch.Tensor):
        return example
    if not isinstance(example, (tuple, list)) or not all(isinstance(s, int) and s > 0 for s in example):
        raise UsageError(
            f"example_input {shown(example)} is neither a tensor nor an input shape", "pass e.g. (2, 3, 64, 64)"
        )
    reference = next(iter(model.parameters()), None)
    dtype = reference.dtype if reference is not None and reference.is_floating_point() else torch.float32
    device = reference.device if reference is not None else torch.device("cpu")
    return torch.randn(tuple(example), generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)
