"""BNSurgeonLayerSync with a real Lightning Trainer: 2 CPU processes (gloo), activations kept,
the result equal to single-process full-batch training (unsynced BN is off by ~3e3 here),
and revert restoring the exact original classes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("lightning", reason="the lightning extra is not installed")

from bnsurgeon.integrations.lightning import BNSurgeonLayerSync  # noqa: E402

pytestmark = pytest.mark.distributed


def test_apply_keeps_activations_and_revert_restores_exact_classes():
    from timm.layers import BatchNormAct2d

    model = nn.Sequential(nn.Conv2d(3, 4, 1), BatchNormAct2d(4, act_layer=nn.SiLU), nn.BatchNorm1d(4))
    plugin = BNSurgeonLayerSync()
    synced = plugin.apply(model)
    assert synced is model and type(model[1]).__name__ == "SyncBatchNormAct" and isinstance(model[1].act, nn.SiLU)
    reverted = plugin.revert(model)
    assert type(reverted[1]) is BatchNormAct2d and type(reverted[2]) is nn.BatchNorm1d


def test_revert_after_unfreeze_restores_frozen_classes_with_what_they_learned():
    from timm.layers import FrozenBatchNormAct2d
    from torchvision.ops.misc import FrozenBatchNorm2d

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1), FrozenBatchNorm2d(4), FrozenBatchNormAct2d(4, act_layer=nn.SiLU), nn.BatchNorm2d(4)
    )
    for module in model[1:3]:
        module.running_mean.uniform_(-1, 1)
        module.running_var.uniform_(0.5, 2)
    plugin = BNSurgeonLayerSync(frozen="unfreeze")
    plugin.apply(model)
    assert [type(m).__name__ for m in model[1:]] == ["SyncBatchNorm", "SyncBatchNormAct", "SyncBatchNorm"]
    model.train()(torch.randn(8, 3, 5, 5))  # thawed layers learn (world of one: plain BN arithmetic)
    learned = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    plugin.revert(model)
    assert [type(m) for m in model[1:]] == [FrozenBatchNorm2d, FrozenBatchNormAct2d, nn.BatchNorm2d]
    assert isinstance(model[2].act, nn.SiLU)
    state = model.state_dict()
    for key, value in learned.items():
        assert torch.equal(state[key], value), key
    assert "1.num_batches_tracked" not in state and "3.num_batches_tracked" in state
    model.eval()(torch.randn(2, 3, 5, 5))


def test_trainer_two_cpu_processes_match_full_batch_training(tmp_path):
    import lightning.pytorch as pl
    from _lightning_cases import STEPS, Module, reference_state

    record = tmp_path / "kinds"
    module = Module(str(record))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        sync_batchnorm=True,
        plugins=[BNSurgeonLayerSync()],
        max_steps=STEPS,
        precision="64-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module)
    for rank in (0, 1):
        kinds = (tmp_path / f"kinds.rank{rank}").read_text().split()
        assert "SyncBatchNormAct:SiLU" in kinds and not any(k.startswith("BatchNormAct2d") for k in kinds), kinds
    expected = reference_state()
    for name, value in module.net.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


PRECISIONS = ["bf16-mixed", "bf16-true", "16-true", "32-true compiled"]


@pytest.fixture(scope="module")
def low_precision_states():
    from _dist import run_world
    from _lightning_cases import precision_rank

    return run_world(2, precision_rank, PRECISIONS, timeout=270)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_trainer_trains_synced_in_every_low_precision_cpu_allows(low_precision_states, precision):
    """Lightning's CPU low precisions (bf16 autocast, the whole model in bf16 or fp16) train
    synced on 2 gloo ranks: every rank's running statistics, kept in float32 by the layer,
    land on full-batch float32 training within the precision's rounding, far from what
    unsynced BN gives (~0.2 off). ("16-mixed" is fp16 autocast: on CPU Lightning runs it as bf16-mixed.)
    "32-true compiled": the LightningModule passed through ``torch.compile`` (aot_eager), so
    every sync layer runs as the compiled path's custom op, within float32 rounding."""
    from _lightning_cases import STEPS, precision_reference_state

    expected = precision_reference_state()
    tolerance = {"16-true": 3e-3, "32-true compiled": 1e-5}.get(precision, 2e-2)
    for rank, states in enumerate(low_precision_states):
        state = states[precision]
        for name in ("1.running_mean", "1.running_var", "3.running_mean", "3.running_var"):
            torch.testing.assert_close(
                state[name],
                expected[name],
                rtol=tolerance,
                atol=tolerance,
                msg=lambda m: f"{precision} {name} on rank {rank}: {m}",
            )
        assert int(state["1.num_batches_tracked"]) == STEPS
        compiled_calls = state["compiled sync layer calls"]
        assert compiled_calls == (2 * STEPS if precision.endswith("compiled") else 0), compiled_calls
