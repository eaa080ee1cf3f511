"""Sweep `--to fused` over timm's BN models and torchvision's backbones: what folds, what stays and why,
the error, and the eval time fused/source.

    nice -n 10 python scripts/fused_sweep.py --every 3 --budget-min 48   # the committed (sampled) run,
    nice -n 10 python scripts/fused_sweep.py --every 3 --resume          # continued where the budget stopped it
    python scripts/fused_sweep.py --every 3 --summarize                   # docs/fused_sweep.md from the .jsonl
    nice -n 10 python scripts/fused_sweep.py                              # the whole zoo (~2 h of one core)
    nice -n 10 python scripts/fused_sweep.py --resume --shard 1/2 &       # the same on 2 cores: one process
    nice -n 10 python scripts/fused_sweep.py --resume --shard 2/2         # per shard, then --summarize
    nice -n 10 python scripts/fused_sweep.py --retry-timeouts --timeout 600 --shard 1/2 &   # the time-boxed ones,
    nice -n 10 python scripts/fused_sweep.py --retry-timeouts --timeout 600 --shard 2/2     # again with 10 min each
    python scripts/fused_sweep.py --models resnet50 efficientnet_b0 --no-write

Per model (pretrained=False, seed 0): BN modules before/after, folds, each BN left with its
reason, how producers were found (torch.fx + hooks, or hooks alone), the max error relative to
the output scale (as converted, and re-folded after perturbing the BN state as `verify` does),
and the eval time of fused vs source at batch 8 on CPU: one thread, SIZE x SIZE input (models
that need a fixed larger size are not timed, to bound the run), the two models interleaved in
one process, median of REPS. The model list is the previous zoo sweep's (docs/zoo_sweep.jsonl: every timm model with
BN-family modules); `--every K` takes every K-th name (sorted), a deterministic sample.
Results are appended to docs/fused_sweep.jsonl as they come; `--resume` continues a run, and
`--budget-min` stops cleanly (the rest can be resumed).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zoo_sweep import ROOT, TORCHVISION_MODELS, _build, _input_shapes, run_sweep  # noqa: E402

SIZE = 96
REPS = 5
BATCH = 8
GOAL_REL_ERROR = 1e-5
GOAL_TIME_RATIO = 0.9


def classify(reason: str) -> str:
    """Group a left-reason: was it a conv/linear -> BN pair, and did its producer have one consumer?"""
    if reason.startswith("its input is not the output"):
        return "no conv/linear producer"
    if "consumers" in reason:
        return "producer has several consumers"
    if "a subclass whose forward" in reason or "parametrized weights" in reason:
        return "producer is a conv/linear subclass that changes its weight"
    if reason.startswith("not called"):
        return "not called in eval"
    return "other"


def judged(outcome) -> str:
    """How a comparison was decided: float32 within tolerance, proven in float64, undecidable (chaotic), failed."""
    from bnsurgeon.checks.fused_check import FUSED_RTOL

    if outcome.passed is None:
        return "undecidable"
    if not outcome.passed:
        return "failed"
    return "float32" if outcome.max_rel_error <= FUSED_RTOL else "float64"


def _time_pair(source, fused, x, reps: int) -> tuple[float, float]:
    """Median eval time of each, interleaved (source, fused, source, ...) after one warm-up each."""
    import torch

    times = {"source": [], "fused": []}
    with torch.inference_mode():
        source(x), fused(x)
        for _ in range(reps):
            for label, model in (("source", source), ("fused", fused)):
                start = time.perf_counter()
                model(x)
                times[label].append(time.perf_counter() - start)
    return statistics.median(times["source"]), statistics.median(times["fused"])


def fused_one(kind: str, name: str) -> dict:
    """One model: convert to fused, check the error, time both (runs in the worker)."""
    import torch

    import bnsurgeon
    from bnsurgeon.checks.fused_check import check_fused
    from bnsurgeon.surgery.fusion import example_tensor

    torch.set_num_threads(1)
    started = time.perf_counter()
    row = {"model": name, "source": kind}
    model = _build(kind, name).eval()
    last_error = None
    for shape in _input_shapes(model, kind):
        shape = (2, *shape[1:])
        try:
            with torch.no_grad():
                model(example_tensor(model, shape))
            break
        except Exception as error:
            last_error = error
    else:
        row.update(status="no input", reason=f"{type(last_error).__name__}: {last_error}"[:200])
        return row
    row["input_shape"] = list(shape)
    try:
        result = bnsurgeon.convert(model, "fused", example_input=shape, allow_unhandled=True)
    except Exception as error:
        row.update(status="refused", reason=f"{type(error).__name__}: {error}"[:200])
        return row
    fusion = result.report.fusion
    row.update(
        bn_before=fusion["bn_before"],
        bn_after=fusion["bn_after"],
        folded=len(fusion["folded"]),
        method="fx+hooks" if fusion["method"].startswith("torch.fx") else "hooks",
        left=dict(Counter(fusion["left"].values())),
        unhandled=len(result.report.unhandled),
    )
    if row["method"] == "hooks":
        row["fx_error"] = fusion["method"][:200]
    row["left_by_kind"] = dict(Counter(classify(r) for r in fusion["left"].values()))
    outcomes = check_fused(model, result.model, fusion["folded"], example_tensor(model, shape))
    row["rel_error"], row["rel_error_perturbed"] = outcomes[0].max_rel_error, outcomes[1].max_rel_error
    row["perturbation"] = outcomes[1].detail.split(":")[0]
    row["judged"] = [judged(o) for o in outcomes]
    if row["judged"] != ["float32", "float32"]:
        row["check_detail"] = " | ".join(o.detail for o in outcomes)[:600]
    row["check_passed"] = all(o.passed is not False for o in outcomes) and any(o.passed for o in outcomes)
    timing_shape = (BATCH, shape[1], SIZE, SIZE)
    try:
        with torch.no_grad():
            model(example_tensor(model, (1, *timing_shape[1:])))
    except Exception:  # a fixed-size model: timing at its own size would dominate the sweep's budget
        row.update(
            status="ok" if row["check_passed"] else "FAILED",
            time_ratio=None,
            timing=f"not timed: the model refuses {SIZE}x{SIZE} input",
            seconds=round(time.perf_counter() - started, 2),
        )
        return row
    x = example_tensor(model, timing_shape)
    single = time.perf_counter()
    with torch.inference_mode():
        model(x)
    reps = REPS if time.perf_counter() - single < 3.0 else 3
    source_s, fused_s = _time_pair(model, result.model.eval(), x, reps)
    row.update(
        timing_shape=list(timing_shape),
        reps=reps,
        source_ms=round(source_s * 1e3, 2),
        fused_ms=round(fused_s * 1e3, 2),
        time_ratio=round(fused_s / source_s, 4),
    )
    row["status"] = "ok" if row["check_passed"] else "FAILED"
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row


def timm_bn_names() -> list[str]:
    """Every timm model with BN-family modules, as the zoo sweep found them (docs/zoo_sweep.jsonl), sorted."""
    rows = [json.loads(line) for line in (ROOT / "docs" / "zoo_sweep.jsonl").read_text().splitlines() if line.strip()]
    return sorted(r["model"] for r in rows if r["source"] == "timm" and r.get("status") != "no BN")


def model_names(every: int) -> list[tuple[str, str]]:
    return [("torchvision", n) for n in TORCHVISION_MODELS] + [("timm", n) for n in timm_bn_names()[::every]]


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if r.get("status") in ("ok", "FAILED")]
    left_kinds: Counter = Counter()
    for r in ok:
        left_kinds.update(r.get("left_by_kind", {}))
    folded = sum(r["folded"] for r in ok)
    pairs_single = folded + left_kinds["other"]
    in_float32 = [r for r in ok if r.get("judged", ["float32"])[0] == "float32"]
    ratios = [r["time_ratio"] for r in ok if r.get("time_ratio") and r["folded"]]
    return {
        "models": len(rows),
        "rows_carried_from_an_earlier_run": sum(1 for r in rows if r.get("carried_from")),
        "converted_and_checked": len(ok),
        "check_failed": sum(1 for r in rows if r.get("status") == "FAILED"),
        "not_converted": {
            s: sum(1 for r in rows if r.get("status") == s) for s in ("refused", "no input", "timeout", "error")
        },
        "producers_from_fx_and_hooks": sum(1 for r in ok if r.get("method") == "fx+hooks"),
        "producers_from_hooks_only": sum(1 for r in ok if r.get("method") == "hooks"),
        "bn_before": sum(r["bn_before"] for r in ok),
        "bn_after": sum(r["bn_after"] for r in ok),
        "folded": folded,
        "left_by_kind": dict(left_kinds),
        "single_consumer_pairs_folded_pct": round(100.0 * folded / pairs_single, 2) if pairs_single else None,
        "judged_as_converted": dict(Counter(r.get("judged", ["?"])[0] for r in ok)),
        "judged_perturbed": dict(Counter(r.get("judged", ["?", "?"])[1] for r in ok)),
        "max_rel_error_as_converted": max((r["rel_error"] for r in ok), default=None),
        "max_rel_error_as_converted_float32_judged": max((r["rel_error"] for r in in_float32), default=None),
        "models_over_1e-5_as_converted": sorted(r["model"] for r in ok if r["rel_error"] > GOAL_REL_ERROR),
        "median_rel_error_as_converted": statistics.median([r["rel_error"] for r in ok]) if ok else None,
        "timed": len(ratios),
        "time_ratio_geomean": round(geometric_mean(ratios), 4),
        "time_ratio_median": statistics.median(ratios) if ratios else None,
        "time_ratio_range": [min(ratios), max(ratios)] if ratios else None,
    }


def _versions() -> str:
    import platform

    import timm
    import torch
    import torchvision

    return f"torch {torch.__version__}, torchvision {torchvision.__version__}, timm {timm.__version__}, Python {platform.python_version()}"


def write_docs(rows: list[dict], docs: Path, command: str, note: str) -> None:
    rows = sorted(rows, key=lambda r: (r["source"] != "torchvision", r["model"]))  # shards append interleaved
    totals = summarize(rows)
    (docs / "fused_sweep.json").write_text(json.dumps({"totals": totals, "command": command}, indent=1) + "\n")
    lines = [
        "# Fused sweep (`--to fused`)",
        "",
        f"Generated by `{command}` ({_versions()}; summary re-made from "
        f"docs/fused_sweep.jsonl by `python scripts/fused_sweep.py --summarize`). {note}",
        "",
        f"Eval time: batch {BATCH}, {SIZE}x{SIZE} input (models that refuse {SIZE}x{SIZE} are not timed), "
        f"one CPU thread, source and fused interleaved in one process, median of {REPS} (3 for slow models). "
        "The machine's 2 cores were shared with other jobs during the run, so single ratios are noisy; the "
        "interleaving keeps each pair under the same load. "
        "Relative error: max |fused - source| / max |source| over the outputs on a seeded (2, C, 64, 64) input "
        "(the model's own size where needed), as converted, and re-folded after perturbing the BN state as "
        "`verify` does. Where float32 rounding alone exceeds the 1e-4 check tolerance (deep nets at random init), "
        "the check re-does the folds in float64 (`judged` float64); where even float64 cannot tell because the "
        "source is chaotic at that state, that comparison is `undecidable` and the other one decides.",
        "",
        "## Totals",
        "",
    ]
    lines += [f"- {key.replace('_', ' ')}: {json.dumps(value)}" for key, value in totals.items()]
    lines += [
        "",
        "## Per model",
        "",
        "| model | BN before -> after | folded | producers from | max rel. error as converted (perturbed) | judged | fused/source time | left (reason x count) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    carried = sorted({r["carried_from"] for r in rows if r.get("carried_from")})
    if carried:
        lines[lines.index("## Per model") + 1 : lines.index("## Per model") + 1] = [
            "",
            f"Rows marked * are carried over from an earlier run of the same sample ({', '.join(carried)}): the "
            "models the later code changes could affect were re-run, these were not.",
            "",
        ]
    remeasured = sorted({r["remeasured"] for r in rows if r.get("remeasured")})
    if remeasured:
        lines[lines.index("## Per model") + 1 : lines.index("## Per model") + 1] = [
            "",
            f"Rows marked + were re-measured after the run named above ({'; '.join(remeasured)}); the other rows "
            "are from that run.",
            "",
        ]
    for r in rows:
        mark = "*" if r.get("carried_from") else "+" if r.get("remeasured") else ""
        if r.get("status") not in ("ok", "FAILED"):
            lines.append(
                f"| {r['source']}:{r['model']}{mark} | - | - | - | - | - | - | {r.get('status')}: {r.get('reason', '')[:120]} |"
            )
            continue
        left = "; ".join(f"{reason} x{count}" for reason, count in r["left"].items())
        error = f"{r['rel_error']:.2g} ({r['rel_error_perturbed']:.2g})" + ("" if r["check_passed"] else " FAILED")
        timing = f"{r['time_ratio']:.3f} ({r['source_ms']:.1f} ms)" if r.get("time_ratio") else "not timed (fixed size)"
        lines.append(
            f"| {r['source']}:{r['model']}{mark} | {r['bn_before']} -> {r['bn_after']} | {r['folded']} | "
            f"{r['method']} | {error} | {'/'.join(r.get('judged', []))} | {timing} | {left} |"
        )
    (docs / "fused_sweep.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="timm names (default: every BN model of the zoo sweep)")
    parser.add_argument(
        "--every", type=int, default=1, help="take every K-th model name (sorted): a deterministic sample"
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="time box per model, seconds")
    parser.add_argument(
        "--budget-min", type=float, default=0.0, help="stop starting new models after this many minutes"
    )
    parser.add_argument("--resume", action="store_true", help="skip models already in docs/fused_sweep.jsonl")
    parser.add_argument(
        "--shard",
        default="1/1",
        help="I/N: run only every N-th remaining model from the I-th (one process "
        "per core; needs --resume, as every shard appends to the .jsonl; then --summarize)",
    )
    parser.add_argument(
        "--retry-timeouts",
        action="store_true",
        help="re-run the models whose row is a timeout, with "
        "--timeout (and --shard), replacing their rows in the .jsonl (marked + in the docs)",
    )
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--summarize", action="store_true", help="only re-make the docs from docs/fused_sweep.jsonl")
    args = parser.parse_args()
    shard_index, shard_count = _shard(parser, args.shard)
    if shard_count > 1 and not (args.resume or args.no_write or args.retry_timeouts):
        parser.error(
            "--shard appends to docs/fused_sweep.jsonl: pass --resume (move the old file away to start afresh)"
        )

    docs = ROOT / "docs"
    if args.summarize:
        rows = [json.loads(line) for line in (docs / "fused_sweep.jsonl").read_text().splitlines() if line.strip()]
        planned = len(model_names(args.every))
        write_docs(rows, docs, _command(args.every), _note(len(rows), planned, args.every))
        print(json.dumps(summarize(rows), indent=1))
        return
    if args.retry_timeouts:
        retry_timeouts(docs / "fused_sweep.jsonl", args.timeout, shard_index, shard_count)
        return
    jsonl = None if args.no_write else docs / "fused_sweep.jsonl"
    tasks = [("timm", n) for n in args.models] if args.models else model_names(args.every)
    planned = len(tasks)
    done: list[dict] = []
    if args.resume and jsonl and jsonl.exists():
        done = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
        seen = {(r["source"], r["model"]) for r in done}
        tasks = [t for t in tasks if t not in seen]
    tasks = tasks[shard_index::shard_count]
    if jsonl and jsonl.exists() and not args.resume:
        jsonl.unlink()
    deadline = time.monotonic() + args.budget_min * 60 if args.budget_min else None
    rows = done + run_sweep(tasks, args.timeout, jsonl, job=fused_one, deadline=deadline)
    summary = summarize(rows)
    print(json.dumps(summary, indent=1))
    if shard_count > 1:
        print("shard done: when every shard is, re-make the docs with --summarize", file=sys.stderr)
    elif not args.no_write:
        write_docs(rows, docs, _command(args.every), _note(len(rows), planned, args.every))


def retry_timeouts(jsonl: Path, timeout: float, shard_index: int, shard_count: int) -> None:
    """Re-run this shard's timed-out models with a longer box; swap their rows in under a lock
    (every shard rewrites the file once, at its end)."""
    import fcntl

    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    tasks = [(r["source"], r["model"]) for r in rows if r.get("status") == "timeout"][shard_index::shard_count]
    fresh = run_sweep(tasks, timeout, None, job=fused_one)
    for row in fresh:
        row["remeasured"] = f"--retry-timeouts --timeout {timeout:.0f}, over the first run's time box"
    by_key = {(r["source"], r["model"]): r for r in fresh}
    with open(jsonl.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        current = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
        merged = [by_key.get((r["source"], r["model"]), r) for r in current]
        staged = jsonl.with_suffix(".jsonl.tmp")
        staged.write_text("".join(json.dumps(r) + "\n" for r in merged))
        staged.replace(jsonl)
    jsonl.with_suffix(".lock").unlink(missing_ok=True)
    print(
        f"re-ran {len(fresh)} timed-out models: " + ", ".join(f"{r['model']} {r['status']}" for r in fresh),
        file=sys.stderr,
    )


def _shard(parser: argparse.ArgumentParser, text: str) -> tuple[int, int]:
    """'I/N' -> (I - 1, N), 1 <= I <= N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        parser.error(f"--shard takes I/N, such as 1/2, not {text!r}")
    if not 1 <= index <= count:
        parser.error(f"--shard {text}: I must be between 1 and N")
    return index - 1, count


def _command(every: int) -> str:
    return "nice -n 10 python scripts/fused_sweep.py" + (f" --every {every}" if every > 1 else "")


def _note(done: int, planned: int, every: int) -> str:
    sample = (
        (
            f" ({len(TORCHVISION_MODELS)} torchvision, then every {every}th of the {len(timm_bn_names())} timm "
            f"models with BN, sorted by name)"
        )
        if every > 1
        else ""
    )
    return f"{done} of {planned} planned models{sample}."


if __name__ == "__main__":
    main()
