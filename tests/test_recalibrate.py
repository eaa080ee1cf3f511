"""bnsurgeon.recalibrate: exact population BN statistics, one process and N gloo ranks.

Every expected value is computed here, independently, from the activations themselves
(captured with forward pre-hooks in float64), never hard-coded.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import bnsurgeon
from bnsurgeon.checks.multiproc import RankPool
from tests import _recalibrate_cases as cases


@contextlib.contextmanager
def one_thread():
    """The ranks compute with one thread each; a reference that must match them bit for bit does too
    (a different thread split may change a float32 sum's last bit)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def closed_form(activations: list[torch.Tensor]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(n, mean, population var) per channel of every activation concatenated, in float64."""
    flat = torch.cat([a.to(torch.float64).transpose(0, 1).reshape(a.shape[1], -1) for a in activations], 1)
    return flat.shape[1], flat.mean(1), flat.var(1, unbiased=False)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp(min=1e-300)).max())


#: float32's unit roundoff
U32 = 2.0**-24


def float32_bound(mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The error a float32 model's statistics may have against the float64 truth (README, "Recalibrate BN
    statistics"): what rounding each activation once more to float32 can do to them, with a small constant.
    |d mean| <= 4u (|mean| + std); |d var| <= 32u var + 4u |mean| std + 4 (u mean)^2. E[x^2] - E[x]^2 in
    float32 is off by about u mean^2, far outside it once |mean| >> std."""
    std, size = var.sqrt(), mean.abs()
    return 4 * U32 * (size + std), 32 * U32 * var + 4 * U32 * size * std + 4 * (U32 * size).square()


def assert_population(statistics, seen, rtol=None):
    """The statistics against the closed form of the activations: within ``float32_bound`` (a float32
    model), or to ``rtol`` (a float64 model, or a reference that is itself off by more)."""
    for path, activations in seen.items():
        n, mean, var = closed_form(activations)
        got_n, got_mean, got_var = statistics[path]
        assert got_n == n, path
        if rtol is not None:
            assert relative(got_mean, mean) < rtol, (path, relative(got_mean, mean))
            assert relative(got_var, var) < rtol, (path, relative(got_var, var))
            continue
        mean_bound, var_bound = float32_bound(mean, var)
        assert bool(((got_mean - mean).abs() <= mean_bound).all()), (
            path,
            float(((got_mean - mean).abs() / mean_bound).max()),
        )
        assert bool(((got_var - var).abs() <= var_bound).all()), (
            path,
            float(((got_var - var).abs() / var_bound).max()),
        )


@pytest.mark.parametrize(
    "fast",
    [False, True, "eval-everywhere"],
    ids=["training-mode", "fast-normalization", "fast-normalization-eval-everywhere"],
)
def test_one_process_closed_form_and_state(fast, monkeypatch):
    if fast == "eval-everywhere":  # these inputs are small: without this they would run the training kernel
        import bnsurgeon.calibration.recalibrate as recalibration

        monkeypatch.setattr(recalibration, "SMALL_FOR_TRAINING_KERNEL", 0)
    model = cases.make_model()
    before = cases.buffers(model)
    model.train()
    model[3].training = False  # a mixed set of flags, restored exactly
    model[1].momentum = None  # a cumulative average: its momentum comes back as it was
    flags = [m.training for m in model.modules()]
    seen = cases.capture(model)  # the BN inputs of the recalibration pass itself, in float64
    data = cases.shard(0, (5,)) + cases.shard(1, (0, 3))
    torch.set_grad_enabled(True)
    report = bnsurgeon.recalibrate(model, data, fast_normalization=fast)
    assert torch.is_grad_enabled()
    assert [m.training for m in model.modules()] == flags
    assert model[1].momentum is None and model[5].momentum == 0.1
    assert_population(report.statistics, seen)
    # the pass normalises as training does: a reference with BN in train mode and everything else in eval
    # sees the same BN inputs (bit for bit; with fast_normalization to float32 rounding)
    reference = cases.make_model()
    trained = cases.capture(reference)
    reference.eval()
    for path in cases.BN_PATHS:
        reference.get_submodule(path).training = True
    with torch.no_grad():
        for x in data:
            reference(x)
    for path in cases.BN_PATHS:
        for got, expected in zip(seen[path], trained[path]):
            assert torch.equal(got, expected) if not fast else torch.allclose(got, expected, rtol=1e-5, atol=1e-5), path
    assert_population(report.statistics, trained, rtol=1e-6 if fast else None)
    assert not torch.allclose(seen["9"][0], cases.make_model()[:9].eval()(data[0]).double(), rtol=1e-3)  # not eval
    after = cases.buffers(model)
    for key, value in before.items():
        module_path, name = key.rsplit(".", 1)
        if module_path in cases.BN_PATHS and name in ("running_mean", "running_var"):
            n, mean, var = closed_form(seen[module_path])
            mean_bound, var_bound = float32_bound(mean, var)
            expected, bound = (
                (mean, mean_bound) if name == "running_mean" else (var * n / (n - 1), var_bound * n / (n - 1))
            )
            # within the bound, then rounded once to the buffer's float32
            assert bool(((after[key].double() - expected).abs() <= bound + U32 * expected.abs()).all()), key
            assert not torch.equal(after[key], value), key
        else:  # weights, num_batches_tracked: byte-identical
            assert torch.equal(after[key], value), key
    assert report.batches == 8 and report.samples == sum(len(x) for x in data)
    assert report.collectives == 0 and report.unreached == []
    assert [m.path for m in report.modules] == list(cases.BN_PATHS)
    assert all(m.calls == 8 and m.mean_change_max > 0 for m in report.modules)
    for m in report.modules:  # the report's changes are those of the buffers
        mean_change = float(
            (after[f"{m.path}.running_mean"].double() - before[f"{m.path}.running_mean"].double()).abs().max()
        )
        var_change = float(
            (after[f"{m.path}.running_var"].double() - before[f"{m.path}.running_var"].double()).abs().max()
        )
        assert abs(m.mean_change_max - mean_change) <= 1e-6 * mean_change, m.path
        assert abs(m.var_change_max - var_change) <= 1e-6 * var_change, m.path


def offset_batches(layout: str) -> list[torch.Tensor]:
    """|mean| >> std: 1e4 + N(0, 0.37^2) per channel, each batch shifted by a few std (so the between-batch
    term of the merge counts), one channel at -3e3 + N(0, 0.01^2)."""
    generator = torch.Generator().manual_seed(11)
    batches = []
    for index, size in enumerate((7, 2, 13, 4)):
        shape = (size, 4) if layout == "nc" else (size, 4, 9, 7)
        x = torch.randn(shape, generator=generator, dtype=torch.float64) * 0.37 + 1e4 + 0.5 * index
        x[:, 3] = x[:, 3] * 0.01 / 0.37 - 3e3 - 1e4 * 0.01 / 0.37
        x = x.float()
        batches.append(x.contiguous(memory_format=torch.channels_last) if layout == "channels-last" else x)
    return batches


@pytest.mark.parametrize("layout", ["nchw", "channels-last", "nc"])
@pytest.mark.parametrize(
    "fast",
    [False, True, "eval-everywhere"],
    ids=["training-mode", "fast-normalization", "fast-normalization-eval-everywhere"],
)
def test_float32_within_its_bound_when_mean_dwarfs_std(layout, fast, monkeypatch):
    """A float32 model's statistics against the float64 truth when |mean| >> std: within ``float32_bound``,
    for every path a batch's statistics take (the training kernel's, bnsurgeon's own in float32), while
    E[x^2] - E[x]^2 in float32 lands far outside it."""
    if fast == "eval-everywhere":
        import bnsurgeon.calibration.recalibrate as recalibration

        monkeypatch.setattr(recalibration, "SMALL_FOR_TRAINING_KERNEL", 0)
    data = offset_batches(layout)
    bn = nn.BatchNorm1d(4) if layout == "nc" else nn.BatchNorm2d(4)
    report = bnsurgeon.recalibrate(nn.Sequential(bn), data, fast_normalization=fast)
    assert_population(report.statistics, {"0": data})
    n, mean, var = closed_form(data)
    mean_bound, var_bound = float32_bound(mean, var)
    unbiased = var * n / (n - 1)
    assert bool(((bn.running_var.double() - unbiased).abs() <= var_bound * n / (n - 1) + U32 * unbiased).all())
    assert bool(((bn.running_mean.double() - mean).abs() <= mean_bound + U32 * mean.abs()).all())
    dims = [0, *range(2, data[0].dim())]
    flat = torch.cat([x.contiguous() for x in data])
    cancelled = flat.square().mean(dims) - flat.mean(dims).square()  # float32, as the bound must rule out
    assert bool(((cancelled.double() - var).abs() > var_bound).any())


@pytest.mark.parametrize(
    "fast",
    [False, True, "eval-everywhere"],
    ids=["training-mode", "fast-normalization", "fast-normalization-eval-everywhere"],
)
def test_float64_model_equals_the_closed_form(fast, monkeypatch):
    """A float64 model and data: the statistics and the buffers equal the closed-form float64 population
    statistics of the pass's own BN inputs to 1e-9, for every kind of BN input (conv, BatchNormAct2d, linear)."""
    if fast == "eval-everywhere":
        import bnsurgeon.calibration.recalibrate as recalibration

        monkeypatch.setattr(recalibration, "SMALL_FOR_TRAINING_KERNEL", 0)
    model = cases.make_model().double()
    seen = cases.capture(model)
    data = [x.double() * 100 + 1e3 for x in cases.shard(0, (5,))]
    report = bnsurgeon.recalibrate(model, data, fast_normalization=fast)
    assert_population(report.statistics, seen, rtol=1e-9)
    for path in cases.BN_PATHS:
        n, mean, var = closed_form(seen[path])
        module = model.get_submodule(path)
        assert module.running_mean.dtype == torch.float64
        assert relative(module.running_mean, mean) < 1e-9 and relative(module.running_var, var * n / (n - 1)) < 1e-9


def test_batch_moments_float32_bound_every_layout():
    """bnsurgeon's own per-batch moments (float32, two passes) against float64, one large batch per layout."""
    from bnsurgeon.calibration.statistics import batch_moments

    generator = torch.Generator().manual_seed(5)
    exact = torch.randn(16, 6, 20, 20, generator=generator, dtype=torch.float64) * 0.3 + 2e4
    exact[:, 1] = exact[:, 1] - 2e4 + 1.5  # an ordinary channel next to the offset ones
    x = exact.float()
    for tensor in (
        x,
        x.contiguous(memory_format=torch.channels_last),
        x[:, :, :3, :2].contiguous(),
        x.transpose(1, 3).reshape(-1, 6),
    ):
        count, mean, m2 = batch_moments(tensor)
        truth = tensor.double()
        dims = [0, *range(2, tensor.dim())]
        true_mean = truth.mean(dims)
        true_var = truth.var(dims, unbiased=False)
        mean_bound, var_bound = float32_bound(true_mean, true_var)
        assert count == truth.numel() // 6
        assert bool(((mean - true_mean).abs() <= mean_bound).all()), tuple(tensor.shape)
        assert bool(((m2 / count - true_var).abs() <= var_bound).all()), tuple(tensor.shape)


def test_shared_module_called_twice_and_unreached_and_frozen():
    from torchvision.ops.misc import FrozenBatchNorm2d

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)
            self.shared = nn.BatchNorm2d(3)
            self.unused = nn.BatchNorm2d(3)
            self.frozen = FrozenBatchNorm2d(3)

        def forward(self, x):
            return self.frozen(self.shared(self.conv(self.shared(x))))

    torch.manual_seed(0)
    net = Net()
    before = cases.buffers(net)
    seen = {"shared": []}
    net.shared.register_forward_pre_hook(lambda m, a: seen["shared"].append(a[0].double().clone()))
    data = [torch.randn(2, 3, 5, 5) * 3 - 7 for _ in range(3)]
    report = bnsurgeon.recalibrate(net, data)
    assert_population(report.statistics, seen)
    assert report.unreached == ["unused"] and report.called_several_times == ["shared"]
    assert [s["path"] for s in report.skipped] == ["frozen"]
    for key in before:
        if not key.startswith("shared.running_"):
            assert torch.equal(before[key], net.state_dict()[key]), key
    report = bnsurgeon.recalibrate(net, data, include_frozen=True)
    assert "frozen" in [m.path for m in report.modules]
    assert not torch.equal(before["frozen.running_mean"], net.frozen.running_mean)


@pytest.fixture(scope="module")
def ranks():
    """Three gloo rank processes, started once for every multi-rank test here (imports paid once)."""
    with RankPool(3, collective_timeout=150) as pool:  # a hang detector: as long as a run may take
        yield pool


def check_world(pool: RankPool, world: int, counts: tuple[int, ...]):
    results = pool.run(world, cases.rank_plain_and_sync, counts, timeout=150)
    # plain model under DDP: each rank normalises its own batches; one process runs them all in rank order
    reference = cases.make_model()
    seen = cases.capture(reference)
    with one_thread():
        one = bnsurgeon.recalibrate(reference, [x for rank in range(world) for x in cases.shard(rank, counts)])
    expected = cases.buffers(reference)
    for rank, result in enumerate(results):
        plain = result["plain"]
        assert plain["collectives"] == 1  # one all_gather for the whole pass
        assert plain["rank_batches"] == list(counts)
        assert plain["batches"] == sum(counts) and plain["samples"] == one.samples
        for path in cases.BN_PATHS:
            n, mean, var = one.statistics[path]
            got_n, got_mean, got_var = plain["statistics"][path]
            assert got_n == n and relative(got_mean, mean) < 1e-12 and relative(got_var, var) < 1e-12, (rank, path)
        for key, value in expected.items():
            # float32 storage of statistics that agree to float64 round-off: equal, or one float32 step apart
            assert torch.allclose(plain["buffers"][key], value, rtol=2.5e-7, atol=0), (rank, key)
            assert torch.equal(plain["buffers"][key], results[0]["plain"]["buffers"][key]), (rank, key)  # every rank
        assert_population(plain["statistics"], seen)
        # what the ranks themselves saw, concatenated: the closed form
        assert_population(
            plain["statistics"], {p: [a for r in results for a in r["plain"]["seen"][p]] for p in cases.BN_PATHS}
        )
    # sync-converted: each step normalises the global batch (the union of the ranks' step batches)
    union = cases.global_batch_reference(counts)
    for rank, result in enumerate(results):
        sync = result["sync"]
        assert sync["rank_batches"] == list(counts)
        assert sync["collectives"] == max(counts) + 1 + 1  # a step header per step (+ the last, empty), one merge
        assert_population(
            sync["statistics"],
            {p: [a for r in results for a in r["sync"]["seen"][p] if a.numel()] for p in cases.BN_PATHS},
        )
        for key, value in sync["buffers"].items():
            assert torch.equal(value, results[0]["sync"]["buffers"][key]), (rank, key)
        # against one process normalising the same global batches (its normalisation is float32: 1e-5)
        assert_population(sync["statistics"], union, rtol=1e-5)
    # and the two normalisations really differ (the test would notice a sync model normalising locally)
    assert relative(results[0]["sync"]["statistics"]["9"][2], results[0]["plain"]["statistics"]["9"][2]) > 1e-3


@pytest.mark.parametrize("world,counts", [(2, (3, 1)), (3, (2, 0, 3))])
def test_ranks_equal_one_process(ranks, world, counts):
    """Uneven shards (one rank with none), a different image size per rank: N ranks = one process."""
    check_world(ranks, world, counts)


CLI_MODEL = """
import torch
from torch import nn


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2))
"""


def test_cli_under_torchrun_shards_and_rank_zero_writes(ranks, tmp_path):
    """RANK/WORLD_SIZE set: 3 ranks read batches i % 3 of 7 (20 samples cut into batches of 3: the last
    holds 2; rank 0 gets 3), only rank 0 writes, and the file equals a one-process run."""
    from safetensors.torch import load_file

    (tmp_path / "rcli.py").write_text(CLI_MODEL)
    torch.save(torch.randn(20, 3, 7, 7, generator=torch.Generator().manual_seed(9)) + 4, tmp_path / "d.pt")
    results = ranks.run(
        3,
        cases.rank_cli,
        "rcli:small",
        str(tmp_path / "d.pt"),
        str(tmp_path / "n.safetensors"),
        str(tmp_path),
        timeout=120,
    )
    assert [r["output"] for r in results] == [str(tmp_path / "n.safetensors"), None, None]
    assert all(r["rank_batches"] == [3, 2, 2] and r["samples"] == 20 for r in results)
    assert len({r["sha256"] for r in results}) == 1
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        from bnsurgeon.pipeline import recalibrate_source

        with one_thread():
            one = recalibrate_source("rcli:small", str(tmp_path / "d.pt"), tmp_path / "one.safetensors", batch_size=3)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("rcli", None)
    assert one.report.data["sha256"] == results[0]["sha256"]
    for path, (n, mean, var) in one.report.statistics.items():
        got_n, got_mean, got_var = results[0]["statistics"][path]
        assert got_n == n and relative(got_mean, mean) < 1e-12 and relative(got_var, var) < 1e-12
    written, expected = load_file(tmp_path / "n.safetensors"), load_file(tmp_path / "one.safetensors")
    assert set(written) == set(expected)
    for key in expected:
        assert torch.allclose(written[key], expected[key], rtol=2.5e-7, atol=0), key


# the command line -------------------------------------------------------------------------------

import argparse  # noqa: E402
import json  # noqa: E402

from typer.testing import CliRunner  # noqa: E402

from bnsurgeon.cli.commands import app  # noqa: E402
from bnsurgeon.files.torch_pickle import load_weights_only  # noqa: E402

runner = CliRunner()
SIDE = 32


def run(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def listing(directory):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir() if p.name != "__pycache__"}


def timm_training_checkpoint(path):
    """A timm train.py checkpoint: arch, args (a Namespace), weights, EMA weights (whose BN buffers are the
    averages EMA leaves: not this model's), SGD state with momentum, epoch, metric."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("test_efficientnet", pretrained=False, num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3, SIDE, SIDE)).sum().backward()
    optimizer.step()
    ema = {k: (v.clone() * 0.9 + 0.01 if v.is_floating_point() else v.clone()) for k, v in model.state_dict().items()}
    entries = {
        "epoch": 3,
        "arch": "test_efficientnet",
        "args": argparse.Namespace(num_classes=10, lr=0.1),
        "state_dict": model.state_dict(),
        "state_dict_ema": ema,
        "optimizer": optimizer.state_dict(),
        "metric": 0.5,
    }
    torch.save(entries, path)
    return entries


def same(a, b) -> bool:
    """Equal all the way down: tensors by torch.equal (values, dtype, shape), containers entry by entry."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, argparse.Namespace):
        return vars(a) == vars(b)
    return a == b


def test_cli_ema_training_checkpoint_only_ema_bn_buffers_change(tmp_path):
    import timm

    source = tmp_path / "last.pth.tar"
    entries = timm_training_checkpoint(source)
    data = torch.randn(20, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(5)) * 1.5 + 0.2
    torch.save(data, tmp_path / "calib.pt")
    out = tmp_path / "last.recal.pth.tar"
    result = run(
        "recalibrate",
        source,
        "--weights",
        "state_dict_ema",
        "--data",
        tmp_path / "calib.pt",
        "--batch-size",
        8,
        "-o",
        out,
        "--json",
        "-q",
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["samples"] == 20 and report["batches"] == 3 and report["ranks"] == 1

    # the expected EMA statistics: the API on a model holding the EMA weights, the same three batches
    reference = timm.create_model("test_efficientnet", pretrained=False, num_classes=10)
    reference.load_state_dict(entries["state_dict_ema"])
    expected = bnsurgeon.recalibrate(reference, list(data.split(8)))
    changed = {f"{m.path}.{name}" for m in expected.modules for name in ("running_mean", "running_var")}
    assert len(changed) == 2 * len([m for m in reference.modules() if isinstance(m, nn.BatchNorm2d)])

    written = load_weights_only(out, also_allowed=[argparse.Namespace])  # torch's weights_only load, as on input
    assert list(written)[: len(entries)] == list(entries)
    for name, value in entries.items():  # every entry but the EMA: identical, all the way down
        if name != "state_dict_ema":
            assert same(written[name], value), name
    ema = written["state_dict_ema"]
    assert list(ema) == list(entries["state_dict_ema"])
    for key, value in entries["state_dict_ema"].items():
        if key in changed:
            assert ema[key].dtype == value.dtype and not torch.equal(ema[key], value), key
            assert torch.equal(ema[key], reference.state_dict()[key]), key
        else:  # weights, num_batches_tracked: untouched
            assert torch.equal(ema[key], value), key
    record = written["bnsurgeon_recalibrations"][-1]
    assert record["weights"] == "state_dict_ema" and record["samples"] == 20 and record["batches"] == 3
    assert record["ranks"] == 1 and len(record["data"]["sha256"]) == 64
    assert (
        json.loads((tmp_path / "last.recal.pth.tar.report.json").read_text())["data"]["sha256"]
        == record["data"]["sha256"]
    )


DATA_MODELS = '''
import torch
from torch import nn


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2))


class Bypass(nn.Module):
    """Its BN sits on a branch the forward never takes."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.conv(x)


def bypass():
    torch.manual_seed(0)
    return Bypass()


def pairs():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, 3, 9, 9, generator=g), torch.zeros(3)) for _ in range(4)]
'''


@pytest.fixture
def data_models(tmp_path, monkeypatch):
    from _modules import install_module

    return install_module(tmp_path, monkeypatch, "rmodels", DATA_MODELS)


def test_cli_function_data_and_reports(data_models):
    tmp = data_models
    out = tmp / "small.safetensors"
    result = run("recalibrate", "rmodels:small", "--data", "rmodels:pairs", "--samples", 10, "-o", out)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp / "small.safetensors.report.json").read_text())
    assert report["samples"] == 10 and report["batches"] == 4  # the last batch cut to one sample
    from safetensors.torch import load_file

    written = load_file(out)
    expected_model = __import__("rmodels").small()
    batches = [x for x, _ in __import__("rmodels").pairs()]
    bnsurgeon.recalibrate(expected_model, batches[:3] + [batches[3][:1]])
    for key, value in expected_model.state_dict().items():
        assert torch.equal(written[key], value), key


@pytest.mark.parametrize(
    "case", ["empty", "short", "shape", "nan", "unreached", "integers", "pickle", "missing", "too-large"]
)
def test_cli_bad_data_one_line_own_code_nothing_written(data_models, case, monkeypatch):
    tmp = data_models
    data = tmp / "data.pt"
    source, extra = "rmodels:small", []
    code, message = {
        "empty": (12, "holds no batch"),
        "short": (13, "holds 6 samples in 3 batches, fewer than the 10 samples asked for"),
        "shape": (9, "cannot run on batch 0 of shape (2, 5, 8, 8)"),
        "nan": (14, "the input of 1 held NaN or Inf"),
        "unreached": (15, "never called any of the model's 1 tracked BN module"),
        "integers": (12, "is a uint8 tensor"),
        "pickle": (12, "would run code"),
        "missing": (12, "is no file, folder or package.module:function"),
        "too-large": (12, "is a batch of 3,072 bytes, more than 1,000 bytes (BNSURGEON_MAX_BATCH_BYTES)"),
    }[case]
    if case == "empty":
        torch.save(torch.zeros(0, 3, 8, 8), data)
    elif case == "short":
        torch.save([torch.randn(2, 3, 8, 8) for _ in range(3)], data)
        extra = ["--samples", 10]
    elif case == "shape":
        torch.save(torch.randn(2, 5, 8, 8), data)
    elif case == "nan":
        x = torch.randn(4, 3, 8, 8)
        x[1, 0, 2, 2] = float("nan")
        torch.save(x, data)
    elif case == "unreached":
        torch.save(torch.randn(4, 3, 8, 8), data)
        source = "rmodels:bypass"
    elif case == "integers":
        torch.save(torch.zeros(4, 3, 8, 8, dtype=torch.uint8), data)
    elif case == "pickle":

        class Evil:
            def __reduce__(self):
                import os

                return (os.system, (f"touch {tmp / 'pwned'}",))

        torch.save([torch.randn(2, 3, 8, 8), Evil()], data)
    elif case == "missing":
        data = tmp / "nowhere"
    elif case == "too-large":  # a file's batch bounded before the model sees it (the bound made small here)
        import bnsurgeon.loading.data as reading

        monkeypatch.setattr(reading, "MAX_BATCH_BYTES", 1000)
        torch.save([torch.randn(4, 3, 8, 8)], data)
    before = listing(tmp)
    result = run("recalibrate", source, "--data", data, "-o", tmp / "out.safetensors", *extra)
    assert result.exit_code == code, result.output
    assert message in result.output, result.output
    assert "Traceback" not in result.output
    assert result.output.count("error:") == 1 and len(result.output.strip().splitlines()) <= 3, result.output
    assert listing(tmp) == before
    assert not (tmp / "pwned").exists()


# in training ------------------------------------------------------------------------------------


def test_recalibrate_averaged_unwraps_torch_and_timm_averages():
    from timm.utils import ModelEmaV3
    from torch.optim.swa_utils import AveragedModel

    data = cases.shard(0, (3,))
    for wrap in (AveragedModel, lambda m: ModelEmaV3(m, decay=0.9)):
        averaged = wrap(cases.make_model())
        expected = copy.deepcopy(averaged.module)
        seen = cases.capture(expected)
        expected_report = bnsurgeon.recalibrate(expected, data)
        report = bnsurgeon.recalibrate_averaged(averaged, data)
        assert_population(report.statistics, seen)
        assert [m.path for m in report.modules] == [m.path for m in expected_report.modules]
        for key, value in expected.state_dict().items():
            assert torch.equal(averaged.module.state_dict()[key], value), key


LIGHTNING_MODULE = """
import torch
import lightning.pytorch as pl
from timm.utils import ModelEmaV3
from torch.utils.data import DataLoader, TensorDataset

from tests import _recalibrate_cases as cases


class WithEma(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = cases.make_model()
        self.ema = ModelEmaV3(self.net, decay=0.5)

    def training_step(self, batch, index):
        return self.net(batch[0]).square().mean()

    def on_train_batch_end(self, *args):
        self.ema.update(self.net)

    def validation_step(self, batch, index):
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 3, 8, 8)), batch_size=4)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(4, 3, 8, 8)), batch_size=4)
"""


def test_lightning_callback_recalibrates_the_ema_before_validation_and_at_fit_end(tmp_path, monkeypatch):
    pl = pytest.importorskip("lightning.pytorch")
    from _modules import install_module

    from bnsurgeon.integrations.lightning import RecalibrateBN

    install_module(tmp_path, monkeypatch, "lit_ema", LIGHTNING_MODULE)
    import lit_ema

    torch.manual_seed(0)
    module = lit_ema.WithEma()
    data = cases.shard(1, (0, 3))
    calls = []
    callback = RecalibrateBN(data, model="ema")
    original = callback.recalibrate
    callback.recalibrate = lambda trainer, pl_module: calls.append(trainer.state.stage) or original(trainer, pl_module)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[callback],
    )
    trainer.fit(module)
    assert len(calls) == 2  # before the validation, and at the end of fit
    expected = copy.deepcopy(module.ema.module)
    bnsurgeon.recalibrate(expected, data)  # the same pass again: the same statistics
    for key, value in expected.state_dict().items():
        assert torch.equal(module.ema.module.state_dict()[key], value), key
    assert callback.report.samples == sum(len(x) for x in data)
    raw = {k: v for k, v in module.net.state_dict().items() if "running" in k}
    assert any(not torch.equal(raw[k], v) for k, v in expected.state_dict().items() if k in raw)


def test_cli_image_folder_through_the_models_preprocessing(data_models):
    """Images (any depth, path order) read with Pillow through timm's data config of the model."""
    from PIL import Image
    from safetensors.torch import load_file
    from timm.data import create_transform, resolve_data_config

    tmp = data_models
    folder = tmp / "images"
    (folder / "b").mkdir(parents=True)
    generator = torch.Generator().manual_seed(4)
    paths = [folder / "a.png", folder / "b" / "c.jpg", folder / "b" / "d.png"]
    for index, path in enumerate(paths):
        pixels = (torch.rand(40 + 8 * index, 50, 3, generator=generator) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(path)
    out = tmp / "img.safetensors"
    result = run("recalibrate", "rmodels:small", "--data", folder, "--batch-size", 2, "-o", out)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp / "img.safetensors.report.json").read_text())
    assert report["samples"] == 3 and report["batches"] == 2 and report["data"]["kind"] == "image-folder"
    model = __import__("rmodels").small()
    transform = create_transform(**resolve_data_config({}, model=model), is_training=False)
    images = []
    for path in paths:
        with Image.open(path) as image:
            images.append(transform(image.convert("RGB")))
    bnsurgeon.recalibrate(model, [torch.stack(images[:2]), torch.stack(images[2:])])
    written = load_file(out)
    for key, value in model.state_dict().items():
        assert torch.equal(written[key], value), key


def test_cli_bnsurgeon_checkpoint_round_trip_and_format_refused_before_work(data_models):
    """A converted (sync) bnsurgeon checkpoint is written back as one: it loads, only the BN running
    statistics differ, the run is in its metadata. An output format that cannot hold it is refused
    before the pass, with nothing written."""
    from safetensors import safe_open

    tmp = data_models
    converted = tmp / "small.sync.safetensors"
    assert run("convert", "rmodels:small", "-o", converted, "--input-shape", "2,3,9,9", "-q").exit_code == 0
    torch.save(torch.randn(6, 3, 9, 9, generator=torch.Generator().manual_seed(2)), tmp / "d.pt")
    before = listing(tmp)
    refused = run("recalibrate", converted, "--data", tmp / "d.pt", "-o", tmp / "out.pt", "--model", "rmodels:small")
    assert refused.exit_code == 2 and "its recalibrated copy is one too" in refused.output, refused.output
    assert listing(tmp) == before
    out = tmp / "small.recal.safetensors"
    result = run("recalibrate", converted, "--data", tmp / "d.pt", "-o", out, "--model", "rmodels:small")
    assert result.exit_code == 0, result.output
    model = bnsurgeon.load(out, model="rmodels:small")
    assert type(model[1]).__name__ == "SyncBatchNorm"
    with safe_open(str(converted), "pt") as a, safe_open(str(out), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        changed = {key for key in a.keys() if not torch.equal(a.get_tensor(key), b.get_tensor(key))}
        metadata = b.metadata()
    assert changed == {f"{m}.{s}" for m in ("1", "4") for s in ("running_mean", "running_var")}
    assert json.loads(metadata["bnsurgeon.recalibrations"])[-1]["samples"] == 6


def test_cli_folder_of_tensor_files_in_name_order(data_models):
    """A folder: every tensor file in name order; a list's tensors and a safetensors file's tensors (key
    order) are batches as they are; one tensor of samples is cut by --batch-size."""
    from safetensors.torch import load_file, save_file

    tmp = data_models
    folder = tmp / "calib"
    folder.mkdir()
    generator = torch.Generator().manual_seed(8)
    listed = [torch.randn(3, 3, 9, 9, generator=generator) for _ in range(2)]
    named = {"b": torch.randn(2, 3, 9, 9, generator=generator), "a": torch.randn(4, 3, 9, 9, generator=generator)}
    samples = torch.randn(5, 3, 9, 9, generator=generator)
    torch.save(listed, folder / "1_list.pt")
    save_file(named, str(folder / "2_named.safetensors"))
    torch.save(samples, folder / "3_samples.pth")
    out = tmp / "folder.safetensors"
    result = run("recalibrate", "rmodels:small", "--data", folder, "-o", out, "--json", "-q")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["batches"] == 5 and report["samples"] == 3 + 3 + 4 + 2 + 5  # samples cut by the default 32
    expected = __import__("rmodels").small()
    bnsurgeon.recalibrate(expected, listed + [named["a"], named["b"], samples])
    written = load_file(out)
    for key, value in expected.state_dict().items():
        assert torch.equal(written[key], value), key
