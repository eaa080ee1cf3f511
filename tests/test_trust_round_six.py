"""Trust, round six: what one rank did before training never names a layer, and adoption never runs in a trace.

One torchrun launch (2 CPU gloo ranks) runs tests/_history_cases.py through ``-m bnsurgeon run``: models that
build torch's ``nn.SyncBatchNorm`` themselves, where one rank looks at the model in eval mode first, looks at a
deep-copied EMA, builds one more layer, or builds two models in another order; bnsurgeon's own layers built
directly with one more on one rank; a model compiled (``fullgraph=True`` and not) before its first forward
under the group. Each trains exactly as one process with BatchNorm2d on the whole batch. A real mismatch (each
rank runs a layer the other never built) is caught and each rank's layer named on both.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

CASES = Path(__file__).with_name("_history_cases.py")
SCENARIOS = [
    "eval_peek",
    "ema_peek",
    "extra_layer",
    "build_order",
    "native_extra",
    "compiled",
    "compiled_default",
    "compiled_one_rank_mismatch",
    "compiled_in_place",
    "compiled_mismatch",
    "mismatch",
]
EXACT = [scenario for scenario in SCENARIOS if not scenario.endswith("mismatch")]
#: torchrun starts 3 interpreters that import torch and compile twice: generous for a busy 2-core machine
LAUNCH_TIMEOUT = 300


def _case():
    import runpy

    return runpy.run_path(str(CASES), run_name="history_cases")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from _dist import torchrun

    work = tmp_path_factory.mktemp("history")
    shutil.copy(CASES, work / "train.py")
    out = work / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BNSURGEON_", "PYTHONPATH"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    command = torchrun("-m", "bnsurgeon", "run", "train.py", str(out), *SCENARIOS)
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    results = {
        scenario: [torch.load(out / f"{scenario}.rank{rank}.pt", weights_only=False) for rank in range(2)]
        for scenario in SCENARIOS
    }
    return results, done.stderr


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", EXACT)
def test_what_one_rank_did_before_training_changes_nothing(launched, scenario):
    """Ranks bit-identical, equal to one process on the whole batch (outputs per share, running statistics):
    no false DistributedMismatchError from a layer named by when or where one rank adopted or built it."""
    results, _ = launched
    ranks = results[scenario]
    for rank in ranks:
        assert "failed" not in rank, (scenario, rank.get("failed"))
        assert rank["types"] == ["bnsurgeon.runtime.layers"], rank["types"]
    reference = _case()["reference"](scenario)
    for key, expected in reference["stats"].items():
        assert torch.equal(ranks[0]["stats"][key], ranks[1]["stats"][key]), (scenario, key)
        torch.testing.assert_close(ranks[0]["stats"][key], expected, rtol=1e-12, atol=1e-12, msg=key)
    for step, expected in enumerate(reference["outputs"]):
        for rank, result in enumerate(ranks):
            torch.testing.assert_close(result["outputs"][step], expected[rank::2], rtol=1e-12, atol=1e-12)
    if "per_layer" in ranks[0]:  # each layer compiled in place: trains as the whole model compiled
        for key, expected in reference["stats"].items():
            torch.testing.assert_close(ranks[1]["per_layer"][key], expected, rtol=1e-12, atol=1e-12, msg=key)


@pytest.mark.distributed
def test_an_eval_forward_adopts_nothing(launched):
    """torch's layer syncs nothing in eval mode: rank 0's look before DDP leaves its layers torch's."""
    results, _ = launched
    assert [rank["after_peek"] for rank in results["eval_peek"]] == ["torch.nn.modules.batchnorm"] * 2


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", ["compiled", "compiled_default"])
def test_a_compile_before_the_first_forward_adopts_outside_the_trace(launched, scenario):
    """No graph break and nothing from dynamo (adoption read the call stack inside the trace: fullgraph failed,
    and without it dynamo warned); the run says the layers were adopted as compiling started, at the script's
    line that called the compiled model."""
    results, stderr = launched
    for rank in results[scenario]:
        assert rank["graph_breaks"] == 0 and rank["warnings"] == [], rank
    lines = [line for line in stderr.splitlines() if "adopted as torch.compile started" in line]
    assert len(lines) >= 2 and all("at train.py:" in line for line in lines), lines


@pytest.mark.distributed
def test_a_real_mismatch_is_caught_and_each_ranks_layer_named_on_both(launched):
    """Each rank runs a layer the other never built, both made by the same helper line: caught on both ranks,
    and each names both layers by their paths in the modules running them (no '<unnamed layer id>')."""
    results, _ = launched
    errors = [rank["error"] for rank in results["mismatch"]]
    assert errors[0] == errors[1] and errors[0] is not None
    assert "rank 0: 'Net.bn1' forward call 1" in errors[0] and "rank 1: 'Head.bn' forward call 1" in errors[0]
    assert "unnamed" not in errors[0] and "has not run" not in errors[0]


@pytest.mark.distributed
def test_a_real_mismatch_under_compile_is_caught_by_the_layers_paths(launched):
    """Compiled, the layers are named as compiling starts, from the modules on the stack, as the eager path names
    them: rank 0's bn1 and rank 1's bn2 (equal width) are caught, not trained mixed."""
    results, _ = launched
    errors = [rank["error"] for rank in results["compiled_mismatch"]]
    assert errors[0] == errors[1] and errors[0] is not None, errors
    assert "rank 0: 'Branchy.bn1' forward call 1" in errors[0] and "rank 1: 'Branchy.bn2' forward call 1" in errors[0]


def test_a_converted_model_compiles_with_fullgraph_in_one_process():
    """No process group: the layer is plain BN and compiles as one (the checkpoint-recompute test read the
    autograd engine's task id, which dynamo cannot trace: fullgraph=True failed)."""
    from torch import nn

    import bnsurgeon

    torch.manual_seed(0)
    model = bnsurgeon.convert(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)), "sync").model
    reference = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 4, 4)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), reference(x))
    assert torch.equal(model[1].num_batches_tracked, reference[1].num_batches_tracked)


@pytest.mark.distributed
def test_a_rank_running_compiled_beside_an_eager_one_is_refused_by_name_not_mixed(launched):
    """The compiled backward sums the statistics' gradients, the eager one the kernel's sums: summed together they
    gave both ranks the same wrong gradients. Both ranks name the layer alike (the forward passes) and refuse the
    backward, saying why."""
    results, _ = launched
    errors = [rank["error"] for rank in results["compiled_one_rank_mismatch"]]
    assert errors[0] == errors[1] and errors[0] is not None, errors
    assert "'Net.bn2' compiled backward call 1" in errors[0] and "'Net.bn2' backward call 1" in errors[0]
    assert "compile it on every rank or on none" in errors[0]
