"""``scripts/gpu_checks.sh --dry-run``: the GPU checks' own code on CPU, so that it cannot rot between
GPU loans. The dry run uses the strict stand-ins of the CUDA kernels, tiny sizes and one iteration;
this test checks that every step ran and that each JSON file has its keys and finite figures. No
timing is asserted: a dry run's times say nothing about speed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = {"float32", "bf16-autocast", "half-model"}


def _finite(value, where: str = "") -> None:
    """Every number in ``value`` is finite (json.loads accepts NaN and Infinity)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _finite(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _finite(item, f"{where}[{index}]")
    elif isinstance(value, float):
        assert math.isfinite(value), where


def _positive(value, where: str) -> None:
    assert isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0, (where, value)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu_checks")
    environment = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_checks.sh"), "--dry-run", str(out)],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out


def _load(out: Path, name: str) -> dict:
    data = json.loads((out / name).read_text())
    _finite(data, name)
    assert data["mode"] == "dry-run" and data["ok"] is True, data.get("error") or data.get("errors")
    return data


def test_dry_run_writes_every_file_and_every_step_passes(dry_run):
    for name in ("layers.json", "graph_step.json", "compiled.json", "tests.xml", "tests.json", "summary.json"):
        assert (dry_run / name).is_file(), name
    steps = [json.loads(line) for line in (dry_run / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == ["bench", "tests", "summary"]
    assert all(s["rc"] == 0 and s["seconds"] <= s["limit_s"] for s in steps), steps
    summary = json.loads((dry_run / "summary.json").read_text())
    _finite(summary, "summary")
    assert summary["ok"] is True and summary["problems"] == [], summary["problems"]
    assert {"layer_geomean", "graph_step"} <= set(summary["goals"])
    tests = json.loads((dry_run / "tests.json").read_text())
    assert tests["tests"] >= 1 and tests["failures"] == tests["errors"] == 0
    assert all(case["outcome"] == "skipped" for case in tests["cases"])  # no CUDA here


def test_layers_json_compares_the_modules_on_their_sync_paths(dry_run):
    data = _load(dry_run, "layers.json")
    cases = data["cases"]
    layouts = {(len(c["shape"]), c["layout"]) for c in cases}
    assert layouts == {(4, "contiguous"), (4, "channels_last"), (2, "contiguous")}
    assert {c["precision"] for c in cases} == PRECISIONS and not data["errors"] and not data["not_synced"]
    assert not data["disagreements_with_torch"] and not data["reference_failures"]
    for case in cases:
        where = f"{case['precision']} {case['shape']} {case['layout']}"
        for layer in ("plain", "torch", "bnsurgeon"):
            _positive(case["ms"][layer], f"{where} {layer}")
        _positive(case["ratio_bnsurgeon_torch"], where)
        for layer in ("torch", "bnsurgeon"):  # both on the sync path: one all_gather, one all_reduce
            counts = case["counts"][layer]
            assert counts["collectives"] == 2, (where, layer, counts)
            assert counts["kernels"] is None and "CUDA" in counts["kernels_skipped"]
        assert case["counts"]["plain"]["collectives"] == 0, where
        agreement = case["agreement_with_torch"]  # same kernels on a world of one: equal, to rounding
        assert agreement["ok"] and agreement["input_grad"] <= agreement["tolerance"], (where, agreement)
    for precision in [*PRECISIONS, "all"]:
        _positive(data["geomean_bnsurgeon_torch"][precision], precision)
    assert data["goal"]["geomean_bnsurgeon_torch_max"] == 0.8
    assert data["baseline_counts"]["torch"] == {"kernels": 30, "collectives": 2}


def test_graph_step_json_checks_the_replay_against_eager_gradients_included(dry_run):
    data = _load(dry_run, "graph_step.json")
    assert set(data["precisions"]) == {"float32", "bf16-autocast"}
    for precision, entry in data["precisions"].items():
        for key in ("plain_eager", "sync_eager", "plain_graph", "sync_graph"):
            _positive(entry["ms"][key], f"{precision} {key}")
        _positive(entry["ratio_sync_graph_plain_graph"], precision)
        assert entry["sync_ran"] and entry["collectives_per_step"]["sync"] == 2 * entry["sync_layers"] > 0
        assert entry["collectives_per_step"]["plain"] == 0
        for kind in ("plain", "sync"):
            check = entry["checks"][kind]
            if precision == "float32":  # captured by the stand-in device, replayed from what it recorded
                assert check["captured"] == "stand-in capture", check["captured"]
            assert check["ok"] and check["grads_compared"] > 0 and check["grads_missing"] == 0, (precision, check)
            assert check["grad_rel_diff_max"] <= check["tolerance"], (precision, kind, check)
    assert data["goal"]["ratio_sync_graph_plain_graph_max"] == 1.2


def test_compiled_json_shows_the_sync_path_ran(dry_run):
    data = _load(dry_run, "compiled.json")
    assert data["backend"] == "aot_eager" and data["sync_ran"] is True and data["compiled"] is True
    assert data["collectives_per_step"] >= 2 * data["sync_layers"] > 0
    assert data["dynamo"]["unique_graphs"] >= 1 and isinstance(data["dynamo"]["graph_breaks"], int)
    for key in ("plain_eager", "sync_eager", "sync_compiled"):
        _positive(data["ms"][key], key)


def test_summarize_reports_a_missing_section_as_a_problem(dry_run, tmp_path):
    """A step that left no JSON (a crash, a time limit) fails the summary instead of vanishing."""
    for name in ("layers.json", "graph_step.json", "tests.xml", "steps.jsonl"):
        (tmp_path / name).write_bytes((dry_run / name).read_bytes())
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_cuda.py"), "--summarize", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["problems"] == ["no compiled.json: section compiled did not finish"]
