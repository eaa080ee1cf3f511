"""The training and export stacks people use now (issue 46): FSDP2, DDP ``no_sync`` gradient
accumulation, ``torch.export`` and ONNX (run in onnxruntime) of a converted model.

Training: 2 gloo ranks on uneven slices of every batch, float64, against one process of plain BN
on the whole batch (``_stack_cases.reference_state``): parameters after the optimizer steps and
the running statistics, within 1e-12, and the ranks' buffers bit-identical (DDP's buffer broadcast
is off, so only synchronized BN makes them equal). Export: eval outputs against eager."""

from __future__ import annotations

import pytest
import torch
from _dist import run_world
from _stack_cases import MICRO, fsdp2_rank, model, no_sync_rank, reference_state

import bnsurgeon
from bnsurgeon.core import torch_versions

EXACT = dict(rtol=1e-12, atol=1e-12)


def _assert_ranks_match(ranks: list[dict], reference: dict) -> None:
    for key, expected in reference.items():
        for rank, state in enumerate(ranks):
            if not expected.is_floating_point():
                assert torch.equal(state[key], expected), (key, rank)
                continue
            torch.testing.assert_close(state[key], expected, **EXACT, msg=lambda m: f"{key} on rank {rank}: {m}")
        if "running" in key:
            assert torch.equal(ranks[0][key], ranks[1][key]), key


@pytest.mark.distributed
def test_fsdp2_trains_exactly_like_one_process_on_the_whole_batch():
    if not torch_versions.has("fully_shard_public"):
        pytest.skip(
            f"FSDP2 (torch.distributed.fsdp.fully_shard) is torch >= {torch_versions.needed('fully_shard_public')}; "
            f"this is {torch_versions.installed_text()}, whose FSDP2 creates CUDA streams on a CPU forward"
        )
    ranks = run_world(2, fsdp2_rank, timeout=240)
    _assert_ranks_match(ranks, reference_state())


@pytest.mark.distributed
def test_ddp_no_sync_accumulation_trains_exactly_like_one_process():
    ranks = run_world(2, no_sync_rank, timeout=240)
    _assert_ranks_match(ranks, reference_state(micro_batches=MICRO))


def _eval_pair(target: str, dtype=torch.float64):
    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 3, 6, 6, generator=generator, dtype=torch.float64) * 2 + 1).to(dtype)
    net = bnsurgeon.convert(model().to(dtype), target, example_input=x).model.eval()
    with torch.no_grad():
        for module in net.modules():  # non-trivial running statistics
            if getattr(module, "running_var", None) is not None:
                module.running_mean.uniform_(-1, 1, generator=generator)
                module.running_var.uniform_(0.5, 2, generator=generator)
    return net, x


@pytest.mark.parametrize("target", ["sync", "fused"])
def test_torch_export_of_a_converted_model_in_eval_is_exact(target):
    net, x = _eval_pair(target)
    exported = torch.export.export(net, (x,))
    with torch.no_grad():
        assert torch.equal(exported.module()(x), net(x))


def _onnx_outputs(net, x):
    if not torch_versions.has("onnx_dynamo_export"):
        pytest.skip(
            f"torch.onnx.export(dynamo=True) is torch >= {torch_versions.needed('onnx_dynamo_export')}; this is "
            f"{torch_versions.installed_text()} (its dynamo exporter is the older torch.onnx.dynamo_export)"
        )
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is in the test extra")
    pytest.importorskip("onnxscript", reason="torch.onnx's exporter needs onnxscript (in the test extra)")
    program = torch.onnx.export(net, (x,), dynamo=True, verbose=False)
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (output,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    return torch.from_numpy(output), [node.op_type for node in program.model_proto.graph.node]


@pytest.mark.parametrize("target", ["sync", "fused"])
def test_onnx_export_of_a_converted_model_runs_in_onnxruntime_like_eager(target):
    """float32 (onnxruntime has no float64 convolution): within a few float32 roundings of eager."""
    net, x = _eval_pair(target, torch.float32)
    output, _ = _onnx_outputs(net, x)
    with torch.no_grad():
        expected = net(x)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_onnx_export_of_a_sync_model_in_train_mode_computes_eval_outputs():
    """What the docs say: outside a process group a sync layer is plain BN, and torch's ONNX exporter
    folds train-mode BN with its running statistics (it warns): the file computes eval outputs.
    (``momentum=None`` does not export in train mode, as torch's BN: its factor is a host read.)"""
    net, x = _eval_pair("sync", torch.float32)
    net[4].momentum = 0.1
    net.train()
    with pytest.warns(UserWarning, match="training mode"):
        output, ops = _onnx_outputs(net, x)
    assert "BatchNormalization" not in ops, ops
    with torch.no_grad():
        eval_output = net.eval()(x)
        train_output = net.train()(x)
    torch.testing.assert_close(output, eval_output, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(output, train_output, rtol=1e-3, atol=1e-3)
