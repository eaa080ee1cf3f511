"""The sync layer is faithful to torch's API and to what the converted module had:
constructor arguments, convert_sync_batchnorm, every hook kind, TorchScript, pickling,
the timeout variable, and the header that names a layer in its rows (single process)."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
from torch import nn

import bnsurgeon
from bnsurgeon.core.errors import UsageError
from bnsurgeon.runtime import SyncBatchNorm, SyncBatchNormAct


def test_constructor_takes_every_argument_torchs_takes_with_the_same_defaults():
    theirs = inspect.signature(nn.SyncBatchNorm.__init__).parameters
    ours = inspect.signature(SyncBatchNorm.__init__).parameters
    for name, parameter in theirs.items():
        assert name in ours, f"torch's SyncBatchNorm takes {name!r}, ours does not"
        assert ours[name].default == parameter.default, name
        assert ours[name].kind == parameter.kind, name
    for cls in (SyncBatchNorm, SyncBatchNormAct):
        layer = cls(4, bias=False)
        assert layer.bias is None and layer.weight is not None
        x = torch.randn(6, 4, 3, 3)
        expected = nn.functional.batch_norm(x, None, None, layer.weight, None, True)
        torch.testing.assert_close(layer.train()(x) if cls is SyncBatchNorm else layer.train()._normalize(x), expected)


def test_bias_false_layer_survives_conversion_both_ways():
    source = nn.Sequential(nn.BatchNorm2d(4))
    source[0].register_parameter("bias", None)
    synced = bnsurgeon.convert(source, "sync").model
    assert synced[0].bias is None
    plain = bnsurgeon.convert(synced, "plain").model
    assert type(plain[0]) is nn.BatchNorm2d and plain[0].bias is None


def test_convert_sync_batchnorm_is_bnsurgeons_conversion_and_keeps_activations():
    from timm.layers import BatchNormAct2d

    model = nn.Sequential(nn.Conv2d(3, 4, 1), BatchNormAct2d(4, act_layer=nn.SiLU), nn.BatchNorm1d(4))
    converted = SyncBatchNorm.convert_sync_batchnorm(model)
    assert converted is model  # in place, like torch's
    assert type(model[1]) is SyncBatchNormAct and isinstance(model[1].act, nn.SiLU)
    assert type(model[2]) is SyncBatchNorm
    root = SyncBatchNormAct.convert_sync_batchnorm(nn.BatchNorm2d(3))
    assert type(root) is SyncBatchNorm and root.layer_name == "<root>"


def _fires(kind: str):
    """Register one hook of ``kind`` on a BatchNorm2d; return (model, calls, exercise)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    bn = model[1]
    calls: list[str] = []
    record = lambda *args, **kwargs: calls.append(kind)  # noqa: E731

    register = {
        "forward": lambda: bn.register_forward_hook(record),
        "forward_with_kwargs": lambda: bn.register_forward_hook(record, with_kwargs=True),
        "forward_always_call": lambda: bn.register_forward_hook(record, always_call=True),
        "forward_pre": lambda: bn.register_forward_pre_hook(record),
        "forward_pre_with_kwargs": lambda: bn.register_forward_pre_hook(record, with_kwargs=True),
        "full_backward": lambda: bn.register_full_backward_hook(record),
        "full_backward_pre": lambda: bn.register_full_backward_pre_hook(record),
        "legacy_backward": lambda: bn.register_backward_hook(record),
        "state_dict_post": lambda: bn.register_state_dict_post_hook(record),
        "state_dict_pre": lambda: bn.register_state_dict_pre_hook(record),
        "load_state_dict_pre": lambda: bn.register_load_state_dict_pre_hook(record),
        "load_state_dict_post": lambda: bn.register_load_state_dict_post_hook(record),
    }[kind]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy backward hook warns that it is deprecated
        handle = register()

    def exercise(m: nn.Module) -> None:
        if kind.startswith("load_state_dict"):
            m.load_state_dict(m.state_dict())
        elif kind.startswith("state_dict"):
            m.state_dict()
        else:
            x = torch.randn(2, 3, 5, 5, requires_grad=True)
            m.eval()(x).sum().backward()

    return model, calls, exercise, handle


HOOK_KINDS = [
    "forward",
    "forward_with_kwargs",
    "forward_always_call",
    "forward_pre",
    "forward_pre_with_kwargs",
    "full_backward",
    "full_backward_pre",
    "legacy_backward",
    "state_dict_post",
    "state_dict_pre",
    "load_state_dict_pre",
    "load_state_dict_post",
]


@pytest.mark.parametrize("kind", HOOK_KINDS)
@pytest.mark.parametrize("target", ["sync", "frozen", "plain-roundtrip"])
def test_every_hook_kind_is_carried_by_conversion(kind, target):
    registration = {
        "state_dict_post": "register_state_dict_post_hook",
        "load_state_dict_pre": "register_load_state_dict_pre_hook",
    }
    if kind in registration and registration[kind] not in dir(nn.Module):
        pytest.skip(f"torch {torch.__version__} has no public nn.Module.{registration[kind]} (it arrived in 2.5)")
    model, calls, exercise, handle = _fires(kind)
    exercise(model)
    fired_before = len(calls)
    assert fired_before > 0, f"{kind} hook did not fire on the source"
    if target == "plain-roundtrip":
        converted = bnsurgeon.convert(bnsurgeon.convert(model, "sync").model, "plain").model
    else:
        converted = bnsurgeon.convert(model, target).model
    assert type(converted[1]) is not nn.BatchNorm2d or target == "plain-roundtrip"
    calls.clear()
    exercise(converted)
    assert len(calls) == fired_before, (
        f"{kind} hook fired {len(calls)} times after --to {target}, {fired_before} before"
    )
    handle.remove()  # the handle still reaches the converted module's hook
    calls.clear()
    exercise(converted)
    assert calls == [], f"{kind} hook still fires after its handle was removed"


def test_torchscript_of_a_converted_model_matches_it():
    import warnings

    from timm.layers import BatchNormAct2d

    model = bnsurgeon.convert(
        nn.Sequential(nn.Conv2d(3, 4, 1), BatchNormAct2d(4, act_layer=nn.ReLU), nn.BatchNorm2d(4)), "sync"
    ).model
    x = torch.randn(2, 3, 5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated in recent torch
        scripted = torch.jit.script(copy.deepcopy(model).eval())
        trained = torch.jit.script(copy.deepcopy(model).train())
    assert torch.equal(scripted(x), model.eval()(x))
    assert torch.equal(trained(x), copy.deepcopy(model).train()(x))  # world of one: plain BN arithmetic


def test_pickle_round_trip_with_the_default_group_keeps_name_and_trains():
    model = bnsurgeon.convert(nn.Sequential(nn.BatchNorm2d(4)), "sync").model
    loaded = pickle.loads(pickle.dumps(model))
    assert loaded[0].layer_name == "0" and loaded[0].process_group is None and loaded[0]._pickled_group is None
    x = torch.randn(4, 4, 2, 2)
    assert torch.equal(loaded.train()(x), model.train()(x))


@pytest.mark.parametrize("raw", ["abc", "inf", "nan", "-5", "0", "1e999"])
def test_bad_timeout_variable_is_one_clear_error(monkeypatch, raw):
    from bnsurgeon.runtime.timeout import collective_timeout

    monkeypatch.setenv("BNSURGEON_DIST_TIMEOUT", raw)
    with pytest.raises(UsageError) as raised:
        collective_timeout()
    assert "BNSURGEON_DIST_TIMEOUT" in str(raised.value) and "positive number of seconds" in str(raised.value)


def test_timeout_variable_is_read_when_it_changes(monkeypatch):
    from bnsurgeon.runtime.timeout import collective_timeout, dist_timeout_s

    monkeypatch.delenv("BNSURGEON_DIST_TIMEOUT", raising=False)
    assert dist_timeout_s() == 600.0
    monkeypatch.setenv("BNSURGEON_DIST_TIMEOUT", "20")
    assert collective_timeout().total_seconds() == 20.0


def test_header_names_the_layer_and_counts_calls_exactly_in_float32():
    from bnsurgeon.runtime.identity import HEADER, LayerIdentity, describe_header

    identity = LayerIdentity("blocks.3.2.bn1")
    x = torch.randn(2, 7, 3)
    for _ in range(3):
        header = identity.next_header(x, torch.float32)
    assert header.shape == (HEADER,) and header.dtype == torch.float32
    assert describe_header(header) == "'blocks.3.2.bn1' forward call 3 (7 channels, float32)"
    other = LayerIdentity("blocks.3.2.bn2").next_header(x, torch.float32)
    assert not torch.equal(header[:4], other[:4])
    assert describe_header(other).startswith("'blocks.3.2.bn2' forward call 1")


def test_layers_built_directly_get_distinct_deterministic_names():
    first, second = SyncBatchNorm(8), SyncBatchNorm(8)
    assert first.layer_name != second.layer_name
    assert first.layer_name.startswith("SyncBatchNorm#") and first.layer_name.endswith("(8)")
    model = bnsurgeon.convert(nn.Sequential(first, nn.Sequential(second)), "sync").model
    assert [model[0].layer_name, model[1][0].layer_name] == ["0", "1.0"]  # converting names them by path


def test_python_hint_keeps_a_prose_word_after_a_flag_as_prose():
    from bnsurgeon.core.errors import WeightsMismatchError
    from bnsurgeon.files.weights import check_fit

    with pytest.raises(WeightsMismatchError) as raised:
        check_fit(nn.Linear(2, 2), {"weight": torch.zeros(2, 2)}, "w.pth")
    text = str(raised.value)
    assert "check model and model_args" in text and "weights to pick" in text, text
    assert "'and'" not in text and "'to'" not in text, text


def test_every_error_is_public_at_the_top_with_its_exit_code():
    """``from bnsurgeon import BnSurgeonError`` and every subclass: a caller catches them without
    reaching into an internal module (bnsurgeon.core.errors moved once already)."""
    import inspect as pyinspect

    from bnsurgeon.core import errors

    public = {
        name
        for name, value in vars(errors).items()
        if pyinspect.isclass(value)
        and issubclass(value, BaseException)
        and value.__module__ == errors.__name__
        and not name.startswith("_")
        and name != "Interrupted"
    }
    assert "BnSurgeonError" in public and len(public) > 20
    for name in sorted(public):
        assert name in bnsurgeon.__all__, name
        assert getattr(bnsurgeon, name) is getattr(errors, name), name
        value = getattr(errors, name)
        if issubclass(value, errors.BnSurgeonError):
            assert isinstance(value.exit_code, int) and 1 <= value.exit_code < 70, (name, value.exit_code)
    from bnsurgeon import BnSurgeonError, OutputError

    assert issubclass(OutputError, BnSurgeonError) and OutputError.exit_code == 8
