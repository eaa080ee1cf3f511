"""Issue 16: what the command line prints, and what it says it does.

Human output read without a terminal (logs, CI): plain aligned columns, no box
drawing, no line over the width; verify prints each check as it finishes; a model with
no BN is a distinct signal; training checkpoints keep every entry; the help and the
README say what the tool does; mistyped names are resolved; ``rules`` needs no torch.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _modules import install_module
from typer.testing import CliRunner

import bnsurgeon
from bnsurgeon.cli.commands import app
from bnsurgeon.core import errors
from bnsurgeon.files.torch_pickle import load_weights_only

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
BOX_DRAWING = re.compile("[\u2500-\u257f]")  # ─ │ ┌ ╭ ... : the whole Unicode box-drawing block
SMALL = "2,3,16,16"

MODELS = """
import torch
from torch import nn
from timm.layers import BatchNormAct2d


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), BatchNormAct2d(8), nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4))


def frozen_small():
    from torchvision.ops.misc import FrozenBatchNorm2d

    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), FrozenBatchNorm2d(8), nn.Conv2d(8, 4, 1))


def no_bn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1))


class OddNorm(nn.BatchNorm2d):
    pass


def unhandled():
    return nn.Sequential(nn.Conv2d(3, 4, 1), OddNorm(4))
"""


@pytest.fixture
def models(tmp_path, monkeypatch):
    return install_module(tmp_path, monkeypatch, "omodels", MODELS)


def invoke(*args, columns: int | None = None):
    """The command as a log sees it: no terminal, COLUMNS set or not."""
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": str(columns) if columns else None})


def files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name != "__pycache__"}


# 1. piped output ---------------------------------------------------------------------------


def assert_readable(text: str, width: int) -> None:
    assert text.strip(), "no output at all"
    assert not BOX_DRAWING.search(text), text
    too_long = [line for line in text.splitlines() if len(line) > width]
    assert not too_long, f"lines over {width} columns: {too_long}"


def assert_nothing_cut(text: str) -> None:
    """No box drawing, and no cell shortened: layout.shorten ends a cut cell in "..." (issue 47: a log is
    never truncated, whatever COLUMNS says)."""
    assert text.strip(), "no output at all"
    assert not BOX_DRAWING.search(text), text
    cut = [line for line in text.splitlines() if re.search(r"\S\.\.\.( |$)", line)]
    assert not cut, f"cells cut off a terminal: {cut}"


@pytest.mark.parametrize("columns", [None, 80, 60])
def test_every_command_reads_well_without_a_terminal(models, columns):
    """Each command's human output and --help: no box drawing; off a terminal no table cell is cut and no
    column dropped, COLUMNS or not (prose wraps at it, or at 160; Click lays out --help)."""
    from bnsurgeon.cli.render import PIPED_WIDTH

    width = columns or PIPED_WIDTH
    sync = models / "s.sync.safetensors"
    checkpoint = models / "train.pth.tar"
    torch.save(
        {
            "state_dict": {f"module.{k}": v for k, v in __import__("omodels").small().state_dict().items()},
            "epoch": 1,
            "optimizer": {"state": {0: {"momentum_buffer": torch.zeros(2)}}, "param_groups": []},
        },
        checkpoint,
    )
    runs = [
        invoke("inspect", "tf_efficientnet_b3", columns=columns),
        invoke("inspect", "tf_efficientnet_b3", "-v", columns=columns),
        invoke("inspect", checkpoint, "-m", "omodels:small", columns=columns),
        invoke("convert", "omodels:small", "-o", sync, "--input-shape", SMALL, columns=columns),
        invoke("rules", columns=columns),
        invoke("rules", "-v", columns=columns),
        invoke(
            "verify",
            "omodels:small",
            sync,
            "--converted-model",
            "omodels:small",
            "--input-shape",
            SMALL,
            "-w",
            "2",
            "--no-perturb",
            columns=columns,
        ),
    ]
    helps = [
        invoke(*command, "--help", columns=columns) for command in ([], ["inspect"], ["convert"], ["verify"], ["rules"])
    ]
    for result in runs:
        assert result.exit_code == 0, result.output
        assert_nothing_cut(result.output)
    for result in helps:  # Click lays help out at 80 columns at most (narrower terminals: not fitted)
        assert result.exit_code == 0, result.output
        assert_readable(result.output, max(width, 80) if columns is None else 80)
    inspect_b3 = runs[0].output
    assert re.search(r"BatchNormAct2d\s+78\s+timm-batchnorm-act", inspect_b3), inspect_b3
    # piped, at any COLUMNS: every column under its full header, every cell whole
    for whole in ("torch convert_sync_batchnorm", "transformers replace_batch_norm", "example paths"):
        assert whole in inspect_b3, inspect_b3
    assert "drops act=SiLU, drop " in inspect_b3 and "drops act=SiLU (52/78); eps 0.001 -> 1e-05" in inspect_b3


def test_a_terminal_is_fitted_by_dropping_columns_not_wrapping():
    from bnsurgeon.core.layout import Column, table_lines

    columns = [
        Column("name"),
        Column("count", "right"),
        Column("extra", priority=1),
        Column("path", priority=2, shrink=True, min_width=8),
    ]
    rows = [["BatchNormAct2d", "78", "SyncBatchNormAct", "blocks.0.0.bn1, blocks.0.0.bn2, blocks.1.0.bn1"]]
    wide = table_lines(columns, rows, 200)
    assert len(wide) == 2 and "blocks.1.0.bn1" in wide[1]
    shortened = table_lines(columns, rows, 70)  # free text is shortened before any column goes
    assert len(shortened) == 2 and all(len(line) <= 70 for line in shortened)
    assert "SyncBatchNormAct" in shortened[1] and "blocks.0.0.bn1" in shortened[1] and shortened[1].endswith("...")
    narrow = table_lines(columns, rows, 48)  # then the lowest-priority column is dropped
    assert len(narrow) == 2 and all(len(line) <= 48 for line in narrow)
    assert "SyncBatchNormAct" in narrow[1] and "blocks" not in narrow[1]
    narrower = table_lines(columns, rows, 30)
    assert "SyncBatchNormAct" not in narrower[1] and "BatchNormAct2d" in narrower[1] and len(narrower) == 2


# 2. verify streams its checks --------------------------------------------------------------


def test_verify_reports_each_check_as_it_finishes_with_its_time(models):
    sync = models / "s.sync.safetensors"
    assert invoke("convert", "omodels:small", "-o", sync, "--input-shape", SMALL).exit_code == 0
    seen = []
    from bnsurgeon import api

    result = api.verify(
        "omodels:small",
        str(sync),
        world_sizes=(2,),
        input_shape=(2, 3, 16, 16),
        converted_model="omodels:small",
        on_check=seen.append,
    )
    assert (
        [c.name for c in seen]
        == [c.name for c in result.checks]
        == [
            "eval",
            "train, one process",
            "eval (perturbed)",
            "train, one process (perturbed)",
            "2 ranks",
            "2 ranks (perturbed)",
        ]
    )
    assert all(c.seconds > 0 for c in seen) and result.passed

    cli = invoke(
        "verify", "omodels:small", sync, "--converted-model", "omodels:small", "--input-shape", SMALL, "-w", "2"
    )
    lines = cli.output.splitlines()
    for check in result.checks:
        line = next(line for line in lines if line.strip().startswith(check.name + "  "))
        assert re.search(r"\bpass\b.*\s\d+\.\d+s\b", line), line
    assert "all checks passed" in lines[-1]


# 3. nothing to convert ---------------------------------------------------------------------


def test_a_model_without_bn_is_a_distinct_exit_and_writes_nothing(models):
    out = models / "x.safetensors"
    before = files(models)
    result = invoke("convert", "omodels:no_bn", "-o", out, "--input-shape", SMALL)
    assert result.exit_code == 11, result.output
    assert "has no BatchNorm-family module: there is nothing to convert" in result.output
    assert "--allow-no-bn" in result.output and "Traceback" not in result.output
    assert files(models) == before

    with pytest.raises(errors.NothingToConvertError) as raised:
        bnsurgeon.convert_source("omodels:no_bn", None, input_shape=(2, 3, 16, 16))
    assert "allow_no_bn=True" in str(raised.value)

    allowed = runner.invoke(
        app, ["convert", "omodels:no_bn", "-o", str(out), "--input-shape", SMALL, "--allow-no-bn", "--json"]
    )
    assert allowed.exit_code == 0 and out.exists()
    assert json.loads(allowed.stdout)["totals"]["changed"] == 0


# 4. training checkpoints -------------------------------------------------------------------


def training_checkpoint(path: Path, model: torch.nn.Module) -> dict:
    """A timm-style training checkpoint: weights, EMA weights, SGD state with momentum, epoch, args."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()
    model(torch.randn(4, 3, 16, 16)).sum().backward()
    optimizer.step()
    ema = {k: v.clone() + 0.25 if v.is_floating_point() else v.clone() for k, v in model.state_dict().items()}
    entries = {
        "epoch": 7,
        "state_dict": model.state_dict(),
        "state_dict_ema": ema,
        "optimizer": optimizer.state_dict(),
        "args": argparse.Namespace(lr=0.1),
        "metric": 0.5,
    }
    torch.save(entries, path)
    return entries


def test_training_checkpoint_carries_every_entry_and_a_valid_optimizer(models):
    from omodels import small

    from bnsurgeon.runtime import SyncBatchNormAct

    source = models / "last.pth.tar"
    entries = training_checkpoint(source, small())
    out = models / "last.sync.pth.tar"
    result = invoke("convert", source, "-m", "omodels:small", "-o", out, "--input-shape", SMALL)
    assert result.exit_code == 0, result.output
    assert "carried from the source checkpoint" in result.output and "optimizer" in result.output

    # torch's weights_only load with what timm's args entry needs admitted for this load, as on input
    written = load_weights_only(out, also_allowed=[argparse.Namespace])
    assert {"epoch", "state_dict", "state_dict_ema", "optimizer", "args", "metric"} <= set(written)
    assert written["epoch"] == 7 and written["args"].lr == 0.1 and written["metric"] == 0.5
    # the EMA weights are converted like the model: same keys as the converted state dict, EMA values
    assert set(written["state_dict_ema"]) == set(written["state_dict"])
    for key, value in entries["state_dict_ema"].items():
        assert torch.equal(written["state_dict_ema"][key], value), key
    ema_model = bnsurgeon.load(out, model="omodels:small")
    ema_model.load_state_dict(written["state_dict_ema"])  # strict: the converted model's keys exactly
    assert isinstance(ema_model[1], SyncBatchNormAct)

    # the optimizer state still belongs to the same parameters: resume and step identically
    model = bnsurgeon.load(out, model="omodels:small")
    resumed = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    resumed.load_state_dict(written["optimizer"])
    for index, param in enumerate(model.parameters()):
        assert torch.equal(
            resumed.state[param]["momentum_buffer"], entries["optimizer"]["state"][index]["momentum_buffer"]
        )

    report = json.loads((models / "last.sync.pth.tar.report.json").read_text())
    assert set(report["carried"]) == {"epoch", "state_dict_ema", "optimizer", "args", "metric"}
    assert "converted to sync" in report["carried"]["state_dict_ema"]
    assert "still valid" in report["carried"]["optimizer"]


@pytest.mark.distributed
def test_verify_picks_the_ema_weights_of_both_training_checkpoints(models):
    from omodels import small

    source = models / "last.pth.tar"
    training_checkpoint(source, small())
    out = models / "last.sync.pth.tar"
    assert invoke("convert", source, "-m", "omodels:small", "-o", out, "--input-shape", SMALL).exit_code == 0
    both = (
        "verify",
        source,
        out,
        "-m",
        "omodels:small",
        "--converted-model",
        "omodels:small",
        "--input-shape",
        SMALL,
        "--no-perturb",
        "--json",
    )
    ema = invoke(*both, "--weights", "state_dict_ema", "--converted-weights", "state_dict_ema")
    assert ema.exit_code == 0, ema.output
    mixed = invoke(*both, "--weights", "state_dict_ema")  # the EMA against the converted model's own weights
    assert mixed.exit_code == 1 and json.loads(mixed.stdout)["checks"][0]["passed"] is False
    missing = invoke(*both, "--converted-weights", "nope")
    assert missing.exit_code == 2 and "has no weights named 'nope'" in missing.output


def test_frozen_target_with_optimizer_state_is_refused_with_the_reason(models):
    from omodels import small

    source = models / "last.pth.tar"
    training_checkpoint(source, small())
    before = files(models)
    result = invoke(
        "convert", source, "-m", "omodels:small", "--to", "frozen", "-o", models / "f.pth.tar", "--input-shape", SMALL
    )
    assert result.exit_code == 2, result.output
    assert "optimizer state" in result.output and "parameters become buffers" in result.output
    assert files(models) == before
    # weights only: the entries are listed as not written, and the conversion goes ahead
    safetensors = models / "f.safetensors"
    ok = invoke("convert", source, "-m", "omodels:small", "--to", "frozen", "-o", safetensors, "--input-shape", SMALL)
    assert ok.exit_code == 0, ok.output
    report = json.loads((models / "f.safetensors.report.json").read_text())
    assert "not written" in report["carried"]["optimizer"]


def test_frozen_model_to_frozen_keeps_the_optimizer_proven_valid(models):
    from omodels import frozen_small

    source = models / "frozen.pth"
    model = frozen_small()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    optimizer.step()
    torch.save({"state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}, source)
    result = invoke(
        "convert",
        source,
        "-m",
        "omodels:frozen_small",
        "--to",
        "frozen",
        "-o",
        models / "f.pth",
        "--input-shape",
        SMALL,
    )
    assert result.exit_code == 0, result.output
    assert "still valid" in json.loads((models / "f.pth.report.json").read_text())["carried"]["optimizer"]


def test_inspect_counts_the_tensors_nested_in_an_optimizer_state(models):
    from omodels import small

    source = models / "last.pth.tar"
    entries = training_checkpoint(source, small())
    data = json.loads(runner.invoke(app, ["inspect", str(source), "-m", "omodels:small", "--json"]).stdout)
    counts = {entry["key"]: entry["tensors"] for entry in data["checkpoint"]["entries"]}
    momentum = len(entries["optimizer"]["state"])
    assert momentum == len(list(small().parameters())) and counts["optimizer"] == momentum
    assert counts["state_dict_ema"] == len(entries["state_dict_ema"])


# 5. the help and the README tell the truth -------------------------------------------------

COMMANDS = ("inspect", "convert", "verify", "rules", "recalibrate")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_quiet_verbose_and_json_and_shows_an_example(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    for flag in ("-q, --quiet", "-v, --verbose", "--json", "Example"):
        assert flag in result.output, (command, flag)
    assert not re.search(r"<(bool|str|int|float|path|text)>", result.output, re.I), result.output  # arguments too


def test_choices_are_in_the_help_and_enforced():
    help_text = invoke("convert", "--help").output
    # how the choices are shown is Typer's: <a|b> (0.20 and later) or [a|b] (0.19, the floor)
    assert re.search(r"--to [<\[]sync\|plain\|frozen\|fused[>\]]", help_text), help_text
    assert re.search(r"--frozen [<\[]keep\|unfreeze[>\]]", help_text), help_text
    assert invoke("convert", "resnet18", "-o", "x.safetensors", "--to", "fuse").exit_code == 2


def test_quiet_and_json_mean_what_the_help_says(models):
    rules = invoke("rules", "-q")
    assert rules.exit_code == 0 and rules.output == ""
    both = runner.invoke(app, ["rules", "--json"])
    assert json.loads(both.stdout) and "torch-batchnorm" in both.stderr  # human output stays on stderr
    only_json = runner.invoke(app, ["rules", "--json", "-q"])
    assert json.loads(only_json.stdout) and only_json.stderr == ""


def test_verify_json_names_its_schema_and_tool_version():
    from bnsurgeon.checks.verify import CheckOutcome, Verification

    data = Verification("a", "b", [2, 3], [CheckOutcome("eval", True)]).to_dict()
    assert data["schema_version"] == 1 and data["tool_version"] == bnsurgeon.__version__


def test_python_errors_name_the_keyword_argument(models):
    with pytest.raises(errors.UnhandledModuleError) as raised:
        bnsurgeon.convert_source("omodels:unhandled", None, input_shape=(2, 3, 4, 4))
    text = str(raised.value)
    assert "allow_unhandled=True" in text and "--allow-unhandled" not in text
    assert "--allow-unhandled" in raised.value.hint  # the command line still prints the flag
    confirm = errors.UsageError("made from a factory", "confirm with --model omodels:small, or pass --model ARCH")
    assert str(confirm) == "made from a factory (confirm with model='omodels:small', or pass model=ARCH)"


def test_commands_page_lists_every_command_and_flag():
    readme = (ROOT / "docs" / "commands.md").read_text()  # the Commands section, moved out of the README
    block = readme.split("# Commands", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    for command in COMMANDS:
        assert f"bnsurgeon {command}" in block, command
    for command in COMMANDS:
        options = re.findall(r"(--[a-z][a-z-]+)", invoke(command, "--help").output)
        documented = "".join(page.read_text() for page in (ROOT / "docs").glob("*.md"))  # was: the whole README
        missing = {o for o in options if o != "--help"} - set(re.findall(r"(--[a-z][a-z-]+)", documented))
        assert not missing, (command, missing)


# 6. names ----------------------------------------------------------------------------------


def test_model_names_match_case_insensitively_and_through_confusables():
    from bnsurgeon.loading.architecture import resolve_timm_name

    assert resolve_timm_name("Resnet50") == "resnet50"
    assert resolve_timm_name("EfficientNet_B0") == "efficientnet_b0"
    for typo, meant in [
        ("efficientnet_bO", "efficientnet_b0"),
        ("resnet5O", "resnet50"),
        ("efficientnet-b0", "efficientnet_b0"),
        ("resnetl8", "resnet18"),
    ]:
        with pytest.raises(errors.SourceNotFoundError) as raised:
            resolve_timm_name(typo)
        assert raised.value.hint.startswith(f"did you mean {meant}"), (typo, raised.value.hint)
    result = invoke("inspect", "Resnet18")
    assert result.exit_code == 0 and "BatchNorm2d" in result.output, result.output


# 7. rules without torch --------------------------------------------------------------------


def test_rules_imports_neither_torch_nor_timm():
    code = (
        "import sys; from typer.testing import CliRunner; from bnsurgeon.cli.commands import app; "
        "r = CliRunner().invoke(app, ['rules']); assert r.exit_code == 0, r.output; "
        "print(sorted(m for m in ('torch', 'timm', 'torchvision') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_static_rule_table_is_the_registry():
    import timm.layers  # noqa: F401  (their rules join the registry once imported)
    import torchvision.ops.misc  # noqa: F401

    from bnsurgeon.cli.catalog import BUILTIN_RULES, ENTRY_POINT_GROUP, registry_rows
    from bnsurgeon.rules import Registry, _named_specs, base, builtin_rules, default_registry
    from bnsurgeon.rules.openmmlab import OPTIONAL_CLASSES

    assert ENTRY_POINT_GROUP == base.ENTRY_POINT_GROUP
    # rules that join only once mmengine/Lightning are imported, or that a test named with --rules,
    # are not built in: the table lists the rules every process has
    conditional = {name for _, name, _ in OPTIONAL_CLASSES.values()} | {"detectron2-frozen"}
    named = {name for names in _named_specs.values() for name in names}
    rows = registry_rows(default_registry())
    # and transformers' frozen BN classes join once transformers has imported their model modules
    conditional |= {row["name"] for row in rows if row["name"].startswith("transformers-")}
    assert registry_rows(Registry(builtin_rules())) == BUILTIN_RULES
    # timm's and torchvision's built-in rules join the process's registry once those are imported (the order
    # of joining may differ): the same rows
    key = lambda row: row["name"]  # noqa: E731
    assert sorted((r for r in rows if r["name"] not in conditional | named), key=key) == sorted(BUILTIN_RULES, key=key)
    assert not conditional & {row["name"] for row in BUILTIN_RULES}


def test_a_long_check_name_is_shown_whole_where_the_line_has_room():
    from bnsurgeon.cli.render import _check_line

    name = "train, one process vs source thawed (perturbed)"
    line = _check_line([name, "pass", "0", "1.2s", "outputs and running statistics"], 120)
    assert name in line and "outputs and running statistics" in line and len(line) <= 120
    assert len(_check_line([name, "pass", "0", "1.2s", "outputs and running statistics"], 60)) <= 60


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["inspect", "no-such-file.pt", "--json"], 3, "no such file"),
        (["verify", "-w", "0", "--json"], 2, "--world-size must be at least 2"),
        (["verify", "--json"], 2, "Missing argument 'SOURCE'"),
        (["verify", "--bogus", "--json"], 2, "--bogus"),  # Click words it as its version does
    ],
)
def test_a_failing_command_under_json_prints_its_error_as_the_one_document(args, code, words):
    """A program reading stdout always gets one JSON document: before, a failure printed nothing there."""
    from typer.testing import CliRunner

    from bnsurgeon.cli.commands import app

    result = CliRunner().invoke(app, args)
    assert result.exit_code == code, result.output
    document = json.loads(result.stdout)
    assert document["error"]["exit_code"] == code and words in document["error"]["message"], document
    assert set(document["error"]) == {"message", "fix", "exit_code"}
