"""What sync buys (runtime/gaps.py, launch/gaps.py): each rank's batch statistics against the global batch's.

Against closed forms (tests/_gap_cases.py): ranks fed identical data report gaps of exactly 0; ranks fed shifted
data report the shift in global standard deviations. Under torchrun, ``bnsurgeon run --stats`` writes the JSON
document and its picture on rank 0 only, says one verdict line, and follows ``--report``'s rules.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from _dist import run_world, torchrun
from typer.testing import CliRunner

from bnsurgeon.cli.commands import app

CASES = Path(__file__).with_name("_gap_cases.py")
sys.path.insert(0, str(CASES.parent))
import _gap_cases as cases  # noqa: E402


@pytest.mark.distributed
def test_identical_data_on_every_rank_reports_a_gap_of_exactly_zero():
    ranks = run_world(2, cases.gap_rank, False, timeout=120)
    for result in ranks:
        assert result["done"] and result["calls"] == 2
        assert all(value == 0.0 for row in result["mean_gaps"] for value in row), result["mean_gaps"]
        assert all(value == 0.0 for row in result["scale_gaps"] for value in row), result["scale_gaps"]
        summary = result["summary"]
        assert summary["mean_gap"] == {"median": 0.0, "max": 0.0} and summary["scale_gap"]["max"] == 0.0


@pytest.mark.distributed
def test_shifted_data_reports_the_shift_in_global_standard_deviations():
    mean_gaps, scale_gaps = cases.expected(cases.SHIFTS)
    ranks = run_world(2, cases.gap_rank, True, timeout=120)
    for result in ranks:
        for rank in range(2):
            for channel in range(cases.C):
                assert result["mean_gaps"][rank][channel] == pytest.approx(mean_gaps[rank][channel], abs=1e-12)
                assert result["scale_gaps"][rank][channel] == pytest.approx(scale_gaps[channel], abs=1e-12)
        layer = result["summary"]["layers"][0]
        assert layer["samples_per_rank"] == [cases.N, cases.N] and layer["noise"] == 1 / math.sqrt(2 * cases.N)
        assert layer["values_per_channel_per_rank"] == [cases.N * cases.H * cases.W] * 2
        assert layer["mean_gap"]["max"] == pytest.approx(max(abs(v) for row in mean_gaps for v in row), abs=1e-12)
    assert ranks[0]["summary"] == ranks[1]["summary"]  # every rank computes the same numbers


@pytest.mark.distributed
def test_the_python_api_records_for_a_script_that_converts_itself(tmp_path):
    """bnsurgeon.record_sync_gaps: every rank has the same document, rank 0 alone writes it (and its picture)."""
    path = tmp_path / "gaps.json"
    documents = run_world(2, cases.api_rank, str(path), timeout=120)
    assert documents[0] == documents[1] and documents[0]["steps"] == 2
    assert json.loads(path.read_text())["layers"] == documents[0]["layers"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gaps.html", "gaps.json"]


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.links += [value for name, value in attrs if name in ("href", "src") and value]


def _launch(work: Path, *options: str, steps: int = 3, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("BNSURGEON_", "PYTHONPATH"))}
    environment.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", **(env or {}))
    command = torchrun("-m", "bnsurgeon", "run", *options, "train.py", str(steps))
    return subprocess.run(command, cwd=work, env=environment, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    work = tmp_path_factory.mktemp("gaps")
    shutil.copy(CASES, work / "train.py")
    done = _launch(work, "--stats", "gaps.json", "--stats-steps", "2", steps=3)
    assert done.returncode == 0, done.stderr[-3000:]
    return work, done.stderr


@pytest.mark.distributed
def test_run_stats_writes_the_closed_form_gaps_its_picture_and_one_verdict_line(launched):
    work, stderr = launched
    document = json.loads((work / "gaps.json").read_text())
    mean_gaps, _ = cases.expected(cases.SHIFTS)
    assert document["kind"] == "bnsurgeon sync gaps" and document["world_size"] == 2 and document["steps"] == 2
    (layer,) = document["layers"]
    assert layer["name"] == "Sequential.1" and layer["calls"] == 2
    largest = max(abs(value) for row in mean_gaps for value in row)
    assert layer["mean_gap"]["max"] == pytest.approx(largest, abs=1e-12)
    every = sorted(abs(value) for row in mean_gaps for value in row)  # the same each call: the median of one call's
    assert document["mean_gap"]["median"] == pytest.approx(every[(len(every) - 1) // 2], abs=1e-12)
    assert document["verdict"]["sync_matters"] is (document["mean_gap"]["median"] > document["noise"])
    lines = [line for line in stderr.splitlines() if "sync changed batch means" in line]
    assert len(lines) == 1 and "at 4 samples per rank" in lines[0] and "gaps.html" in lines[0], stderr[-2000:]
    page = (work / "gaps.html").read_text()
    parser = _Tags()
    parser.feed(page)
    assert parser.tags.count("svg") == 2 and parser.tags.count("circle") == 2 * 2  # a dot per rank, layer, chart
    assert (
        parser.links == []
        and "<script" not in page
        and "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    )


@pytest.mark.distributed
def test_a_run_shorter_than_the_steps_writes_at_exit(tmp_path):
    """The script ends after 1 step of the 5 asked for: the document holds that step, written as the process
    exits."""
    shutil.copy(CASES, tmp_path / "train.py")
    done = _launch(tmp_path, "--stats", "gaps.json", "--stats-steps", "5", steps=1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "gaps.json").read_text())["steps"] == 1


def test_stats_follows_the_report_rules(tmp_path, monkeypatch, capsys):
    """A file that is not bnsurgeon's is never replaced (--force or not), an earlier document is replaced only with
    --force, and --stats and --report may not name the same file; each refused before the script runs (exit 8)."""
    from bnsurgeon.launch.script import put_back

    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("open('ran', 'w').write('yes')\n")
    (tmp_path / "mine.json").write_text('{"my": "data"}\n')
    runner = CliRunner()
    for force in ([], ["--force"]):
        result = runner.invoke(app, ["run", "--stats", "mine.json", *force, str(script)])
        put_back()
        assert result.exit_code == 8 and "not a bnsurgeon sync-gap document" in result.output, result.output
    assert (tmp_path / "mine.json").read_text() == '{"my": "data"}\n' and not (tmp_path / "ran").exists()
    result = runner.invoke(app, ["run", "--stats", "same.json", "--report", "same.json", str(script)])
    put_back()
    assert result.exit_code == 8 and "name the same file" in result.output, result.output
    result = runner.invoke(app, ["run", "--stats", "gaps.json", str(script)])
    put_back()  # one process, no group: nothing recorded, nothing written, and said as the run ends
    assert result.exit_code == 0 and "wrote no sync-gap document" in capsys.readouterr().err, result.output
    assert not list(tmp_path.glob("gaps*"))
    earlier = '{"kind": "bnsurgeon sync gaps", "layers": []}\n'  # an earlier run's document
    (tmp_path / "gaps.json").write_text(earlier)
    result = runner.invoke(app, ["run", "--stats", "gaps.json", str(script)])
    put_back()
    assert result.exit_code == 8 and "already exists" in result.output and "--force" in result.output
    assert (tmp_path / "gaps.json").read_text() == earlier
    result = runner.invoke(app, ["run", "--stats", "gaps.json", "--force", str(script)])
    put_back()
    assert result.exit_code == 0 and not list(tmp_path.glob("gaps*"))  # replaced: removed before the script ran


@pytest.mark.parametrize("option", [["--stats-steps", "3"], ["--stats-layers", "layer1.*"]])
def test_the_stats_options_without_stats_are_a_usage_error(tmp_path, monkeypatch, option):
    """--stats-steps or --stats-layers alone would record nothing, silently: refused before the script runs."""
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("open('ran', 'w').write('yes')\n")
    result = CliRunner().invoke(app, ["run", *option, str(script)])
    assert result.exit_code == 2 and "add --stats PATH" in result.output, result.output
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_layer_pattern_that_matches_nothing_is_said_once_naming_the_layers(monkeypatch, capsys, tmp_path, rank):
    """Layers trained but --stats-layers selected none of them: rank 0 names them (not 'no sync layer trained'),
    the other ranks say nothing, and no file is written."""
    import torch
    import torch.distributed as dist

    from bnsurgeon.launch.gaps import GapOutput
    from bnsurgeon.runtime.gaps import GapRecorder

    monkeypatch.setattr(dist, "get_rank", lambda *args, **kwargs: rank)
    recorder = GapRecorder(steps=2, layers=["Net.*"])
    rows, row = torch.zeros(2, 3), torch.zeros(3)
    for _step in range(2):
        for token, name in enumerate(["Sequential.1", "Sequential.3"]):
            identity = type("Identity", (), {"token": token, "name": name})()
            recorder.record(identity, torch.ones(2), rows, rows, row, row, 1e-5, (4, 3, 8, 8))
    assert recorder.layers == {} and list(recorder.passed_over) == ["Sequential.1", "Sequential.3"]
    assert GapOutput(tmp_path / "gaps.json", "test", ["Net.*"]).complete(recorder) is None
    said = capsys.readouterr().err
    if rank == 0:
        assert said.count("\n") == 1 and "--stats-layers Net.* matched none" in said, said
        assert "(Sequential.1, Sequential.3)" in said and "no sync layer trained" not in said, said
    else:
        assert said == ""
    assert list(tmp_path.iterdir()) == []


def test_the_device_paths_rows_give_the_same_gaps_as_the_eager_paths():
    """The device path gathers 1 / sqrt(var + eps) where the eager path gathers the variance: the same statistics
    in either form give the same gaps (float64, to round-off), shifted and rescaled ranks included."""
    import torch

    from bnsurgeon.runtime.gaps import Call, LayerGaps

    generator = torch.Generator().manual_seed(0)
    means = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    variances = torch.rand(3, 5, generator=generator, dtype=torch.float64) * 4 + 0.1
    counts = torch.tensor([8.0, 0.0, 12.0], dtype=torch.float64)  # rank 1 empty: NaN in both
    mean = (means * counts[:, None]).sum(0) / counts.sum()
    var = variances.mean(0) + 0.5
    eps = 1e-5
    as_variance = LayerGaps("bn", 0, 5, 4, 1, [Call(counts, means, variances, mean, var, eps, invstd=False)])
    invstds, invstd = (variances + eps).rsqrt(), (var + eps).rsqrt()
    as_invstd = LayerGaps("bn", 0, 5, 4, 1, [Call(counts, means, invstds, mean, invstd, eps, invstd=True)])
    for got, want in zip(as_invstd.gaps(), as_variance.gaps()):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
        assert got[0, 1].isnan().all() and not got[0, 0].isnan().any()
    expected_mean_gap = (means[2] - mean) / (var + eps).sqrt()
    torch.testing.assert_close(as_invstd.gaps()[0][0, 2], expected_mean_gap, rtol=1e-12, atol=1e-12)


def test_the_device_path_records_its_rows(monkeypatch):
    """A layer on the device path (the strict stand-ins of its CUDA kernels, two ranks holding the same batch)
    feeds the recorder with its gathered rows: gaps of exactly 0, each rank's count, one call per forward."""
    import _cuda_standin
    import torch
    import torch.distributed as dist

    from bnsurgeon.runtime import gaps, sync_function
    from bnsurgeon.runtime.layers import SyncBatchNorm

    for name in _cuda_standin.KERNELS:
        monkeypatch.setattr(torch, name, getattr(_cuda_standin, name))
    monkeypatch.setattr(sync_function, "uses_device_path", lambda x: True)
    monkeypatch.setattr(sync_function, "counts_on_host", lambda x: False)
    monkeypatch.setattr(SyncBatchNorm, "_sync_group", lambda self: (None, 2))
    monkeypatch.setattr(dist, "get_rank", lambda *args, **kwargs: 0)
    _cuda_standin.identical_ranks(monkeypatch)
    layer = SyncBatchNorm(3).train()
    layer.layer_name = "bn"  # named, as a converted model's layers are (no group to number it in)
    recorder = gaps.GapRecorder(steps=5)
    gaps.start_recording(recorder)
    try:
        for _ in range(2):
            layer(torch.randn(4, 3, 5, 5)).sum().backward()
    finally:
        gaps.stop_recording(recorder)
    (recorded,) = recorder.layers.values()
    assert len(recorded.calls) == 2 and all(call.invstd for call in recorded.calls)
    mean_gaps, scale_gaps = recorded.gaps()
    assert mean_gaps.shape == (2, 2, 3) and bool((mean_gaps == 0).all()) and bool((scale_gaps.abs() < 1e-6).all())
    assert recorded.counts().tolist() == [[100.0, 100.0]] * 2
