"""Untrusted files (issue 12): no code runs from a file, no model silently differs from what
its file says, no data is lost or clobbered, and every failure is one line with its own code."""

from __future__ import annotations

import ast
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _forked import run_python
from typer.testing import CliRunner

import bnsurgeon
from bnsurgeon.cli.commands import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]

TINY = """
import os
import torch
from torch import nn


def build(width=4, note=None):
    if note:
        open(os.environ.get("TINY_MARK", "called.txt"), "w").write(str(note))
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, width, 3), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.Conv2d(width, width, 1), nn.BatchNorm2d(width))


def wide():
    return build(width=6)


def needs_args(depth):
    return build()


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = build()

    def forward(self, x):
        raise RuntimeError("this model always fails")


def broken():
    return Broken()
"""


def run(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200", **(env or {})})


def listing(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir() if p.name != "__pycache__"}


def one_line_failure(result, code, *phrases):
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    flat = " ".join(result.output.split())
    for phrase in phrases:
        assert phrase in flat, flat


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    (tmp_path / "tiny.py").write_text(TINY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TINY_MARK", str(tmp_path / "called.txt"))
    for name in ("tiny", "tied"):
        sys.modules.pop(name, None)
    yield tmp_path
    for name in ("tiny", "tied"):
        sys.modules.pop(name, None)


@pytest.fixture
def good(tiny):
    out = tiny / "good.safetensors"
    assert run("convert", "tiny:build", "-o", out, "--input-shape", "2,3,8,8").exit_code == 0
    return out


def edited(path: Path, out: Path, tensors=None, **fields) -> Path:
    """A copy of a bnsurgeon .safetensors with some bnsurgeon.* metadata replaced (raw strings kept raw)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
        stored = {k: handle.get_tensor(k).clone() for k in handle.keys()}
    for key, value in fields.items():
        metadata[f"bnsurgeon.{key}"] = value if isinstance(value, str) and key.startswith("raw_") else json.dumps(value)
    metadata = {k.replace("bnsurgeon.raw_", "bnsurgeon."): v for k, v in metadata.items()}
    save_file(tensors(stored) if tensors else stored, str(out), metadata=metadata)
    return out


def overwrite_tensor_bytes(path: Path, value: int) -> None:
    """Rewrite every tensor byte of a .safetensors file in place (same size, same inode)."""
    with open(path, "r+b") as handle:
        header = int.from_bytes(handle.read(8), "little")
        handle.seek(8 + header)
        handle.write(bytes([value]) * (path.stat().st_size - 8 - header))


# ---- 1. verify never runs a factory a file names -----------------------------------------


def test_verify_never_imports_a_factory_named_by_the_converted_file(good, tiny):
    marker = tiny / "pwned"
    evil = edited(
        good,
        tiny / "evil.safetensors",
        architecture={"kind": "factory", "name": "os:system", "kwargs": {"command": f"touch {marker}"}},
    )
    first = run("verify", "tiny:build", evil, "--input-shape", "2,3,8,8")
    second = run("verify", good, evil, "--model", "tiny:build", "--input-shape", "2,3,8,8")
    assert not marker.exists()
    for result in (first, second):
        one_line_failure(result, 10, "factory 'os:system'", "confirm it with --converted-model os:system")


def test_a_python_caller_is_told_the_keyword_to_confirm_a_factory_once(good, tiny):
    """str() of the error rewrites the hint's flags as keywords; the hint also carried its own
    '(Python: model=...)', so a Python caller read the keyword twice."""
    from bnsurgeon.core.errors import ConfirmationError

    with pytest.raises(ConfirmationError) as caught:
        bnsurgeon.load(good)
    message = str(caught.value)
    assert "model='tiny:build'" in message and message.count("tiny:build") == 2, message  # the file's, the fix's
    assert "--model" not in message and "Python:" not in message, message


def test_verify_confirmation_for_source_extends_only_to_the_same_factory(good, tiny):
    """Naming tiny:build for SOURCE confirms a CONVERTED that records tiny:build (issue 32: it runs
    anyway), never one that records another factory."""
    wide = tiny / "wide.safetensors"
    assert run("convert", "tiny:wide", "-o", wide, "--input-shape", "2,3,8,8").exit_code == 0
    result = run("verify", good, wide, "--model", "tiny:build", "--input-shape", "2,3,8,8")
    one_line_failure(result, 10, "factory 'tiny:wide'", "--converted-model tiny:wide")
    same = run("verify", good, good, "--model", "tiny:build", "--input-shape", "2,3,8,8", "--no-perturb")
    assert same.exit_code == 0, same.output


# ---- 2. kwargs recorded in a file are data that needs confirmation -----------------------


def test_recorded_kwargs_do_not_flow_into_a_confirmed_factory(good, tiny):
    evil = edited(
        good,
        tiny / "evil.safetensors",
        architecture={"kind": "factory", "name": "tiny:build", "kwargs": {"note": "from the file"}},
    )
    result = run("convert", evil, "--model", "tiny:build", "--to", "plain", "-o", tiny / "o.safetensors")
    one_line_failure(result, 10, "note='from the file'", "--model-arg \"note='from the file'\"")
    assert not (tiny / "called.txt").exists() and not (tiny / "o.safetensors").exists()

    confirmed = run(
        "convert",
        evil,
        "--model",
        "tiny:build",
        "--model-arg",
        "note='from the file'",
        "--to",
        "plain",
        "-o",
        tiny / "o.safetensors",
        "--input-shape",
        "2,3,8,8",
    )
    assert confirmed.exit_code == 0, confirmed.output
    report = json.loads((tiny / "o.safetensors.report.json").read_text())
    assert "note='from the file'" in report["source"]


def test_recorded_timm_kwargs_the_weights_cannot_check_need_confirmation(tmp_path):
    out = tmp_path / "r.safetensors"
    assert run("convert", "resnet18", "-o", out, "--model-arg", "num_classes=10").exit_code == 0
    assert isinstance(bnsurgeon.load(out), torch.nn.Module)  # num_classes is checked by the fc weights
    pooled = edited(
        out,
        tmp_path / "pooled.safetensors",
        architecture={"kind": "timm", "name": "resnet18", "kwargs": {"num_classes": 10, "global_pool": "max"}},
    )
    result = run("convert", pooled, "--to", "plain", "-o", tmp_path / "p.safetensors")
    one_line_failure(result, 10, "global_pool='max'", "--accept-recorded-args")
    model = bnsurgeon.load(pooled, model_args={"global_pool": "max"})
    assert model.global_pool.pool_type == "max"


# ---- 3. a loaded model owns its memory; convert's input may change under it ------------------


@pytest.fixture
def timm_file(tmp_path):
    """A self-describing checkpoint (no factory): load rebuilds it on the meta device."""
    out = tmp_path / "t.safetensors"
    assert run("convert", "test_resnet", "-o", out, "--input-shape", "2,3,32,32").exit_code == 0
    return out


def test_load_owns_its_memory_and_mmap_is_an_explicit_opt_in(timm_file):
    model = bnsurgeon.load(timm_file)
    before = model.conv1[0].weight.detach().clone()
    overwrite_tensor_bytes(timm_file, 0x7F)  # in place, as a training script saving to the same path would
    assert torch.equal(model.conv1[0].weight, before)

    mapped = bnsurgeon.load(timm_file, mmap=True)  # the opt-in keeps views of the file
    overwrite_tensor_bytes(timm_file, 0)
    assert torch.equal(mapped.conv1[0].weight, torch.zeros_like(before))


def test_load_then_truncate_then_forward_does_not_crash(timm_file):
    script = textwrap.dedent(f"""
        import torch, bnsurgeon
        model = bnsurgeon.load({str(timm_file)!r}).eval()
        open({str(timm_file)!r}, "wb").close()
        with torch.no_grad():
            print(float(model(torch.ones(1, 3, 32, 32)).sum()))
    """)
    done = run_python(
        script,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-500:])


def test_convert_input_rewritten_during_the_run_never_mixes_versions(good, tiny, monkeypatch):
    import tiny as tiny_module

    original = {k: v.clone() for k, v in bnsurgeon.load(good, model="tiny:build").state_dict().items()}
    real_build = tiny_module.build

    def build_and_rewrite_input(**kwargs):  # runs after the input was read, before its tensors are used
        overwrite_tensor_bytes(good, 0)
        return real_build(**kwargs)

    monkeypatch.setattr(tiny_module, "build", build_and_rewrite_input)
    out = tiny / "o.safetensors"
    result = run("convert", good, "--model", "tiny:build", "--to", "plain", "-o", out, "--input-shape", "2,3,8,8")
    if result.exit_code == 0:
        monkeypatch.setattr(tiny_module, "build", real_build)
        written = bnsurgeon.load(out, model="tiny:build").state_dict()
        assert all(torch.equal(written[k], v) for k, v in original.items())
    else:
        one_line_failure(result, 4, "changed while")
        assert not out.exists()


def test_input_rewritten_while_it_is_read_is_refused(good, tiny, monkeypatch):
    import safetensors

    real_open = safetensors.safe_open

    class TouchedWhileOpen:  # another process rewrites the file while bnsurgeon has it open
        def __init__(self, filename, *args, **kwargs):
            self.filename, self.handle = filename, real_open(filename, *args, **kwargs)

        def __enter__(self):
            return self.handle.__enter__()

        def __exit__(self, *exc):
            os.utime(self.filename, ns=(1, 1))
            return self.handle.__exit__(*exc)

    monkeypatch.setattr(safetensors, "safe_open", TouchedWhileOpen)
    before = listing(tiny)
    result = run("convert", good, "--model", "tiny:build", "-o", tiny / "o.safetensors")
    one_line_failure(result, 4, "changed while bnsurgeon was reading it")
    assert set(listing(tiny)) == set(before)


# ---- 4. every metadata field is validated ---------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"aliases": {"1.weight": "1.bias"}}, "which the file stores itself"),
        (
            {
                "target": "plain",
                "classes": {},
                "history": [{"target": "plain", "frozen": "keep", "allow_unhandled": False}],
            },
            "modules differ",
        ),
        ({"target": "plain", "classes": {}}, "ends with target 'sync', but the file records 'plain'"),
        ({"schema": 2}, "written by a newer bnsurgeon (metadata schema 2"),
        ({"raw_architecture": "{not json"}, "is not valid JSON"),
        ({"architecture": ["tiny:build"]}, "must be an object"),
        ({"raw_classes": '{"1": 5}'}, "must map names to names"),
        (
            {"classes": {"1": "evil.module.Class", "4": "torch.nn.modules.batchnorm.BatchNorm2d"}},
            "no rule claims or produces",
        ),
        ({"target": "sideways"}, "not one of sync, plain, frozen"),
    ],
)
def test_metadata_is_validated_against_the_tensors_and_the_registry(good, tiny, fields, message):
    bad = edited(good, tiny / "bad.safetensors", **fields)
    before = listing(tiny)
    result = run("convert", bad, "--model", "tiny:build", "--to", "plain", "-o", tiny / "o.safetensors")
    one_line_failure(result, 4, message)
    assert listing(tiny) == before
    if "schema" in fields:
        assert "upgrade bnsurgeon" in " ".join(result.output.split())


def test_alias_to_a_tensor_the_model_does_not_share_is_refused(good, tiny):
    def drop_weight(stored):
        stored.pop("1.weight")
        return stored

    bad = edited(good, tiny / "bad.safetensors", tensors=drop_weight, aliases={"1.weight": "1.bias"})
    before = listing(tiny)
    result = run("convert", bad, "--model", "tiny:build", "--to", "plain", "-o", tiny / "o.safetensors")
    one_line_failure(result, 4, "says '1.weight' is the same tensor as '1.bias'", "does not share them")
    assert listing(tiny) == before


def test_weights_tied_in_the_model_stay_one_tensor_after_load(tiny):
    (tiny / "tied.py").write_text(
        TINY
        + """

def tied():
    model = build()
    model[3] = nn.Conv2d(4, 4, 1, bias=False)
    model.add_module("5", nn.Conv2d(4, 4, 1, bias=False))
    model[5].weight = model[3].weight
    return model
"""
    )
    out = tiny / "t.safetensors"
    assert run("convert", "tied:tied", "-o", out, "--input-shape", "2,3,8,8").exit_code == 0
    model = bnsurgeon.load(out, model="tied:tied")
    assert model[5].weight is model[3].weight  # one Parameter, as in the model that was saved
    assert torch.equal(model[3].weight, __import__("tied").tied()[3].weight)


# ---- 5. exactly one concurrent writer wins ---------------------------------------------------


def test_an_output_that_appears_during_the_write_is_never_clobbered(tiny, monkeypatch):
    import safetensors.torch

    out = tiny / "o.safetensors"
    real_save = safetensors.torch.save_file

    def save_while_another_run_finishes(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        out.write_bytes(b"the other run's checkpoint")

    monkeypatch.setattr(safetensors.torch, "save_file", save_while_another_run_finishes)
    result = run("convert", "tiny:build", "-o", out, "--input-shape", "2,3,8,8")
    one_line_failure(result, 8, "appeared while bnsurgeon was writing")
    assert out.read_bytes() == b"the other run's checkpoint"
    assert sorted(p.name for p in tiny.iterdir() if p.name.startswith("o.")) == ["o.safetensors"]


# ---- 6. SIGTERM/SIGHUP during the write leave nothing; stale temps are removed ------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_termination_during_the_write_leaves_no_debris(tiny, signum):
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(tiny)!r})
        import safetensors.torch
        real = safetensors.torch.save_file
        def save_then_die(tensors, filename, metadata=None):
            real(tensors, filename, metadata=metadata)
            os.kill(os.getpid(), {int(signum)})
        safetensors.torch.save_file = save_then_die
        from bnsurgeon.cli.commands import app
        sys.argv = ["bnsurgeon", "convert", "tiny:build", "-o", {str(tiny / "o.safetensors")!r}, "--input-shape", "2,3,8,8"]
        app()
    """)
    before = listing(tiny)
    done = run_python(
        script,
        timeout=120,
        cwd=tiny,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
    )
    assert done.returncode == 128 + signum, done.stderr[-800:]
    assert "interrupted" in done.stderr and "nothing was written" in done.stderr
    assert listing(tiny) == before


def test_termination_after_the_write_says_the_files_are_there(tiny):
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(tiny)!r})
        import bnsurgeon.cli.render
        def render_then_die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
        bnsurgeon.cli.render.render_report = render_then_die
        from bnsurgeon.cli.commands import app
        sys.argv = ["bnsurgeon", "convert", "tiny:build", "-o", {str(tiny / "o.safetensors")!r}, "--input-shape", "2,3,8,8"]
        app()
    """)
    done = run_python(
        script,
        timeout=120,
        cwd=tiny,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
    )
    assert done.returncode == 143, done.stderr[-800:]
    flat = " ".join(done.stderr.split())
    assert "o.safetensors and its reports were written completely" in flat and "nothing was written" not in flat
    assert bnsurgeon.load(tiny / "o.safetensors", model="tiny:build") is not None


def test_stale_temp_files_of_dead_runs_are_removed(tiny):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tiny / f".o.safetensors.bnsurgeon-tmp-{dead.pid}-0123abcd"
    stale.mkdir()
    (stale / "o.safetensors").write_bytes(b"partial")
    assert run("convert", "tiny:build", "-o", tiny / "o.safetensors", "--input-shape", "2,3,8,8").exit_code == 0
    assert not stale.exists()


# ---- 7. checkpoint and reports are one unit; reports need --force ---------------------------


def test_existing_report_needs_force(tiny):
    (tiny / "o.safetensors.report.md").write_text("my notes")
    result = run("convert", "tiny:build", "-o", tiny / "o.safetensors", "--input-shape", "2,3,8,8")
    one_line_failure(result, 8, "o.safetensors.report.md already exists", "--force")
    assert (tiny / "o.safetensors.report.md").read_text() == "my notes" and not (tiny / "o.safetensors").exists()


@pytest.mark.parametrize(
    "failure, code, message",
    [
        (KeyboardInterrupt(), 130, "interrupted"),
        (OSError(errno.ENOSPC, "No space left on device"), 8, "No space left on device"),
    ],
)
def test_failure_while_writing_reports_leaves_the_previous_checkpoint(tiny, monkeypatch, failure, code, message):
    from bnsurgeon.surgery.report import Report

    out = tiny / "o.safetensors"
    for path in (out, tiny / "o.safetensors.report.json", tiny / "o.safetensors.report.md"):
        path.write_bytes(b"previous " + path.name.encode())

    def fail(self):
        raise failure

    monkeypatch.setattr(Report, "to_markdown", fail)
    before = listing(tiny)
    result = run("convert", "tiny:build", "-o", out, "--force", "--input-shape", "2,3,8,8")
    one_line_failure(result, code, message, "nothing was written", "unchanged")
    assert listing(tiny) == before and out.read_bytes() == b"previous o.safetensors"


# ---- 8. the umask decides the mode of new files; --force keeps the old mode -------------------


def test_new_files_honour_the_umask_and_replaced_files_keep_their_mode(tiny):
    old = os.umask(0o022)
    try:
        out = tiny / "o.safetensors"
        assert run("convert", "tiny:build", "-o", out, "--input-shape", "2,3,8,8").exit_code == 0
        for path in (out, tiny / "o.safetensors.report.json", tiny / "o.safetensors.report.md"):
            assert path.stat().st_mode & 0o777 == 0o644, path
        out.chmod(0o640)
        assert run("convert", "tiny:build", "-o", out, "--force", "--input-shape", "2,3,8,8").exit_code == 0
        assert out.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)


# ---- 9. one line, a fix and a specific exit code -----------------------------------------------


@pytest.mark.parametrize(
    "args, code, message",
    [
        (
            ["convert", "resnet18", "--model-arg", "output_stride=7", "-o", "o.safetensors"],
            2,
            "cannot be built with output_stride=7",
        ),
        (["convert", "resnet18", "--model-arg", "global_pool=bogus", "-o", "o.safetensors"], 2, "Invalid pool type"),
        (["convert", "tiny:build", "-o", "/proc/x.safetensors"], 8, "could not write /proc/x.safetensors"),
        (["convert", "tiny:build", "-o", "x" * 300 + ".safetensors"], 8, "byte limit"),
        (["convert", "tiny:build", "-o", "x" * 300], 8, "byte limit"),  # no suffix: a directory name, as long
        (["convert", "tiny:build", "-o", "\udcff.safetensors"], 8, "not valid UTF-8"),
        (["convert", "tiny:needs_args", "-o", "o.safetensors"], 2, "cannot be called with no arguments"),
        (["convert", "builtins:eval", "-o", "o.safetensors"], 2, "cannot be called with no arguments"),
        (["convert", "..mod:fn", "-o", "o.safetensors"], 2, "not a factory of the form package.module:function"),
        (["convert", ":fn", "-o", "o.safetensors"], 2, "not a factory of the form package.module:function"),
        (
            ["convert", "tiny:build", "--input-shape", "2,5,8,8", "-o", "o.safetensors"],
            9,
            "cannot run on the input (2, 5, 8, 8)",
        ),
        (
            ["convert", "tiny:build", "--input-shape", "99999,3,9999,9999", "-o", "o.safetensors"],
            9,
            "more than this machine's",
        ),
        (["convert", "tiny:broken", "-o", "o.safetensors"], 9, "this model always fails"),
        (["verify", "tiny:build", "tiny:wide", "--input-shape", "2,3,8,8"], 6, "is not a conversion of"),
        (["verify", "tiny:broken", "tiny:broken", "--input-shape", "2,3,8,8"], 9, "this model always fails"),
    ],
)
def test_each_bad_input_is_one_line_with_its_own_code(tiny, args, code, message):
    before = listing(tiny)
    result = run(*args)
    one_line_failure(result, code, message, "fix:")
    assert listing(tiny) == before


@pytest.mark.parametrize("value", ["abc", "inf", "nan"])
def test_bad_dist_timeout_is_a_usage_error(tiny, value):
    before = listing(tiny)
    for args in (["verify", "tiny:build", "tiny:build"], ["convert", "tiny:build", "-o", "o.safetensors", "--verify"]):
        result = run(*args, "--input-shape", "2,3,8,8", env={"BNSURGEON_DIST_TIMEOUT": value})
        one_line_failure(result, 2, f"BNSURGEON_DIST_TIMEOUT='{value}'", "fix:")
    assert listing(tiny) == before


# ---- 10. non-finite weights are named; random bytes are unreadable, not unsafe ------------------


def test_non_finite_weights_are_named(good, tiny):
    def poison(stored):
        stored["1.running_var"][0] = float("nan")
        return stored

    bad = edited(good, tiny / "nan.safetensors", tensors=poison)
    result = run("convert", bad, "--model", "tiny:build", "--to", "plain", "-o", tiny / "o.safetensors")
    one_line_failure(result, 4, "non-finite values (NaN or Inf)", "1.running_var")


def test_random_bytes_in_a_pt_are_not_a_checkpoint(tiny):
    path = tiny / "noise.pt"
    path.write_bytes(bytes(range(256)) * 20)
    result = run("convert", path, "--model", "tiny:build", "-o", tiny / "o.safetensors")
    one_line_failure(result, 4, "not a readable PyTorch checkpoint")
    assert "--trust-pickle" not in result.output


# ---- the loading code: api.py is a facade, imports flow one way ----------------------------------


def test_api_is_a_facade_that_nothing_imports_back():
    package = ROOT / "bnsurgeon"
    for path in package.rglob("*.py"):
        if path.name in ("api.py", "__init__.py", "cli.py", "__main__.py") and path.parent == package:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                relative_api = node.level > 0 and (
                    node.module == "api" or (node.module is None and any(alias.name == "api" for alias in node.names))
                )
                assert not relative_api and node.module != "bnsurgeon.api", f"{path} imports from api.py"
    facade = ast.parse((package / "api.py").read_text())
    assert not [n for n in facade.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
