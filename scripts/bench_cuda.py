"""GPU yardstick for the sync layer, in sections that each write one JSON file under ``--out``.

    python scripts/bench_cuda.py --out DIR [--sections layers graph compiled] [--dry-run]
    python scripts/bench_cuda.py --summarize DIR          (summary.json from the files there)

``scripts/gpu_checks.sh`` runs every section once, each in its own bounded process, plus the
CUDA tests, and then ``--summarize``. One process, a process group of ONE (NCCL on a GPU, gloo
in a dry run), and every sync layer forced onto its synchronized path: ``forced_world()``
makes ``torch.distributed.get_world_size`` answer a world-size check as if there were several
ranks while it still counts as 1 in every size computed from it, so torch's ``nn.SyncBatchNorm``
and bnsurgeon's layer take their sync paths through their own module code, eager and compiled.
Every timed sync path is checked to have run: its collectives are counted with the profiler,
and a section that timed a sync path which issued none fails loudly.

Sections:

``layers`` (layers.json): module against module, ``nn.BatchNorm`` (plain), torch's
``nn.SyncBatchNorm`` and bnsurgeon's ``SyncBatchNorm`` on the same tensors, forward + backward
with every ``.grad`` reset before each iteration, on (32,64,112,112), (32,256,28,28),
(64,512,7,7) each contiguous and channels_last, and (256,1024); in float32, under bf16 autocast
(a bf16 input, float32 layer) and as a ``.half()`` layer. Time per call: a round of
iterations between two device synchronizations, divided by its length; the median over rounds
that alternate the three layers. Per case the profiler's device kernels and collective
records of one forward + backward (the baseline: torch 30 / 2, bnsurgeon 41 / 4), and one more
call of both sync layers compared: output, input and parameter gradients, running statistics.
Ratios bnsurgeon/torch per case and their geometric mean per precision. Goal: <= 0.8.

``graph`` (graph_step.json): a whole resnet50 training step (batch 64, 224 px, channels_last,
SGD), float32 and bf16 autocast: plain BN and the sync model, each eager and captured in a
CUDA graph (warm-up on a side stream after ``torch.cuda.synchronize()``, ``.grad`` set to None
before capture, as torch's CUDA-graph docs do). The replayed step is checked against one eager
step of a twin model from the same state: loss, every parameter gradient, the updated
parameters and running statistics. Goal: captured sync step <= 1.2x the captured plain step.

``compiled`` (compiled.json): the sync model under ``torch.compile`` (inductor; bf16 autocast),
timed per step, with its collectives per step counted: a compiled step that issues none timed
the plain path, and the section fails.

``--dry-run``: the same code on CPU in seconds, so it cannot rot between GPU loans: the strict
stand-ins of the CUDA kernels (tests/_cuda_standin.py) route bnsurgeon's layer onto its device
path and torch's Function through the same stand-ins, gloo is the group of one, sizes are tiny
(a two-block convnet for resnet50) and iterations few, the CUDA graph is the stand-in device's
capture and replay (an eager replay where that capture cannot model an op, said in the file),
the compile backend is aot_eager, and what needs CUDA (device kernel counts) is recorded as
skipped with the reason. Its times say nothing about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("layers", "graph", "compiled")
PRECISIONS = ("float32", "bf16-autocast", "half-model")
LAYOUTS = ("contiguous", "channels_last")
GOAL_LAYER_GEOMEAN = 0.8  # bnsurgeon / torch's SyncBatchNorm, fwd+bwd, geomean over the shapes
GOAL_GRAPH_STEP = 1.2  # captured sync step / captured plain step
BASELINE_COUNTS = {
    "torch": {"kernels": 30, "collectives": 2},
    "bnsurgeon": {"kernels": 41, "collectives": 4},
    "measured": "one H200, torch 2.11.0+cu130, the project at d9576d4 (before the CUDA path was rewritten)",
}
NEEDS_CUDA = "needs CUDA: the profiler's device kernels exist only on a GPU (dry run on CPU)"


@dataclasses.dataclass(frozen=True)
class Config:
    shapes: tuple
    rounds: int  # timed rounds per layer and case, alternating the layers
    per_round: int  # iterations per round
    warmup: int
    model: str
    batch: int
    pixels: int
    model_rounds: int
    model_per_round: int
    model_warmup: int
    capture_warmup: int  # eager steps on a side stream before capture (torch's docs: 3)
    compile_backend: str
    grad_tolerance: dict  # precision -> largest relative gradient difference, replay against eager


GPU = Config(
    shapes=((32, 64, 112, 112), (32, 256, 28, 28), (64, 512, 7, 7), (256, 1024)),
    rounds=10,
    per_round=20,
    warmup=10,
    model="resnet50",
    batch=64,
    pixels=224,
    model_rounds=5,
    model_per_round=4,
    model_warmup=3,
    capture_warmup=3,
    compile_backend="inductor",
    grad_tolerance={"float32": 1e-3, "bf16-autocast": 3e-2},
)
DRY = Config(
    shapes=((4, 8, 6, 6), (16, 32)),  # one of each kind of case: the code paths, not the sizes
    rounds=1,
    per_round=1,
    warmup=0,
    model="tiny-convnet",
    batch=2,
    pixels=16,
    model_rounds=1,
    model_per_round=1,
    model_warmup=0,
    capture_warmup=1,
    compile_backend="aot_eager",
    grad_tolerance={"float32": 1e-5, "bf16-autocast": 1e-5},
)


# ---------------------------------------------------------------------------------------------
# the run: device, process group of one, forced sync paths


class Run:
    """Device, configuration and the helpers every section shares."""

    def __init__(self, dry_run: bool, out: Path) -> None:
        import torch

        self.dry_run = dry_run
        self.out = out
        self.cfg = DRY if dry_run else GPU
        self.cuda = not dry_run
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.device_type = self.device.type
        self.standin_device: Any = None  # dry run: the stand-in device tests/_cuda_standin.py yields
        #: the running section's file from what it measured so far (written if it is interrupted)
        self.finish: Callable[[], dict] = dict

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def describe(self) -> dict:
        from importlib.metadata import version

        import torch

        return {
            "mode": "dry-run" if self.dry_run else "gpu",
            "torch": torch.__version__,
            "timm": version("timm"),
            "device": torch.cuda.get_device_name(self.device) if self.cuda else "cpu (stand-in kernels)",
            "cuda": torch.version.cuda,
            "backend": "nccl" if self.cuda else "gloo",
            "commit": _git_commit(),
        }


def _git_commit() -> str:
    import subprocess

    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception:  # not a checkout
        return "unknown"


class _WorldOfOne(int):
    """1 in arithmetic, indexing and equality, "several ranks" to an ordering comparison.

    Every world-size check in torch's ``nn.SyncBatchNorm.forward`` and bnsurgeon's layer is an
    ordering comparison (``world_size > 1``, ``world_size <= 1``); every size computed from the
    world size (gather buffers, rows, ``range``) uses it as the int 1 it is. So both layers take
    their sync path, with its real collectives, in a process group of one.
    """

    def __gt__(self, other):
        return 2 > other

    def __ge__(self, other):
        return 2 >= other

    def __lt__(self, other):
        return 2 < other

    def __le__(self, other):
        return 2 <= other

    __hash__ = int.__hash__


def dynamo_takes_world_of_one() -> None:
    """Let dynamo hold ``_WorldOfOne`` as a constant (its comparisons then run at trace time). Before
    torch 2.14 dynamo refused int subclasses as constants ("Cannot construct ConstantVariable")."""
    from torch._dynamo import utils

    constant_types = getattr(utils, "common_constant_types", None)
    if isinstance(constant_types, set):
        constant_types.add(_WorldOfOne)


@contextlib.contextmanager
def forced_world():
    """``torch.distributed.get_world_size`` answers ``_WorldOfOne`` where the real size is 1."""
    import torch.distributed as dist

    real = dist.get_world_size

    def get_world_size(group=None):
        size = real(group) if group is not None else real()
        return _WorldOfOne(1) if size == 1 else size

    dist.get_world_size = get_world_size
    try:
        yield
    finally:
        dist.get_world_size = real


@contextlib.contextmanager
def torch_layer_accepts_cpu(run: Run):
    """Dry run only: torch's ``nn.SyncBatchNorm`` refuses CPU inputs before it syncs; let it through
    (its Function then runs on the stand-in kernels). Around that layer's call only: autocast and
    dynamo read the backend name too."""
    import torch

    if run.cuda:
        yield
        return
    real = torch._C._get_privateuse1_backend_name
    torch._C._get_privateuse1_backend_name = lambda: "cpu"
    try:
        yield
    finally:
        torch._C._get_privateuse1_backend_name = real


@contextlib.contextmanager
def process_group_of_one(run: Run):
    import torch
    import torch.distributed as dist

    if run.cuda:
        if not torch.cuda.is_available():
            sys.exit("bench_cuda.py needs a CUDA device (or --dry-run; the CPU yardstick is scripts/bench_runtime.py)")
        # torch's CUDA-graph docs, for NCCL collectives inside a captured step: no async error handling
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        torch.cuda.set_device(run.device)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=run.device)
        stand_ins: Any = contextlib.nullcontext()
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        sys.path.insert(0, str(ROOT / "tests"))
        import _cuda_standin

        stand_ins = _cuda_standin.installed()
    try:
        with stand_ins as device, forced_world():
            run.standin_device = device
            yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# measuring


def time_rounds(run: Run, fns: dict[str, Callable[[], object]], rounds: int, per_round: int, warmup: int) -> dict:
    """Median ms per call of each function: rounds alternate the functions, each round is
    ``per_round`` calls between two device synchronizations (the steady per-call cost, host- or
    device-bound alike)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    run.sync()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            run.sync()
            start = time.perf_counter()
            for _ in range(per_round):
                fn()
            run.sync()
            samples[name].append((time.perf_counter() - start) * 1000 / per_round)
    return {name: statistics.median(values) for name, values in samples.items()}


def profile_counts(run: Run, fn: Callable[[], object]) -> dict:
    """Device kernels and collective records of one call of ``fn`` (after one unprofiled call, so that
    first-call work is not counted, unless the run does no warm-up at all)."""
    import collections

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if run.cfg.warmup:
        fn()
        run.sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.cuda else [])
    with profile(activities=activities) as prof:
        fn()
        run.sync()
    events = prof.events()
    # one record per collective from the backend ("nccl:all_reduce", "gloo:all_gather", as the baseline
    # counted them); where a torch names its records otherwise, the c10d ops (one per collective) instead
    # (host-side events only: on a GPU the same names come back as annotations on the device timeline)
    host = [e.name for e in events if e.device_type == DeviceType.CPU]
    records = collections.Counter(name for name in host if name.startswith(("nccl:", "gloo:")))
    c10d = collections.Counter(name for name in host if name.startswith("c10d::"))
    counts: dict[str, Any] = {
        "collectives": sum(records.values()) or sum(c10d.values()),
        "collectives_from": "backend records" if records else "c10d ops",
        "collective_records": dict(sorted(records.items())),
        "c10d_ops": dict(sorted(c10d.items())),
    }
    if run.cuda:
        # device events: kernels, memcpy/memset, and annotations that repeat a host record's name
        host_names = set(host)
        device = [e.name for e in events if e.device_type == DeviceType.CUDA and e.name not in host_names]
        kernels = [name for name in device if not name.startswith(("Memcpy", "Memset"))]
        counts["kernels"] = len(kernels)
        counts["memcpy_memset"] = len(device) - len(kernels)
        counts["nccl_kernels"] = sum(1 for name in kernels if "nccl" in name.lower())
        counts["kernel_names"] = dict(sorted(collections.Counter(name[:120] for name in kernels).items()))
    else:
        counts["kernels"] = None
        counts["kernels_skipped"] = NEEDS_CUDA
    return counts


def geometric_mean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error).strip() else ''}"


def finite(value):
    """``value`` with every NaN or infinity as its name ("nan", "inf", "-inf"): strict JSON has none, and a section's
    file must still be written when a comparison found one (the H200 run of 772fc66 lost layers.json to a NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def write_json(run: Run, name: str, payload: dict) -> Path:
    run.out.mkdir(parents=True, exist_ok=True)
    path = run.out / name
    payload = {"section": name.removesuffix(".json"), **run.describe(), **payload}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(finite(payload), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


# ---------------------------------------------------------------------------------------------
# layers


def _layers_for(run: Run, channels: int, rank: int, precision: str):
    from torch import nn

    from bnsurgeon.runtime.layers import SyncBatchNorm

    plain = (nn.BatchNorm1d if rank == 2 else nn.BatchNorm2d)(channels)
    layers = {"plain": plain, "torch": nn.SyncBatchNorm(channels), "bnsurgeon": SyncBatchNorm(channels)}
    for layer in layers.values():
        layer.to(run.device).train()
        if precision == "half-model":
            layer.half()
    return layers


def layer_case(run: Run, shape: tuple, layout: str, precision: str) -> dict:
    import torch

    dtype = {"float32": torch.float32, "bf16-autocast": torch.bfloat16, "half-model": torch.float16}[precision]
    layers = _layers_for(run, shape[1], len(shape), precision)
    x = torch.randn(shape, device=run.device).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    grads = {dtype: torch.randn_like(x)}

    def call(layer):
        accepts = torch_layer_accepts_cpu if layer is layers["torch"] else contextlib.nullcontext

        def fn():
            x.grad = None
            layer.zero_grad(set_to_none=True)
            with torch.autocast(run.device_type, dtype=torch.bfloat16, enabled=precision == "bf16-autocast"):
                with accepts(run):
                    y = layer(x)
            grad = grads.get(y.dtype)
            if grad is None:
                grad = grads[y.dtype] = grads[dtype].to(y.dtype)
            y.backward(grad)
            return y

        return fn

    fns = {name: call(layer) for name, layer in layers.items()}
    failed = {}
    for name, fn in list(fns.items()):  # a reference layer that fails here is reported, and the case goes on
        try:
            fn()
            run.sync()
        except Exception as error:
            if name == "bnsurgeon":
                raise
            failed[name] = _error(error)
            del fns[name]
    cfg = run.cfg
    ms: dict[str, Any] = {name: None for name in layers} | time_rounds(run, fns, cfg.rounds, cfg.per_round, cfg.warmup)
    counts = {name: profile_counts(run, fn) for name, fn in fns.items()}
    synced = {name: counts[name]["collectives"] >= 2 for name in ("torch", "bnsurgeon") if name in counts}
    agreement = _agreement(run, fns, layers, x, precision) if "torch" in fns else None

    def ratio(a: str, b: str):
        return ms[a] / ms[b] if ms[a] is not None and ms[b] is not None else None

    case = {
        "precision": precision,
        "shape": list(shape),
        "layout": layout,
        "ms": ms,
        "ratio_bnsurgeon_torch": ratio("bnsurgeon", "torch"),
        "ratio_bnsurgeon_plain": ratio("bnsurgeon", "plain"),
        "ratio_torch_plain": ratio("torch", "plain"),
        "counts": counts,
        "synced": synced,
        "agreement_with_torch": agreement,
    }
    if failed:
        case["failed"] = failed
    return case


#: largest relative difference between bnsurgeon's layer and torch's on the same tensors
AGREEMENT_TOLERANCE = {"float32": 1e-4, "bf16-autocast": 2e-2, "half-model": 5e-3}


def _agreement(run: Run, fns: dict, layers: dict, x, precision: str) -> dict:
    """One more forward + backward of torch's layer and of bnsurgeon's: output, input gradient, parameter
    gradients, and the running statistics both layers reached over the same number of calls."""
    results = {}
    for name in ("torch", "bnsurgeon"):
        y = fns[name]()
        layer = layers[name]
        results[name] = {
            "output": y.detach(),
            "input_grad": x.grad.detach().clone(),
            "weight_grad": layer.weight.grad.detach().clone(),
            "bias_grad": layer.bias.grad.detach().clone(),
            "running_mean": layer.running_mean.detach().clone(),
            "running_var": layer.running_var.detach().clone(),
        }
    run.sync()
    differences = {key: _relative(results["bnsurgeon"][key], value) for key, value in results["torch"].items()}
    tolerance = AGREEMENT_TOLERANCE[precision]
    return {**differences, "tolerance": tolerance, "ok": max(differences.values()) <= tolerance}


def _shown(value, spec: str = "8.3f") -> str:
    return "n/a" if value is None else format(value, spec)


def section_layers(run: Run) -> dict:
    cases: list[dict] = []
    errors: list[dict] = []
    run.finish = lambda: _layers_result(run, cases, errors)
    for precision in PRECISIONS:
        for shape in run.cfg.shapes:
            for layout in LAYOUTS if len(shape) == 4 else ("contiguous",):
                try:
                    case = layer_case(run, shape, layout, precision)
                except Exception as error:  # report, do not hide: the other cases still run
                    errors.append(
                        {"precision": precision, "shape": list(shape), "layout": layout, "error": _error(error)}
                    )
                    traceback.print_exc()
                    continue
                cases.append(case)
                theirs, ours = case["counts"].get("torch", {}), case["counts"]["bnsurgeon"]
                print(
                    f"{precision:>13} {str(tuple(shape)):>20} {layout:>13}  plain {_shown(case['ms']['plain'])}  "
                    f"torch {_shown(case['ms']['torch'])}  bnsurgeon {_shown(case['ms']['bnsurgeon'])} ms  "
                    f"ours/torch {_shown(case['ratio_bnsurgeon_torch'], '6.3f')}  collectives torch "
                    f"{theirs.get('collectives')} ours {ours['collectives']}  kernels torch {theirs.get('kernels')} "
                    f"ours {ours['kernels']}" + (f"  FAILED: {case['failed']}" if "failed" in case else ""),
                    flush=True,
                )
    return _layers_result(run, cases, errors)


def _layers_result(run: Run, cases: list[dict], errors: list[dict]) -> dict:
    """The layers section's file from the cases measured (all of them, or those before an interruption)."""
    compared = [c for c in cases if c["ratio_bnsurgeon_torch"] is not None]
    geomean = {
        precision: geometric_mean([c["ratio_bnsurgeon_torch"] for c in compared if c["precision"] == precision])
        for precision in PRECISIONS
    }
    geomean["all"] = geometric_mean([c["ratio_bnsurgeon_torch"] for c in compared])
    not_synced = [
        f"{c['precision']} {c['shape']} {c['layout']}: {name}"
        for c in cases
        for name, ok in c["synced"].items()
        if not ok
    ]
    disagree = [
        f"{c['precision']} {c['shape']} {c['layout']}: {c['agreement_with_torch']}"
        for c in cases
        if c["agreement_with_torch"] is not None and not c["agreement_with_torch"]["ok"]
    ]
    per_layer = {}
    for name in ("torch", "bnsurgeon"):
        counted = [c["counts"][name] for c in cases if name in c["counts"]]
        kernels = [count["kernels"] for count in counted if count["kernels"] is not None]
        per_layer[name] = {
            "collectives_median": statistics.median([count["collectives"] for count in counted]) if counted else None,
            "kernels_median": statistics.median(kernels) if kernels else None,
            "kernels_min": min(kernels) if kernels else None,
            "kernels_max": max(kernels) if kernels else None,
        }
        if not kernels:
            per_layer[name]["kernels_skipped"] = NEEDS_CUDA
    return {
        "method": "module calls, forward + backward, every .grad reset before each call; median ms per call over "
        f"{run.cfg.rounds} rounds of {run.cfg.per_round} calls between device synchronizations, rounds alternating "
        "plain/torch/bnsurgeon; counts from the profiler, one call",
        "cases": cases,
        "geomean_bnsurgeon_torch": geomean,
        "counts_per_layer": per_layer,
        "baseline_counts": BASELINE_COUNTS,
        "goal": {
            "geomean_bnsurgeon_torch_max": GOAL_LAYER_GEOMEAN,
            "met": {k: (v is not None and v <= GOAL_LAYER_GEOMEAN) for k, v in geomean.items()},
        },
        "not_synced": not_synced,
        "disagreements_with_torch": disagree,
        "reference_failures": [
            f"{c['precision']} {c['shape']} {c['layout']}: {c['failed']}" for c in cases if "failed" in c
        ],
        "errors": errors,
        "ok": not errors and not not_synced and not disagree and bool(cases),
    }


# ---------------------------------------------------------------------------------------------
# whole training steps: eager, CUDA graph, compiled


def _tiny_convnet():
    """The dry run's model: two conv + BN + ReLU blocks and a 1000-class head (seconds on a CPU)."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 1000),
    )


def _build(run: Run, sync: bool):
    import torch

    import bnsurgeon

    torch.manual_seed(0)
    if run.cfg.model == "tiny-convnet":
        model = _tiny_convnet().to(run.device)
    else:
        import timm

        model = timm.create_model(run.cfg.model, pretrained=False).to(run.device)
    if run.cuda:
        model = model.to(memory_format=torch.channels_last)
    if sync:
        model = bnsurgeon.convert(model, "sync").model
    return model.train()


def _sync_layers(model) -> int:
    from bnsurgeon.runtime.layers import SyncBatchNorm

    return sum(1 for module in model.modules() if isinstance(module, SyncBatchNorm))


def _batch(run: Run):
    import torch

    generator = torch.Generator(device=run.device).manual_seed(1)
    shape = (run.cfg.batch, 3, run.cfg.pixels, run.cfg.pixels)
    x = torch.randn(shape, device=run.device, generator=generator)
    if run.cuda:
        x = x.contiguous(memory_format=torch.channels_last)
    target = torch.randint(0, 1000, (run.cfg.batch,), device=run.device, generator=generator)
    return x, target


class Step:
    """One training step of ``model`` on a static batch: SGD without momentum (stateless, so a
    replayed graph and an eager twin start from the same state)."""

    def __init__(self, run: Run, model, precision: str, batch) -> None:
        import torch

        self.model, self.run, self.precision = model, run, precision
        self.x, self.target = batch
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def __call__(self):
        import torch

        # no autocast cache: torch's CUDA-graph docs capture autocast regions with cache_enabled=False
        autocast = torch.autocast(
            self.run.device_type, dtype=torch.bfloat16, enabled=self.precision == "bf16-autocast", cache_enabled=False
        )
        with autocast:
            loss = torch.nn.functional.cross_entropy(self.model(self.x), self.target)
        loss.backward()
        self.optimizer.step()
        return loss

    def eager(self):
        """What an eager loop does each iteration: the gradients reset, then the step."""
        self.optimizer.zero_grad(set_to_none=True)
        return self()


class EagerGraph:
    """Dry run with stand-ins that cannot capture: a 'graph' that runs the step again at each replay
    (a real replay writes the captured backward's fresh gradients again, so the gradients are reset)."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self.loss = None
        self.standin_capture_failed: str | None = None

    def replay(self) -> None:
        self.loss = self.step.eager()


def capture(run: Run, step: Step):
    """(graph, static loss): the step captured as torch's CUDA-graph docs capture a whole network."""
    import torch

    if not run.cuda:  # the stand-in device's capture: what it records is what a replay runs
        for _ in range(run.cfg.capture_warmup):
            step.eager()
        step.optimizer.zero_grad(set_to_none=True)
        if not hasattr(run.standin_device, "capture"):
            graph = EagerGraph(step)
            return graph, graph
        import _cuda_standin
        import pytest

        # the stand-in graph replays a c10d op without waiting for its Work, and gloo completes
        # asynchronously: in the capture, the world of one's two collectives are the stand-in's
        # recordable copies (on a GPU, NCCL's collectives are stream-ordered and captured as they are)
        with pytest.MonkeyPatch.context() as patch:
            _cuda_standin.identical_ranks(patch, world_size=1)
            try:
                with run.standin_device.capture() as graph:
                    static_loss = step()
            except Exception as error:  # a limit of the stand-in capture, not of the step: said in the JSON
                print(f"stand-in capture failed, replaying eagerly instead: {_error(error)}")
                step.optimizer.zero_grad(set_to_none=True)
                eager = EagerGraph(step)
                eager.standin_capture_failed = _error(error)
                return eager, eager
        return graph, static_loss
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: allocations, lazy state, cached constants, NCCL communicators
        for _ in range(run.cfg.capture_warmup):
            step.eager()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    step.optimizer.zero_grad(set_to_none=True)  # backward allocates .grad from the graph's private pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    return graph, static_loss


def _relative(a, b) -> float:
    """|a - b| / max(|a|, |b|): 0 for two zero tensors, at most 2."""
    a, b = a.detach().double(), b.detach().double()
    return (a - b).norm().item() / max(a.norm().item(), b.norm().item(), 1e-30)


def graph_check(run: Run, sync: bool, precision: str, batch) -> tuple[Any, Step, dict]:
    """Capture one model's step, replay it once from the pre-warm-up state, compare with one eager
    step of a twin: (graph, the step it replays, the comparison). The graph reads the step's model,
    batch and gradients where they were at capture: keep the step alive while the graph replays
    (the stand-in capture of a dry run fails a replay that reads a freed tensor)."""
    import torch

    model, twin = _build(run, sync), _build(run, sync)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    step = Step(run, model, precision, batch)
    graph, static_loss = capture(run, step)
    with torch.no_grad():  # warm-up and capture must not leak into the replayed step
        for key, value in model.state_dict().items():
            value.copy_(start[key])
    graph.replay()
    twin_loss = Step(run, twin, precision, batch).eager()
    run.sync()
    loss = static_loss.loss if isinstance(static_loss, EagerGraph) else static_loss
    grads = [
        _relative(p.grad, q.grad)
        for p, q in zip(model.parameters(), twin.parameters())
        if p.grad is not None and q.grad is not None
    ]
    missing = sum(1 for p in model.parameters() if p.grad is None)
    params = [_relative(p, q) for p, q in zip(model.parameters(), twin.parameters())]
    twin_state = twin.state_dict()
    stats = [_relative(v, twin_state[k]) for k, v in model.state_dict().items() if "running" in k]
    counters = [int(v.item()) == int(twin_state[k].item()) for k, v in model.state_dict().items() if "num_batches" in k]
    tolerance = run.cfg.grad_tolerance[precision]
    check: dict[str, Any] = {"captured": "cuda graph" if run.cuda else "stand-in capture"}
    if isinstance(graph, EagerGraph):
        check["captured"] = f"no: eager replay, the stand-in capture failed ({graph.standin_capture_failed})"
    check |= {
        "loss_replay": float(loss.item()),
        "loss_eager": float(twin_loss.item()),
        "loss_abs_diff": abs(float(loss.item()) - float(twin_loss.item())),
        "grad_rel_diff_max": max(grads) if grads else None,
        "grads_compared": len(grads),
        "grads_missing": missing,
        "params_rel_diff_max": max(params) if params else None,
        "running_stats_rel_diff_max": max(stats) if stats else None,
        "num_batches_tracked_equal": all(counters),
        "tolerance": tolerance,
    }
    check["ok"] = bool(
        grads
        and not missing
        and max(grads) <= tolerance
        and max(params) <= tolerance
        and (not stats or max(stats) <= tolerance)
        and all(counters)
        and check["loss_abs_diff"] <= tolerance * max(1.0, abs(check["loss_eager"]))
    )
    del twin
    return graph, step, check


def section_graph(run: Run) -> dict:
    import torch

    cfg = run.cfg
    batch = _batch(run)
    results: dict[str, dict] = {}
    errors: list[dict] = []
    run.finish = lambda: _graph_result(run, results, errors)
    for precision in ("float32", "bf16-autocast"):
        try:
            entry: dict[str, Any] = {"ms": {}, "checks": {}, "collectives_per_step": {}}
            for kind, sync in (("plain", False), ("sync", True)):
                model = _build(run, sync)
                step = Step(run, model, precision, batch)
                entry["collectives_per_step"][kind] = profile_counts(run, step.eager)["collectives"]
                if sync:
                    entry["sync_layers"] = _sync_layers(model)
                entry["ms"][f"{kind}_eager"] = time_rounds(
                    run, {kind: step.eager}, cfg.model_rounds, cfg.model_per_round, cfg.model_warmup
                )[kind]
                del model, step
                graph, captured_step, entry["checks"][kind] = graph_check(run, sync, precision, batch)
                entry["ms"][f"{kind}_graph"] = time_rounds(
                    run, {kind: graph.replay}, cfg.model_rounds, cfg.model_per_round, cfg.model_warmup
                )[kind]
                del graph, captured_step
                if run.cuda:
                    torch.cuda.empty_cache()
            ms = entry["ms"]
            entry["ratio_sync_graph_plain_graph"] = ms["sync_graph"] / ms["plain_graph"]
            entry["ratio_sync_eager_plain_eager"] = ms["sync_eager"] / ms["plain_eager"]
            entry["ratio_plain_graph_plain_eager"] = ms["plain_graph"] / ms["plain_eager"]
            entry["sync_ran"] = entry["collectives_per_step"]["sync"] >= 2 * entry["sync_layers"] > 0
            entry["ok"] = entry["sync_ran"] and all(c["ok"] for c in entry["checks"].values())
            results[precision] = entry
            print(
                f"{cfg.model} {precision:>13}: plain eager {ms['plain_eager']:.2f} graph {ms['plain_graph']:.2f}, "
                f"sync eager {ms['sync_eager']:.2f} graph {ms['sync_graph']:.2f} ms; sync/plain captured "
                f"{entry['ratio_sync_graph_plain_graph']:.3f}, eager {entry['ratio_sync_eager_plain_eager']:.3f}; "
                f"replay=eager plain {entry['checks']['plain']['ok']} sync {entry['checks']['sync']['ok']}; "
                f"collectives/step {entry['collectives_per_step']['sync']} for {entry['sync_layers']} layers",
                flush=True,
            )
        except Exception as error:  # report, do not hide: the other precision still runs
            errors.append({"precision": precision, "error": _error(error)})
            traceback.print_exc()
    return _graph_result(run, results, errors)


def _graph_result(run: Run, results: dict, errors: list[dict]) -> dict:
    """The graph section's file from the precisions measured (both, or those before an interruption)."""
    cfg = run.cfg
    ratios = [r["ratio_sync_graph_plain_graph"] for r in results.values()]
    return {
        "model": cfg.model,
        "batch": cfg.batch,
        "pixels": cfg.pixels,
        "method": "SGD step (lr 0.01, no momentum), channels_last on a GPU; median ms per step over "
        f"{cfg.model_rounds} rounds of {cfg.model_per_round}; graph captured after torch.cuda.synchronize() with "
        f"{cfg.capture_warmup} warm-up steps on a side stream and .grad set to None; one replay from the pre-warm-up state "
        "compared with one eager step of a twin model (loss, gradients, parameters, running statistics)",
        "precisions": results,
        "goal": {
            "ratio_sync_graph_plain_graph_max": GOAL_GRAPH_STEP,
            "met": bool(ratios) and all(r <= GOAL_GRAPH_STEP for r in ratios),
        },
        "errors": errors,
        "ok": not errors and bool(results) and all(r["ok"] for r in results.values()),
    }


@contextlib.contextmanager
def outside_standin_device(run: Run):
    """Dry run: ``torch.compile`` runs a function eagerly, uncompiled, while a dispatch mode is active,
    and the stand-in device is one; the compiled section leaves it (the compiled path's collectives are
    custom ops that run eagerly inside the graph, and the stand-in kernels stay installed)."""
    if run.standin_device is None:
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def section_compiled(run: Run) -> dict:
    with outside_standin_device(run):
        return _section_compiled(run)


def _section_compiled(run: Run) -> dict:
    import torch

    cfg = run.cfg
    batch = _batch(run)
    precision = "bf16-autocast"
    ms: dict[str, float] = {}
    run.finish = lambda: {"ms": ms, "backend": cfg.compile_backend, "model": cfg.model}

    def timed(step: Step) -> float:
        return time_rounds(run, {"step": step.eager}, cfg.model_rounds, cfg.model_per_round, cfg.model_warmup)["step"]

    ms["plain_eager"] = timed(Step(run, _build(run, False), precision, batch))
    model = _build(run, True)
    layers = _sync_layers(model)
    ms["sync_eager"] = timed(Step(run, model, precision, batch))
    dynamo_takes_world_of_one()
    compiled_model = torch.compile(model, backend=cfg.compile_backend)
    step = Step(run, model, precision, batch)
    step.model = compiled_model
    started = time.perf_counter()
    step.eager()  # compiles forward and backward
    run.sync()
    compile_s = time.perf_counter() - started
    counts = profile_counts(run, step.eager)
    ms["sync_compiled"] = timed(step)
    from torch._dynamo.utils import counters

    dynamo = {
        "graph_breaks": sum(counters["graph_break"].values()),
        "break_reasons": sorted(counters["graph_break"])[:10],
        "unique_graphs": counters["stats"].get("unique_graphs", 0),
    }
    sync_ran = counts["collectives"] >= 2 * layers > 0
    compiled = dynamo["unique_graphs"] >= 1
    print(
        f"{cfg.model} compiled ({cfg.compile_backend}, {precision}): {ms['sync_compiled']:.2f} ms/step after "
        f"{compile_s:.0f} s compiling; eager sync {ms['sync_eager']:.2f}, eager plain {ms['plain_eager']:.2f}; "
        f"{counts['collectives']} collectives/step for {layers} sync layers; {dynamo['unique_graphs']} graphs, "
        f"{dynamo['graph_breaks']} graph breaks",
        flush=True,
    )
    result = {
        "model": cfg.model,
        "batch": cfg.batch,
        "pixels": cfg.pixels,
        "precision": precision,
        "backend": cfg.compile_backend,
        "compile_s": compile_s,
        "ms": ms,
        "ratio_compiled_sync_eager_plain": ms["sync_compiled"] / ms["plain_eager"],
        "ratio_compiled_sync_eager_sync": ms["sync_compiled"] / ms["sync_eager"],
        "sync_layers": layers,
        "collectives_per_step": counts["collectives"],
        "collective_records": counts["collective_records"],
        "dynamo": dynamo,
        "sync_ran": sync_ran,
        "compiled": compiled,
        "ok": sync_ran and compiled,
    }
    if not sync_ran:
        result["error"] = (
            f"the compiled step issued {counts['collectives']} collectives for {layers} sync layers (expected "
            f"{2 * layers}): it timed the plain path, not the sync path"
        )
    elif not compiled:
        result["error"] = "dynamo compiled no graph: the step ran eagerly"
    return result


SECTION_FUNCTIONS = {"layers": section_layers, "graph": section_graph, "compiled": section_compiled}
SECTION_FILES = {"layers": "layers.json", "graph": "graph_step.json", "compiled": "compiled.json"}


# ---------------------------------------------------------------------------------------------
# summary (no torch needed)


def _junit_summary(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    summary: dict[str, Any] = {**totals, "seconds": sum(float(s.get("time", 0)) for s in suites)}
    summary["passed"] = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    cases = []
    for case in root.iter("testcase"):
        if case.get("name") is None:  # the test pytest was in when interrupted: unnamed, no outcome
            continue
        outcome = "passed"
        detail = ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome, detail = tag, (found.get("message") or "")[:300]
                break
        cases.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time", 0)),
                "detail": detail,
            }
        )
    summary["cases"] = cases
    return summary


def _summarize_section(section: str, data: dict, summary: dict) -> None:
    """Print one section's figures against the goals and copy them into ``summary``."""
    if section == "layers":
        print("bnsurgeon / torch's SyncBatchNorm (module fwd+bwd, sync paths forced), per case, with the kernels")
        print("and collective records of one fwd+bwd, torch / bnsurgeon:")
        for case in data["cases"]:
            ours, theirs = case["counts"]["bnsurgeon"], case["counts"].get("torch", {})
            print(
                f"  {case['precision']:>13} {str(tuple(case['shape'])):>20} {case['layout']:>13} "
                f"{_shown(case['ratio_bnsurgeon_torch'], '6.3f')}   kernels {theirs.get('kernels')} / "
                f"{ours['kernels']}   collectives {theirs.get('collectives')} / {ours['collectives']}"
                + (f"   failed: {case['failed']}" if "failed" in case else "")
            )
        geomean = data["geomean_bnsurgeon_torch"]
        summary["goals"]["layer_geomean"] = {
            "value": geomean,
            "max": GOAL_LAYER_GEOMEAN,
            "met": data["goal"]["met"],
        }
        for key, value in geomean.items():
            shown = f"{value:.3f}" if value is not None else "n/a"
            print(f"  geomean {key:>13}: {shown}  (goal <= {GOAL_LAYER_GEOMEAN})")
        summary["counts_per_layer"] = data["counts_per_layer"]
        if data.get("reference_failures"):
            summary["reference_failures"] = data["reference_failures"]
            print(f"  reference layers that failed (their cases have no ratio): {data['reference_failures']}")
        print(f"  counts per layer (median over cases): {data['counts_per_layer']}; baseline {BASELINE_COUNTS}")
    elif section == "graph":
        values = {p: r["ratio_sync_graph_plain_graph"] for p, r in data["precisions"].items()}
        summary["goals"]["graph_step"] = {"value": values, "max": GOAL_GRAPH_STEP, "met": data["goal"]["met"]}
        for precision, value in values.items():
            checks = data["precisions"][precision]["checks"]
            print(
                f"captured {data['model']} step sync/plain {precision}: {value:.3f} (goal <= {GOAL_GRAPH_STEP}); "
                f"replay=eager (grads too): plain {checks['plain']['ok']}, sync {checks['sync']['ok']}"
            )
    elif section == "compiled":
        summary["compiled"] = {
            k: data.get(k) for k in ("backend", "ms", "compile_s", "collectives_per_step", "sync_layers", "sync_ran")
        }
        print(
            f"compiled sync step ({data['backend']}): {data['ms']['sync_compiled']:.2f} ms, "
            f"x{data['ratio_compiled_sync_eager_plain']:.3f} eager plain; sync ran: {data['sync_ran']}"
        )


def summarize(out: Path) -> int:
    """summary.json from whatever the steps left in ``out``; prints the ratios against the goals.
    Exit status 1 when a section failed, is missing, or the tests failed (goals are reported, not enforced)."""
    summary: dict[str, Any] = {"goals": {}, "problems": []}
    steps = out / "steps.jsonl"
    if steps.exists():
        summary["steps"] = [json.loads(line) for line in steps.read_text().splitlines() if line.strip()]
        summary["problems"] += [f"step {s['step']} exited {s['rc']}" for s in summary["steps"] if s["rc"] != 0]
    junit = out / "tests.xml"
    if junit.exists():
        tests = _junit_summary(junit)
        (out / "tests.json").write_text(json.dumps(finite(tests), indent=1, allow_nan=False) + "\n")
        summary["tests"] = {k: v for k, v in tests.items() if k != "cases"}
        print(
            f"CUDA tests: {tests['passed']} passed, {tests['failures']} failed, {tests['errors']} errors, "
            f"{tests['skipped']} skipped in {tests['seconds']:.0f} s"
        )
        if tests["failures"] or tests["errors"]:
            summary["problems"].append("CUDA tests failed")
    else:
        summary["problems"].append("no tests.xml: the CUDA tests did not run")
    for section, name in SECTION_FILES.items():
        path = out / name
        if not path.exists():
            summary["problems"].append(f"no {name}: section {section} did not finish")
            continue
        data = json.loads(path.read_text())
        summary.setdefault("mode", data.get("mode"))
        summary.setdefault("device", data.get("device"))
        if not data.get("ok"):
            summary["problems"].append(f"section {section} not ok: {data.get('errors') or data.get('error') or ''}")
        try:
            _summarize_section(section, data, summary)
        except (KeyError, TypeError, ValueError) as error:  # an interrupted section: the rest is in its file
            summary["problems"].append(f"section {section} incomplete: {_error(error)}")
    if summary.get("mode") == "gpu" and junit.exists():  # a CUDA test skipped for want of one GPU: CUDA unseen
        unseen = [c["test"] for c in tests["cases"] if c["outcome"] == "skipped" and "a CUDA device" in c["detail"]]
        if unseen:
            summary["problems"].append(f"CUDA tests skipped on the GPU machine: {unseen}")
    if summary.get("mode") == "dry-run":
        print("(a dry run: CPU, stand-in kernels, tiny sizes; its times say nothing about speed)")
    summary["ok"] = not summary["problems"]
    for problem in summary["problems"]:
        print(f"PROBLEM: {problem}")
    (out / "summary.json").write_text(json.dumps(finite(summary), indent=1, allow_nan=False) + "\n")
    return 0 if summary["ok"] else 1


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for the JSON files (created)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--dry-run", action="store_true", help="CPU, stand-in kernels, tiny sizes (seconds)")
    parser.add_argument("--summarize", type=Path, metavar="DIR", help="only write DIR/summary.json")
    args = parser.parse_args(argv)
    if args.summarize:
        return summarize(args.summarize)
    if args.out is None:
        parser.error("--out DIR is required")
    sys.path.insert(0, str(ROOT))
    # gpu_checks.sh's time limit interrupts a section: SIGINT (restored where a background shell left it
    # ignored) and SIGTERM both raise KeyboardInterrupt, so the section's file is still written
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    run = Run(args.dry_run, args.out)
    status = 0
    with process_group_of_one(run):
        print(json.dumps(run.describe()), flush=True)
        for section in args.sections:
            started = time.perf_counter()
            run.finish = dict
            interrupted = False
            try:
                result = SECTION_FUNCTIONS[section](run)
            except KeyboardInterrupt:  # gpu_checks.sh's time limit: keep what the section measured so far
                interrupted = True
                result = {**run.finish(), "ok": False, "error": "interrupted (the step's time limit)"}
            except Exception as error:  # the JSON says what failed; the exit status too
                traceback.print_exc()
                result = {**run.finish(), "ok": False, "error": _error(error)}
            result["seconds"] = time.perf_counter() - started
            path = write_json(run, SECTION_FILES[section], result)
            print(f"== {section}: {'ok' if result['ok'] else 'FAILED'} in {result['seconds']:.1f} s -> {path}")
            if not result["ok"]:
                status = 1
            if interrupted:
                return 130
    return status


if __name__ == "__main__":
    sys.exit(main())
