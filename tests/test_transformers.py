"""Hugging Face transformers (issue 30): a save_pretrained directory as SOURCE, the output rebuilt with no
arguments, transformers' own frozen BN classes found by what they are, unfrozen to sync and refrozen to
their own class. Small configs, no weights, local files only."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from typer.testing import CliRunner

transformers = pytest.importorskip(
    "transformers", reason="transformers is in the test extra (pip install -e '.[test]')"
)

from test_untrusted import one_line_failure  # noqa: E402

import bnsurgeon  # noqa: E402
from bnsurgeon.cli.commands import app  # noqa: E402

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200", "HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="module")
def resnet_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    directory = tmp_path_factory.mktemp("hf") / "resnet"
    transformers.ResNetForImageClassification(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def detr_dir(tmp_path_factory):
    torch.manual_seed(0)
    backbone = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1], out_features=["stage4"]
    )
    config = transformers.DetrConfig(
        use_timm_backbone=False,
        use_pretrained_backbone=False,
        backbone_config=backbone,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
        num_queries=5,
        num_labels=3,
    )
    directory = tmp_path_factory.mktemp("hf") / "detr"
    transformers.DetrForObjectDetection(config).save_pretrained(directory)
    return directory


def hooked_family(name: str):
    """transformers 5 models whose forward needs its output-capturing hooks (local closures: they do not pickle)."""
    if name == "segformer":
        config = transformers.SegformerConfig(
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[8, 16],
            num_attention_heads=[1, 2],
            decoder_hidden_size=16,
            num_labels=3,
            mlp_ratios=[2, 2],
            strides=[4, 2],
            patch_sizes=[7, 3],
        )
        return transformers.SegformerForSemanticSegmentation(config)
    if name == "dpt":  # image_size is the input: bnsurgeon reads it from the config
        config = transformers.DPTConfig(
            hidden_size=16,
            num_hidden_layers=4,
            num_attention_heads=2,
            intermediate_size=16,
            image_size=32,
            patch_size=8,
            neck_hidden_sizes=[8, 8, 8, 8],
            fusion_hidden_size=8,
            backbone_out_indices=[0, 1, 2, 3],
            num_labels=3,
            head_hidden_size=8,
            use_batch_norm_in_fusion_residual=True,
        )
        return transformers.DPTForSemanticSegmentation(config)
    backbone = transformers.ConvNextConfig(
        hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1], out_features=["stage1", "stage2", "stage3", "stage4"]
    )
    config = transformers.UperNetConfig(
        backbone_config=backbone,
        hidden_size=16,
        auxiliary_in_channels=16,
        auxiliary_channels=8,
        num_labels=3,
        use_pretrained_backbone=False,
    )
    return transformers.UperNetForSemanticSegmentation(config)


@pytest.mark.parametrize("family", ["segformer", "dpt", "upernet"])
def test_models_with_output_capturing_hooks_verify_on_two_ranks(family, tmp_path):
    """The ranks build the model from its recipe and load the parent's tensors: pickling it fails."""
    import pickle

    torch.manual_seed(0)
    model = hooked_family(family)
    model.save_pretrained(tmp_path / family)
    with torch.no_grad():
        model.eval()(torch.randn(1, 3, 32, 32))  # the hooks are installed on the first forward
    with pytest.raises((AttributeError, pickle.PicklingError)):
        pickle.dumps(model)  # what the ranks used to be sent
    out = tmp_path / f"{family}.sync.safetensors"
    # UperNet keeps its pyramid-pooling modules in a plain list too: the in-memory copy must run the converted ones
    converted = run("convert", tmp_path / family, "-o", out, *(["--verify"] if family == "upernet" else []))
    assert converted.exit_code == 0, converted.output
    result = run("verify", tmp_path / family, out, "-w", "2")
    assert result.exit_code == 0, result.output
    report = [line for line in result.output.splitlines() if "2 ranks" in line]
    assert len(report) == 2 and all(" pass " in line for line in report), result.output


def test_a_model_directory_is_a_source_and_the_output_rebuilds_with_no_arguments(resnet_dir, tmp_path):
    inspected = run("inspect", resnet_dir)
    assert inspected.exit_code == 0 and "BatchNorm2d" in inspected.output, inspected.output
    out = tmp_path / "r.sync.safetensors"
    result = run("convert", resnet_dir, "-o", out)
    assert result.exit_code == 0, result.output
    assert "bit-identical" in result.output
    report = json.loads((tmp_path / "r.sync.safetensors.report.json").read_text())
    assert "transformers:ResNetForImageClassification" in report["source"]
    model = bnsurgeon.load(out)  # class and config are recorded: nothing to name
    assert type(model).__name__ == "ResNetForImageClassification"
    assert {type(m).__name__ for m in model.modules()} >= {"SyncBatchNorm"}
    source = transformers.ResNetForImageClassification.from_pretrained(resnet_dir).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model.eval()(x).logits, source(x).logits)
    for named in (resnet_dir / "config.json", resnet_dir / "model.safetensors"):  # the files name their directory
        assert run("inspect", named).exit_code == 0


def test_verify_of_a_directory_against_its_conversion_on_two_ranks(resnet_dir, tmp_path):
    out = tmp_path / "r.sync.safetensors"
    assert run("convert", resnet_dir, "-o", out).exit_code == 0
    result = run("verify", resnet_dir, out, "-w", "2")
    assert result.exit_code == 0, result.output
    assert "2 ranks" in result.output


def test_detr_frozen_bn_unfreezes_to_sync_and_refreezes_to_its_own_class(detr_dir, tmp_path):
    inspected = run("inspect", detr_dir)
    assert inspected.exit_code == 0 and "transformers-DetrFrozenBatchNorm2d" in inspected.output, inspected.output
    sync = tmp_path / "d.sync.safetensors"
    result = run("convert", detr_dir, "--frozen", "unfreeze", "--input-shape", "1,3,64,64", "-o", sync)
    assert result.exit_code == 0, result.output
    thawed = bnsurgeon.load(sync)
    assert sum(type(m).__name__ == "SyncBatchNorm" for m in thawed.modules()) == 16
    frozen = tmp_path / "d.frozen.safetensors"
    back = run("convert", sync, "--to", "frozen", "--input-shape", "1,3,64,64", "-o", frozen)
    assert back.exit_code == 0 and "refrozen into its original class DetrFrozenBatchNorm2d" in back.output, back.output
    # from_pretrained leaves the backbone trainable, a rebuild from config would not: the file records which train
    verified = run("verify", detr_dir, sync, "-w", "2", "--input-shape", "1,3,64,64", "--no-perturb")
    assert verified.exit_code == 0, verified.output
    refrozen = bnsurgeon.load(frozen)
    assert sum(type(m).__name__ == "DetrFrozenBatchNorm2d" for m in refrozen.modules()) == 16
    original = transformers.DetrForObjectDetection.from_pretrained(detr_dir)
    assert set(refrozen.state_dict()) == set(original.state_dict())  # no num_batches_tracked left behind
    for key, value in original.state_dict().items():
        assert torch.equal(refrozen.state_dict()[key], value), key


def test_detr_as_a_model_directory_trains_synced_and_refreezes_for_from_pretrained(detr_dir, tmp_path):
    """unfreeze -> -o DIR -> 2 gloo ranks of DDP training -> save_pretrained -> --to frozen -o DIR ->
    from_pretrained with nothing missing or unexpected, holding what the ranks learned."""
    from _transformers_cases import train_detr_rank

    from bnsurgeon.checks.multiproc import run_world

    sync = tmp_path / "detr-sync"
    result = run("convert", detr_dir, "--frozen", "unfreeze", "-o", sync)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in sync.iterdir()) == [
        "config.json",
        "model.safetensors",
        "model.safetensors.report.json",
        "model.safetensors.report.md",
    ]
    plain, info = transformers.DetrForObjectDetection.from_pretrained(sync, output_loading_info=True)
    assert not any(info.values()), info  # 16 num_batches_tracked were unexpected when written as they are
    converted = bnsurgeon.load(sync)
    assert sum(type(m).__name__ == "SyncBatchNorm" for m in converted.modules()) == 16
    verified = run("verify", detr_dir, sync, "-w", "2", "--no-perturb")
    assert verified.exit_code == 0, verified.output

    trained = tmp_path / "trained"
    ranks = run_world(2, train_detr_rank, str(sync), str(trained), timeout=270)
    for key, value in ranks[0].items():
        assert torch.equal(value, ranks[1][key]), key  # synced: the ranks agree
    counters = [k for k in ranks[0] if k.endswith("num_batches_tracked")]
    assert len(counters) == 16 and all(int(ranks[0][k]) == 2 for k in counters)

    back = tmp_path / "detr-frozen"
    result = run("convert", trained, "--to", "frozen", "-o", back)  # a save_pretrained directory: no recipe needed
    assert result.exit_code == 0, result.output
    refrozen, info = transformers.DetrForObjectDetection.from_pretrained(back, output_loading_info=True)
    assert not any(info.values()), info
    state = refrozen.state_dict()
    assert sum(type(m).__name__ == "DetrFrozenBatchNorm2d" for m in refrozen.modules()) == 16
    for key, value in ranks[0].items():
        if not key.endswith("num_batches_tracked"):
            assert torch.equal(state[key], value), key
            assert not torch.equal(value, plain.state_dict()[key]), key  # training moved it


def test_recorded_batch_counters_are_validated_like_every_metadata_field(detr_dir, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    sync = tmp_path / "sync"
    assert run("convert", detr_dir, "--frozen", "unfreeze", "-o", sync).exit_code == 0
    with safe_open(str(sync / "model.safetensors"), "pt") as handle:
        metadata, tensors = handle.metadata(), {key: handle.get_tensor(key) for key in handle.keys()}
    counts = json.loads(metadata["bnsurgeon.counts"])
    assert len(counts) == 16 and set(counts.values()) == {0}
    some = next(iter(counts))
    bad = [
        {some: -1},
        {some: "3"},
        {some: True},
        {some: 2**63},
        {"model.class_labels_classifier.weight": 1},
        {"class_labels_classifier.num_batches_tracked": 1, **counts},
        [1],
        {some: 1.5},
    ]
    stored = next(key for key in tensors if key.endswith("running_mean")).replace("running_mean", "num_batches_tracked")
    tensors_with_counter = dict(tensors, **{stored: torch.tensor(0)})
    for value in bad + ["stored"]:
        hostile = tmp_path / "hostile"
        hostile.mkdir(exist_ok=True)
        (hostile / "config.json").write_text((sync / "config.json").read_text())
        chosen = {stored: 0} if value == "stored" else value
        save_file(
            tensors_with_counter if value == "stored" else tensors,
            hostile / "model.safetensors",
            metadata=dict(metadata, **{"bnsurgeon.counts": json.dumps(chosen)}),
        )
        result = run("inspect", hostile)  # metadata is read before anything is built
        assert result.exit_code in (4, 6) and "Traceback" not in result.output, (value, result.output)
        assert ("bnsurgeon.counts" if result.exit_code == 4 else "do not fit") in result.output, (value, result.output)
    counted = dict(counts, **{some: 7})  # a valid counter comes back as the buffer's value
    save_file(
        tensors, hostile / "model.safetensors", metadata=dict(metadata, **{"bnsurgeon.counts": json.dumps(counted)})
    )
    assert int(bnsurgeon.load(hostile).state_dict()[some]) == 7


def test_directory_outputs_refuse_what_from_pretrained_could_not_load(resnet_dir, detr_dir, tmp_path):
    out = tmp_path / "r"
    assert run("convert", resnet_dir, "-o", out).exit_code == 0
    model = transformers.ResNetForImageClassification.from_pretrained(out).eval()
    source = transformers.ResNetForImageClassification.from_pretrained(resnet_dir).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x).logits, source(x).logits)
    assert type(bnsurgeon.load(out).resnet.embedder.embedder.normalization).__name__ == "SyncBatchNorm"
    assert (
        type(bnsurgeon.load(out / "model.safetensors").resnet.embedder.embedder.normalization).__name__
        == "SyncBatchNorm"
    )
    from bnsurgeon.core.errors import CheckpointError

    with pytest.raises(CheckpointError, match="bnsurgeon did not convert"):  # not "is a directory"
        bnsurgeon.load(resnet_dir)
    one_line_failure(run("convert", resnet_dir, "-o", out), 8, "already exists")  # --force replaces, nothing else
    assert run("convert", resnet_dir, "-o", out, "--force").exit_code == 0
    cases = [
        (("convert", "resnet18", "-o", tmp_path / "timm-dir"), 2, "names a directory (no file suffix"),
        (("convert", resnet_dir, "--to", "fused", "-o", tmp_path / "fused-dir"), 2, "cannot be a model directory"),
        (("convert", resnet_dir, "-o", resnet_dir), 8, "holds the input"),
        (("convert", resnet_dir, "-o", tmp_path / "missing" / "dir"), 8, "does not exist"),
    ]
    (tmp_path / "stale").mkdir()
    (tmp_path / "stale" / "pytorch_model.bin").write_bytes(b"old weights")
    cases.append((("convert", resnet_dir, "-o", tmp_path / "stale"), 8, "holds other weights"))
    for args, code, text in cases:
        one_line_failure(run(*args), code, text)
    assert not (tmp_path / "timm-dir").exists() and not (tmp_path / "fused-dir").exists()
    assert sorted(p.name for p in (tmp_path / "stale").iterdir()) == ["pytorch_model.bin"]
    assert sorted(p.name for p in resnet_dir.iterdir()) == ["config.json", "model.safetensors"]

    broken = tmp_path / "broken"  # a weight missing: from_pretrained would initialize it at random and warn
    broken.mkdir()
    (broken / "config.json").write_text((detr_dir / "config.json").read_text())
    from safetensors.torch import load_file, save_file

    tensors = load_file(detr_dir / "model.safetensors")
    tensors.pop("class_labels_classifier.bias")
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    one_line_failure(run("convert", broken, "-o", tmp_path / "b.safetensors"), 6, "class_labels_classifier.bias")


def test_a_frozen_bn_lookalike_that_computes_something_else_is_not_claimed(monkeypatch, tmp_path):
    """Found by what they are: named like one, four buffers, but its forward is not the frozen BN map."""
    module = types.ModuleType("transformers.models.lookalike.modeling_lookalike")

    class LookalikeFrozenBatchNorm2d(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            for name in ("weight", "bias", "running_mean", "running_var"):
                self.register_buffer(name, torch.ones(n))

        def forward(self, x):
            return x * self.weight.reshape(1, -1, 1, 1)  # no normalization

    LookalikeFrozenBatchNorm2d.__module__ = module.__name__
    module.LookalikeFrozenBatchNorm2d = LookalikeFrozenBatchNorm2d
    monkeypatch.setitem(sys.modules, module.__name__, module)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), LookalikeFrozenBatchNorm2d(4))
    from bnsurgeon.core.errors import UnhandledModuleError

    with pytest.raises(UnhandledModuleError, match="LookalikeFrozenBatchNorm2d"):
        bnsurgeon.convert(model, "sync")


def test_a_config_describing_a_bigger_model_than_its_weights_is_refused_before_allocation(
    resnet_dir, tmp_path, monkeypatch
):
    """config.json shapes the model: hidden sizes edited up 1000x would have from_pretrained allocate 1.7 GB
    (or far more) before any weight is read. Measured on the meta device and refused first."""
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (hostile / "model.safetensors").write_bytes((resnet_dir / "model.safetensors").read_bytes())
    config = json.loads((resnet_dir / "config.json").read_text())
    config["hidden_sizes"] = [8000, 16000]
    (hostile / "config.json").write_text(json.dumps(config))

    def never(*args, **kwargs):
        raise AssertionError("from_pretrained ran: it would have allocated the model the config describes")

    monkeypatch.setattr(transformers.ResNetForImageClassification, "from_pretrained", never)
    result = run("convert", hostile, "-o", tmp_path / "out.safetensors")
    one_line_failure(result, 4, "420,369,220 weights", "does not belong to these weights")
    assert not (tmp_path / "out.safetensors").exists()


def test_a_config_asking_for_remote_code_is_refused_and_nothing_runs(resnet_dir, tmp_path):
    directory = tmp_path / "remote"
    directory.mkdir()
    config = json.loads((resnet_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_evil.EvilModel"}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes((resnet_dir / "model.safetensors").read_bytes())
    (directory / "modeling_evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\n")
    result = run("convert", directory, "-o", tmp_path / "o.safetensors")
    one_line_failure(result, 10, "asks for remote code", "trust_remote_code=True")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "o.safetensors").exists()


@pytest.mark.timeout(600)  # two 2-rank runs of at most 280 s each (pytest's default is 300 s a test)
def test_the_trainer_callback_keeps_bn_statistics_identical_on_two_gloo_ranks(tmp_path):
    """Two ranks train 3 steps with the HF Trainer (DDP, gloo): with BNSurgeonCallback every BN buffer and
    parameter is identical on both ranks; the plain-BN control's running statistics differ."""
    from _dist import run_world
    from _transformers_cases import trainer_rank

    synced = run_world(2, trainer_rank, True, str(tmp_path / "synced"), timeout=280)
    assert synced[0]["kinds"] == ["SyncBatchNorm"]
    for key, value in synced[0]["state"].items():
        assert torch.equal(value, synced[1]["state"][key]), key
    control = run_world(2, trainer_rank, False, str(tmp_path / "control"), timeout=280)
    assert control[0]["kinds"] == ["BatchNorm2d"]
    assert not torch.equal(control[0]["state"]["body.1.running_mean"], control[1]["state"]["body.1.running_mean"])

    # and they equal one process of plain BN trained on each step's whole batch (both ranks' samples)
    from _transformers_cases import STEPS, one_process_reference

    for run_ in (synced, control):
        assert len(run_[0]["seen"]) == len(run_[1]["seen"]) == STEPS
    steps = [
        (
            torch.cat([synced[0]["seen"][i][0], synced[1]["seen"][i][0]]),
            torch.cat([synced[0]["seen"][i][1], synced[1]["seen"][i][1]]),
        )
        for i in range(STEPS)
    ]
    reference = one_process_reference(steps, str(tmp_path / "reference"))
    for key, value in reference.items():  # float32 sums in another order: within rounding
        assert torch.allclose(synced[0]["state"][key], value, rtol=1e-5, atol=1e-6), key
    assert torch.equal(synced[0]["state"]["body.1.num_batches_tracked"], reference["body.1.num_batches_tracked"])
    control_steps = [
        (
            torch.cat([control[0]["seen"][i][0], control[1]["seen"][i][0]]),
            torch.cat([control[0]["seen"][i][1], control[1]["seen"][i][1]]),
        )
        for i in range(STEPS)
    ]
    control_reference = one_process_reference(control_steps, str(tmp_path / "control-reference"))
    drift = (control[0]["state"]["body.1.running_var"] - control_reference["body.1.running_var"]).abs().max().item()
    assert drift > 1e-2, drift  # plain BN under DDP is not the whole-batch model: the check can tell


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_hostile_model_directories_get_one_line_and_their_own_exit_code(resnet_dir, tmp_path):
    """What an attacker (or a damaged download) puts in a model directory: each refused in one line, with the
    exit code of its kind, nothing written, no code run; a dtype edit no longer rounds the weights."""
    from safetensors.torch import load_file

    def hostile(name, edit=None, weights=None):
        directory = tmp_path / name
        directory.mkdir()
        config = json.loads((resnet_dir / "config.json").read_text())
        text = edit(config) if edit else None
        (directory / "config.json").write_text(text if isinstance(text, str) else json.dumps(config))
        if weights is None:
            (directory / "model.safetensors").write_bytes((resnet_dir / "model.safetensors").read_bytes())
        else:
            weights(directory)
        return directory

    def many_labels(config):
        config.pop("id2label"), config.pop("label2id")
        config["num_labels"] = 3_000_000  # a dict entry per label, built before any weight is read

    marker = tmp_path / "code-ran"
    cases = [
        (hostile("nested", lambda c: "[" * 200_000 + "]" * 200_000), 4, "nested too deeply"),
        (hostile("labels", many_labels), 4, "3000000 labels"),
        (hostile("channels", lambda c: c.update(num_channels=5)), 6, "another shape for"),
        (
            hostile("pickle", weights=lambda d: torch.save({"x": _RunsCode(marker)}, d / "pytorch_model.bin")),
            5,
            "would run code",
        ),
    ]
    for directory, code, text in cases:
        one_line_failure(run("convert", directory, "-o", tmp_path / f"{directory.name}.safetensors"), code, text)
        assert not (tmp_path / f"{directory.name}.safetensors").exists()
    assert not marker.exists()

    rounded = hostile("dtype", lambda c: c.update(dtype="bfloat16", torch_dtype="bfloat16"))
    out = tmp_path / "dtype.safetensors"
    result = run("convert", rounded, "-o", out)
    assert result.exit_code == 0, result.output
    stored, written = load_file(resnet_dir / "model.safetensors"), load_file(out)
    for key, value in stored.items():
        assert written[key].dtype == value.dtype and torch.equal(written[key], value), key

    edited = tmp_path / "sync-dir"
    assert run("convert", resnet_dir, "-o", edited).exit_code == 0
    config = json.loads((edited / "config.json").read_text())
    config["id2label"] = {"0": "cat", "1": "dog", "2": "bird"}
    (edited / "config.json").write_text(json.dumps(config))
    one_line_failure(run("inspect", edited), 4, "differs from the config bnsurgeon recorded", "id2label")
    one_line_failure(run("convert", resnet_dir, "-o", "/proc/bnsurgeon-new-dir"), 8, "/proc")


def test_a_directory_source_owns_aligned_memory_so_eval_stays_bit_identical_on_one_thread(tmp_path):
    """from_pretrained left views of the file at unaligned addresses; single-threaded conv then gave another last
    bit than the same weights loaded by bnsurgeon (RegNet: 1.49e-08 at stages.1's SE conv)."""
    from bnsurgeon.api import verify

    torch.manual_seed(0)
    config = transformers.RegNetConfig(
        embedding_size=4, hidden_sizes=[16, 24, 64, 136], depths=[1, 1, 1, 1], groups_width=64
    )
    transformers.RegNetForImageClassification(config).save_pretrained(tmp_path / "regnet")
    out = tmp_path / "regnet.sync.safetensors"
    assert run("convert", tmp_path / "regnet", "-o", out).exit_code == 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = verify(str(tmp_path / "regnet"), str(out), world_sizes=(), input_shape=(2, 3, 64, 64))
    finally:
        torch.set_num_threads(threads)
    assert result.passed, [(c.name, c.max_abs_diff, c.first_divergence) for c in result.checks]


def test_a_sharded_directory_converts_and_an_index_pointing_outside_it_is_refused(tmp_path):
    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    transformers.ResNetForImageClassification(config).save_pretrained(tmp_path / "sharded", max_shard_size="4KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    result = run("convert", tmp_path / "sharded", "-o", tmp_path / "s.safetensors")
    assert result.exit_code == 0 and "bit-identical" in result.output, result.output

    first = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / first).write_bytes((tmp_path / "sharded" / first).read_bytes())
    for target in (f"../elsewhere/{first}", "/etc/passwd", "missing.safetensors"):
        edited = dict(
            index, weight_map={key: (target if value == first else value) for key, value in index["weight_map"].items()}
        )
        (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(edited))
        one_line_failure(
            run("convert", tmp_path / "sharded", "-o", tmp_path / "x.safetensors"), 4, "not a file of the directory"
        )


def test_a_trailing_slash_on_the_output_asks_for_a_model_directory_whatever_the_name(resnet_dir, tmp_path):
    """-o out.v2/ is a directory (before: 'cannot tell the format', the slash dropped by Click's Path), and
    -o ck.safetensors/ is one too, never a single file of that name."""
    for name in ("out.v2", "ck.safetensors"):
        result = run("convert", resnet_dir, "-o", f"{tmp_path / name}/")
        assert result.exit_code == 0, result.output
        assert (tmp_path / name).is_dir() and (tmp_path / name / "config.json").is_file(), name
        assert transformers.ResNetForImageClassification.from_pretrained(tmp_path / name) is not None
