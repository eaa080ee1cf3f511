"""How verify's ranks get the converted model (checks.verify.ship_model), and outputs compared by name.

A model that does not pickle (transformers 5's output-capturing hooks are local closures) is built in
each rank from its recipe and given the parent's tensors; one with no recipe is refused in one line.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bnsurgeon.checks.verify import compare_outputs, verify_models
from bnsurgeon.core.errors import UnshippableModelError
from bnsurgeon.surgery.walk import convert


class Unpicklable(nn.Module):
    """Conv + BN whose forward goes through a closure attribute, as a hooked model's does."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        scale = 1.5
        self.post = lambda t: t * scale  # a local object: pickle refuses it

    def forward(self, x):
        return self.post(self.bn(self.conv(x)))


def build_converted():
    """The recipe a rank runs: same structure, seeded weights (the parent's tensors replace them)."""
    torch.manual_seed(123)
    return convert(Unpicklable(), "sync").model


def pair():
    torch.manual_seed(0)
    source = Unpicklable()
    with torch.no_grad():
        source.bn.running_mean.uniform_(-1, 1)
        source.bn.weight.uniform_(0.5, 2)
    return source.eval(), convert(source, "sync").model.eval()


def test_a_model_that_does_not_pickle_is_built_in_each_rank_from_its_recipe():
    source, converted = pair()
    result = verify_models(source, converted, (2, 3, 8, 8), world_sizes=(2,), rebuild_converted=build_converted)
    ranks = [check for check in result.checks if "ranks" in check.name]
    assert len(ranks) == 2 and all(check.passed for check in ranks), result.checks
    # the parent's tensors, not the recipe's seeded ones, reached the ranks: a rank check of a wrong model fails
    converted.bn.bias = nn.Parameter(converted.bn.bias.detach() + 0.5)  # its own tensor: convert shares them
    wrong = verify_models(
        source, converted, (2, 3, 8, 8), world_sizes=(2,), perturb=False, rebuild_converted=build_converted
    )
    assert [c.passed for c in wrong.checks if "ranks" in c.name] == [False]


def test_a_model_that_does_not_pickle_and_has_no_recipe_is_refused_in_one_line():
    source, converted = pair()
    with pytest.raises(UnshippableModelError, match="cannot be sent to the rank processes") as caught:
        verify_models(source, converted, (2, 3, 8, 8), world_sizes=(2,), perturb=False)
    assert caught.value.exit_code == 2 and "\n" not in caught.value.message


def test_outputs_are_compared_by_field_name():
    a = {"logits": torch.ones(2, 3), "hidden": torch.zeros(2, 4)}
    same_other_order = {"hidden": torch.zeros(2, 4), "logits": torch.ones(2, 3)}
    assert compare_outputs(a, same_other_order)[0]
    missing = {"logits": torch.ones(2, 3), "pred_boxes": torch.zeros(2, 4)}  # same shapes by position
    ok, diff, fields = compare_outputs(a, missing)
    assert not ok and diff == float("inf") and "only the source has hidden" in fields
    assert "only the converted model has pred_boxes" in fields
    moved = {"logits": torch.ones(2, 3), "hidden": torch.zeros(2, 4) + 1e-3}
    ok, diff, fields = compare_outputs(a, moved)
    assert not ok and fields == "differs: hidden" and diff == pytest.approx(1e-3)
    nested = compare_outputs({"h": (torch.ones(1), torch.ones(1))}, {"h": (torch.ones(1), torch.zeros(1))})
    assert nested[2] == "differs: h[1]"


def test_verify_names_the_output_field_that_differs():
    class Out(nn.Module):
        def __init__(self, shift):
            super().__init__()
            self.bn, self.shift = nn.BatchNorm1d(3), shift

        def forward(self, x):
            y = self.bn(x)
            return {"logits": y, "aux": y.sum(1) + self.shift}

    result = verify_models(Out(0.0).eval(), Out(1.0).eval(), (4, 3), world_sizes=(), perturb=False)
    assert result.checks[0].passed is False and "differs: aux" in result.checks[0].detail


class Parametrized(nn.Module):
    """A weight-normed conv (torch.nn.utils.parametrizations, as wav2vec2-conformer has): torch.save of the
    module raises RuntimeError, not a pickling error."""

    def __init__(self):
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv2d(3, 4, 3))
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


def build_parametrized():
    return convert(Parametrized(), "sync").model


def test_a_parametrized_model_goes_by_recipe_and_without_one_is_refused_in_one_line():
    torch.manual_seed(0)
    source = Parametrized().eval()
    converted = convert(source, "sync").model.eval()
    with pytest.raises(UnshippableModelError, match="RuntimeError"):
        verify_models(source, converted, (2, 3, 8, 8), world_sizes=(2,), perturb=False)
    result = verify_models(
        source, converted, (2, 3, 8, 8), world_sizes=(2,), perturb=False, rebuild_converted=build_parametrized
    )
    assert [c.passed for c in result.checks if "ranks" in c.name] == [True], result.checks


class MakesFloat32(nn.Module):
    """Conv + BN, then a matmul with a float32 tensor it makes itself (DAB-DETR's sine position embedding
    does): the model cannot run in float64."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.bn(self.conv(x)).mean((2, 3))
        return y @ torch.linspace(-1, 1, 8, dtype=torch.float32).reshape(4, 2)


def test_a_model_that_does_not_run_in_float64_is_checked_on_ranks_in_float32():
    torch.manual_seed(0)
    source = MakesFloat32().eval()
    converted = convert(source, "sync").model.eval()
    result = verify_models(source, converted, (2, 3, 8, 8), world_sizes=(2,), perturb=False)
    ranks = [c for c in result.checks if "ranks" in c.name]
    assert [c.passed for c in ranks] == [True], ranks
    assert "float32, each tensor within" in ranks[0].detail and "does not run in float64" in ranks[0].detail
    converted.bn.weight = nn.Parameter(converted.bn.weight.detach() * 1.01)  # its own tensor: a real difference
    wrong = verify_models(source, converted, (2, 3, 8, 8), world_sizes=(2,), perturb=False)
    assert [c.passed for c in wrong.checks if "ranks" in c.name] == [False]
