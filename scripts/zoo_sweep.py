"""Sweep timm's model zoo (and torchvision's backbones): inspect + convert + eval check for every
model with BatchNorm-family modules, and whether torch's / timm's own converters preserve eval outputs.

    python scripts/zoo_sweep.py                       # everything; writes docs/zoo_sweep.{jsonl,json,md}
    python scripts/zoo_sweep.py --limit 20            # the first 20 BN models
    python scripts/zoo_sweep.py --models resnet18 efficientnet_b0 --no-write

Every model is built with pretrained=False and seed 0. Its BN statistics and affine
parameters are perturbed (seeded): fresh BN is near the identity and would hide a lost
activation. One worker process runs the models; the parent kills and restarts it when a
model exceeds its time box, and records that as a timeout rather than dropping the model.
Results are appended as JSON lines as they come, so an interrupted sweep keeps what it did.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DETECTION_BACKBONES = {"fasterrcnn_resnet50_fpn": "resnet50", "fasterrcnn_resnet101_fpn": "resnet101"}
TORCHVISION_MODELS = [
    "resnet50",
    "mobilenet_v3_large",
    "efficientnet_b0",
    "regnet_y_400mf",
    "densenet121",
    *DETECTION_BACKBONES,
]


def _equal(a, b) -> tuple[bool, float]:
    """Bit-identical, where NaN in the same places counts as equal (NaN != NaN otherwise)."""
    import torch

    if a.shape != b.shape:
        return False, float("inf")
    nan_a, nan_b = a.isnan(), b.isnan()
    if not torch.equal(nan_a, nan_b):
        return False, float("nan")
    finite_a, finite_b = a[~nan_a], b[~nan_b]
    diff = (finite_a.double() - finite_b.double()).abs().max().item() if finite_a.numel() else 0.0
    return torch.equal(finite_a, finite_b), diff


def _outputs(model, x):
    import torch

    from bnsurgeon.checks.outputs import flatten_tensors as _tensors

    with torch.no_grad():
        return _tensors(model.eval()(x))


def _compare(reference, outputs) -> tuple[bool, float]:
    if len(reference) != len(outputs):
        return False, float("inf")
    results = [_equal(a, b) for a, b in zip(reference, outputs)]
    return all(r[0] for r in results), max((r[1] for r in results), default=0.0)


def _build(kind: str, name: str):
    import torch

    torch.manual_seed(0)
    if kind == "timm":
        import timm

        return timm.create_model(name, pretrained=False)
    import torchvision

    if name in DETECTION_BACKBONES:
        # detection builders use FrozenBatchNorm2d only with pretrained backbone weights
        # (none here), so build the backbone with it as detection training does
        from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
        from torchvision.ops.misc import FrozenBatchNorm2d

        return resnet_fpn_backbone(backbone_name=DETECTION_BACKBONES[name], weights=None, norm_layer=FrozenBatchNorm2d)
    return torchvision.models.get_model(name, weights=None)


def _input_shapes(model, kind: str):
    """Small input first (fast), then the model's own size for nets that need a fixed one."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    channels, *size = cfg.get("input_size", (3, 224, 224))
    small = (1, channels, 64, 64)
    full = (1, channels, *size)
    return [small, full] if tuple(size) != (64, 64) else [full]


def sweep_one(kind: str, name: str) -> dict:
    """Everything the table needs for one model (runs in the worker)."""
    import copy

    import torch

    import bnsurgeon
    from bnsurgeon.checks.verify import perturb_bn
    from bnsurgeon.surgery.inspection import inspect_model

    started = time.perf_counter()
    row = {"model": name, "source": kind}
    model = _build(kind, name)
    inspection = inspect_model(model)
    row["bn_classes"] = {g.cls.rsplit(".", 1)[-1]: g.count for g in inspection.groups}
    row["unhandled"] = inspection.unhandled
    if not inspection.groups:
        row["status"] = "no BN"
        return row
    strength = 1.0
    perturb_bn(model, strength=strength)
    try:
        result = bnsurgeon.convert(model, "sync", allow_unhandled=True)
    except Exception as error:  # a refusal (e.g. lazy BN) is a result, with its reason
        row.update(status="refused", reason=f"{type(error).__name__}: {error}"[:200])
        return row
    row["converted"] = len(result.report.changed)
    last_error = None
    for shape in _input_shapes(model, kind):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        try:
            reference = _outputs(model, x)
            break
        except Exception as error:  # wrong input size for this model: try its own size
            last_error = error
    else:
        row.update(status="no input", reason=f"{type(last_error).__name__}: {last_error}"[:200])
        return row
    row["input_shape"] = list(shape)
    while not all(t.isfinite().all() for t in reference) and strength > 1e-3:
        strength /= 10  # the source overflows at this perturbation: a milder one (same seed)
        perturb_bn(model, strength=strength)
        reference = _outputs(model, x)
    if strength != 1.0:
        row["reason"] = f"perturbation strength {strength:g} (1.0 overflows in the source)"
    if not all(t.isfinite().all() for t in reference):
        row["reason"] = "the source outputs non-finite values even with mild perturbation; compared NaN positions"
    same, diff = _compare(reference, _outputs(result.model, x))
    row["bnsurgeon_exact"], row["bnsurgeon_max_diff"] = same, diff
    for label, converter in (("torch", torch.nn.SyncBatchNorm.convert_sync_batchnorm), ("timm", _timm_converter())):
        try:
            other = converter(copy.deepcopy(model))
            row[f"{label}_exact"], row[f"{label}_max_diff"] = _compare(reference, _outputs(other, x))
        except Exception as error:
            row[f"{label}_exact"], row[f"{label}_error"] = False, f"{type(error).__name__}: {error}"[:160]
    exact_rules = result.exact
    row["status"] = "exact" if same else ("close" if not exact_rules and diff < 1e-3 else "FAILED")
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row


def dist_check(row: dict, timeout: float) -> dict:
    """2-rank verify (float64, perturbed BN) of one swept model: bnsurgeon's check_ranks."""
    import bnsurgeon
    from bnsurgeon.checks.verify import check_ranks, perturb_bn

    model = perturb_bn(_build(row["source"], row["model"]))
    converted = bnsurgeon.convert(model, "sync", allow_unhandled=True).model
    outcome = check_ranks(model, converted, tuple(row["input_shape"]), 2, timeout=timeout)
    return {"ranks2": outcome.passed, "ranks2_max_diff": outcome.max_abs_diff, "ranks2_detail": outcome.detail}


def _timm_converter():
    from timm.layers import convert_sync_batchnorm

    return convert_sync_batchnorm


def _worker(tasks, results, job=None):
    import torch

    torch.set_num_threads(1)
    job = job or sweep_one
    while True:
        task = tasks.get()
        if task is None:
            return
        kind, name = task
        try:
            results.put(job(kind, name))
        except Exception as error:
            results.put(
                {"model": name, "source": kind, "status": "error", "reason": f"{type(error).__name__}: {error}"[:200]}
            )


def bn_model_names(limit: int | None = None) -> list[str]:
    """timm models whose meta-device build has BN-family modules."""
    import timm
    import torch

    from bnsurgeon.surgery.walk import plan

    names = []
    for name in timm.list_models():
        try:
            with torch.device("meta"):
                model = timm.create_model(name, pretrained=False)
        except Exception:
            names.append(name)  # cannot tell on meta: let the sweep decide on CPU
            continue
        if plan(model):
            names.append(name)
        if limit and len(names) >= limit:
            break
    return names


def run_sweep(
    tasks: list[tuple[str, str]], timeout: float, out_path: Path | None, job=None, deadline: float | None = None
) -> list[dict]:
    """Run ``job(kind, name)`` (default: sweep_one) per task in a worker; stop starting tasks after ``deadline`` (monotonic)."""
    context = mp.get_context("spawn")
    rows = []
    task_queue, result_queue = context.Queue(), context.Queue()
    worker = context.Process(target=_worker, args=(task_queue, result_queue, job), daemon=True)
    worker.start()
    sink = open(out_path, "a") if out_path else None
    try:
        for index, (kind, name) in enumerate(tasks):
            if deadline is not None and time.monotonic() > deadline:
                print(f"time budget spent after {index} of {len(tasks)} models", file=sys.stderr, flush=True)
                break
            task_queue.put((kind, name))
            try:
                row = result_queue.get(timeout=timeout)
            except queue.Empty:
                worker.kill()
                worker.join()
                row = {"model": name, "source": kind, "status": "timeout", "reason": f"over {timeout:.0f}s (time box)"}
                task_queue, result_queue = context.Queue(), context.Queue()
                worker = context.Process(target=_worker, args=(task_queue, result_queue, job), daemon=True)
                worker.start()
            rows.append(row)
            if sink:
                sink.write(json.dumps(row) + "\n")
                sink.flush()
            print(f"[{index + 1}/{len(tasks)}] {kind}:{name}: {row['status']}", file=sys.stderr, flush=True)
    finally:
        task_queue.put(None)
        worker.join(timeout=10)
        if worker.is_alive():
            worker.kill()
        if sink:
            sink.close()
    return rows


def summarize(rows: list[dict]) -> dict:
    bn = [r for r in rows if r.get("status") != "no BN"]
    count = lambda key, value=True: sum(1 for r in bn if r.get(key) == value)  # noqa: E731
    return {
        "models_swept": len(bn),
        "bnsurgeon_bit_identical": count("status", "exact"),
        "bnsurgeon_close_frozen": count("status", "close"),
        "bnsurgeon_failed": count("status", "FAILED"),
        "skipped_timeout": count("status", "timeout"),
        "skipped_other": sum(1 for r in bn if r.get("status") in ("error", "no input", "refused")),
        "torch_converter_preserved": count("torch_exact"),
        "timm_converter_preserved": count("timm_exact"),
        "with_unhandled_modules": sum(1 for r in bn if r.get("unhandled")),
        "two_rank_verify_sampled": sum(1 for r in bn if "ranks2" in r),
        "two_rank_verify_passed": count("ranks2"),
    }


def write_docs(rows: list[dict], docs: Path) -> None:
    totals = summarize(rows)
    (docs / "zoo_sweep.json").write_text(json.dumps({"totals": totals, "models": rows}, indent=1) + "\n")
    lines = [
        "# Zoo sweep",
        "",
        "Generated by `python scripts/zoo_sweep.py`. Eval outputs on a seeded input after "
        "perturbing BN statistics and affine parameters (seeded). `yes` = bit-identical.",
        "",
        "| " + " | ".join(f"{k.replace('_', ' ')}" for k in totals) + " |",
        "|" + "---|" * len(totals),
        "| " + " | ".join(str(v) for v in totals.values()) + " |",
        "",
        "| model | BN classes | bnsurgeon | torch converter | timm converter | 2 ranks | note |",
        "|---|---|---|---|---|---|---|",
    ]

    def mark(r, key):
        return (
            "-" if key not in r else ("yes" if r[key] else f"no ({r.get(key.replace('exact', 'max_diff'), 'error')})")
        )

    for r in rows:
        if r.get("status") == "no BN":
            continue
        classes = ", ".join(f"{k} x{v}" for k, v in (r.get("bn_classes") or {}).items())
        note = r.get("reason", "") or (f"{r['unhandled']} unhandled (left untouched)" if r.get("unhandled") else "")
        status = r.get("status")
        ours = "yes" if status == "exact" else status
        ranks = "-" if "ranks2" not in r else ("pass" if r["ranks2"] else "FAIL")
        lines.append(
            f"| {r['source']}:{r['model']} | {classes} | {ours} | {mark(r, 'torch_exact')} | "
            f"{mark(r, 'timm_exact')} | {ranks} | {note} |"
        )
    (docs / "zoo_sweep.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="timm names (default: every BN model in timm)")
    parser.add_argument("--limit", type=int, help="only the first N BN models")
    parser.add_argument("--timeout", type=float, default=120.0, help="time box per model, seconds")
    parser.add_argument("--no-torchvision", action="store_true")
    parser.add_argument("--no-write", action="store_true", help="print the totals, write nothing")
    parser.add_argument("--resume", action="store_true", help="skip models already in docs/zoo_sweep.jsonl")
    parser.add_argument(
        "--dist-sample",
        type=int,
        default=0,
        metavar="K",
        help="also run the 2-rank verify on every K-th bit-identical model (sorted by name)",
    )
    args = parser.parse_args()

    docs = ROOT / "docs"
    docs.mkdir(exist_ok=True)
    jsonl = None if args.no_write else docs / "zoo_sweep.jsonl"
    names = args.models or bn_model_names(args.limit)
    tasks = [("timm", n) for n in names]
    if not args.no_torchvision and not args.models:
        tasks += [("torchvision", n) for n in TORCHVISION_MODELS]
    done: list[dict] = []
    if args.resume and jsonl and jsonl.exists():
        done = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
        seen = {(r["source"], r["model"]) for r in done}
        tasks = [t for t in tasks if t not in seen]
    elif jsonl and jsonl.exists():
        jsonl.unlink()
    rows = done + run_sweep(tasks, args.timeout, jsonl)
    if args.dist_sample:
        sample = sorted((r for r in rows if r.get("status") == "exact"), key=lambda r: (r["source"], r["model"]))
        for row in sample[:: args.dist_sample]:
            try:
                row.update(dist_check(row, args.timeout))
            except Exception as error:
                row.update(ranks2=False, ranks2_detail=f"{type(error).__name__}: {error}"[:200])
            print(f"2 ranks {row['source']}:{row['model']}: {row['ranks2']}", file=sys.stderr, flush=True)
    print(json.dumps(summarize(rows), indent=1))
    if not args.no_write:
        write_docs(rows, docs)


if __name__ == "__main__":
    main()
