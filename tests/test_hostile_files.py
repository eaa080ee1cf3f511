"""More inputs tried as an attacker and an unlucky user would (after test_untrusted and
test_adversarial): output names that are the input or a directory in disguise, odd input
files, checkpoints larger than memory, lossy dtypes, impossible BN statistics, unbounded
metadata text, and option values that cannot work. Each is one line with its own exit
code, and nothing on disk is lost or misstated."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
from _forked import run_python
from test_untrusted import ROOT, edited, good, listing, one_line_failure, run, tiny  # noqa: F401 (fixtures)


def unit(directory, name="o.safetensors"):
    return {
        p: (directory / p).read_bytes()
        for p in (name, f"{name}.report.json", f"{name}.report.md")
        if (directory / p).exists()
    }


# ---- output names: the reports are outputs too --------------------------------------------------


def test_a_report_name_that_is_the_input_is_refused_even_with_force(good, tiny):
    source = tiny / "o.safetensors.report.json"
    source.write_bytes(good.read_bytes())
    before = listing(tiny)
    result = run("convert", source, "--model", "tiny:build", "--to", "plain", "-o", tiny / "o.safetensors", "--force")
    one_line_failure(result, 8, "report", "o.safetensors.report.json is the input file")
    assert listing(tiny) == before and source.read_bytes() == good.read_bytes()


def test_a_report_name_that_is_a_directory_is_refused_before_anything_is_replaced(tiny):
    out = tiny / "o.safetensors"
    out.write_bytes(b"previous checkpoint")
    (tiny / "o.safetensors.report.md").mkdir()
    result = run("convert", "tiny:build", "-o", out, "--force", "--input-shape", "2,3,8,8")
    one_line_failure(result, 8, "o.safetensors.report.md is a directory")
    assert out.read_bytes() == b"previous checkpoint" and not (tiny / "o.safetensors.report.json").exists()


def test_a_forced_write_that_fails_midway_puts_every_previous_file_back(tiny, monkeypatch):
    import errno

    out = tiny / "o.safetensors"
    assert run("convert", "tiny:build", "-o", out, "--input-shape", "2,3,8,8").exit_code == 0
    previous = unit(tiny)
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):  # the checkpoint and the JSON report are already replaced
        if str(dst).endswith(".report.md") and ".bnsurgeon-tmp-" in str(src):
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    result = run("convert", "tiny:build", "--to", "plain", "-o", out, "--force", "--input-shape", "2,3,8,8")
    one_line_failure(result, 8, "Input/output error", "nothing was written", "unchanged")
    assert unit(tiny) == previous
    assert not [p for p in tiny.iterdir() if ".bnsurgeon-tmp-" in p.name]


def test_a_dangling_symlink_output_is_named_up_front_and_force_replaces_the_link(tiny):
    out = tiny / "o.safetensors"
    out.symlink_to(tiny / "elsewhere.safetensors")
    result = run("convert", "tiny:build", "-o", out, "--input-shape", "2,3,8,8")
    one_line_failure(result, 8, "o.safetensors is a symlink to a missing file", "--force")
    assert "appeared while" not in result.output and out.is_symlink()
    assert run("convert", "tiny:build", "-o", out, "--force", "--input-shape", "2,3,8,8").exit_code == 0
    assert not out.is_symlink() and out.is_file() and not (tiny / "elsewhere.safetensors").exists()


# ---- input files that are not files ---------------------------------------------------------------


@pytest.mark.parametrize("make", ["fifo", "/dev/zero"])
def test_an_input_that_is_not_a_regular_file_is_named_not_called_empty(tiny, make):
    if make == "fifo":
        path = tiny / "pipe.safetensors"
        os.mkfifo(path)
    else:
        path = make
    result = run("convert", path, "--model", "tiny:build", "-o", tiny / "o.safetensors")
    one_line_failure(result, 4, f"{path} is not a regular file")
    assert "empty" not in result.output and not (tiny / "o.safetensors").exists()


def test_a_checkpoint_larger_than_memory_is_refused_before_it_is_read(good, tiny, monkeypatch):
    import bnsurgeon.files.reading

    monkeypatch.setattr(bnsurgeon.files.reading, "physical_memory", lambda: 256, raising=False)
    result = run("convert", good, "--model", "tiny:build", "--to", "plain", "-o", tiny / "o.safetensors")
    one_line_failure(result, 4, "more than this machine's", "GiB of memory")
    assert not (tiny / "o.safetensors").exists()


def test_a_pt_write_that_hits_a_size_limit_says_why(tiny):
    """torch's zip writer reports a failed write as 'unexpected pos N vs M'; the OSError is what matters."""
    script = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {str(tiny)!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        from bnsurgeon.cli.commands import app
        resource.setrlimit(resource.RLIMIT_FSIZE, (1500, 1500))
        sys.argv = ["bnsurgeon", "convert", "tiny:build", "-o", {str(tiny / "o.pt")!r}, "--input-shape", "2,3,8,8"]
        app()
    """)
    before = listing(tiny)
    done = run_python(
        script,
        timeout=120,
        cwd=tiny,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
    )
    flat = " ".join(done.stderr.split())
    assert done.returncode == 8, done.stderr[-800:]
    assert "File too large" in flat and "nothing was written" in flat and "unexpected pos" not in flat, flat
    assert listing(tiny) == before


# ---- weights that would make a different model ------------------------------------------------------


@pytest.mark.parametrize(
    "poison, message",
    [
        (lambda t: t.fill_(float("inf")), "non-finite values (NaN or Inf)"),
        (lambda t: t.fill_(-1.0), "negative running variances"),
    ],
)
def test_impossible_bn_statistics_are_refused_even_when_the_check_cannot_see_them(good, tiny, poison, message):
    """An Inf variance zeroes its channel (outputs stay finite); convert wrote it and verify refused it."""

    def damage(stored):
        poison(stored["1.running_var"][:1])
        return stored

    bad = edited(good, tiny / "bad.safetensors", tensors=damage)
    before = listing(tiny)
    result = run(
        "convert",
        bad,
        "--model",
        "tiny:build",
        "--to",
        "plain",
        "-o",
        tiny / "o.safetensors",
        "--input-shape",
        "2,3,8,8",
    )
    one_line_failure(result, 4, message, "1.running_var")
    assert listing(tiny) == before


@pytest.mark.parametrize(
    "cast, code, message",
    [
        (lambda t: t.double() + 1e-12, 6, "float64 -> float32"),
        (lambda t: torch.complex(t, torch.ones_like(t)), 6, "complex64 -> float32"),
        (lambda t: t.half().float().half(), 0, None),  # every float16 value is a float32 value: accepted
    ],
)
def test_weights_that_a_cast_would_change_are_refused(tiny, cast, code, message):
    import tiny as tiny_module

    state = {k: cast(v) if v.is_floating_point() else v for k, v in tiny_module.build().state_dict().items()}
    torch.save(state, tiny / "w.pth")
    result = run(
        "convert", tiny / "w.pth", "--model", "tiny:build", "-o", tiny / "o.safetensors", "--input-shape", "2,3,8,8"
    )
    if message is None:
        assert result.exit_code == 0, result.output
    else:
        one_line_failure(result, code, "would change when cast to the model's dtypes", message)
        assert not (tiny / "o.safetensors").exists()


@pytest.mark.parametrize("layout", ["sparse", "quantized"])
def test_weights_that_are_not_dense_tensors_are_named(tiny, layout):
    import tiny as tiny_module

    state = tiny_module.build().state_dict()
    key = next(k for k, v in state.items() if v.dim() == 4)
    state[key] = (
        state[key].to_sparse() if layout == "sparse" else torch.quantize_per_tensor(state[key], 0.01, 0, torch.qint8)
    )
    torch.save(state, tiny / "w.pth")
    result = run(
        "convert", tiny / "w.pth", "--model", "tiny:build", "-o", tiny / "o.safetensors", "--input-shape", "2,3,8,8"
    )
    one_line_failure(result, 6, "are not dense tensors", key)
    assert not (tiny / "o.safetensors").exists()


@pytest.mark.parametrize(
    "state, message",
    [
        ("extra", "entry 'epoch' is an int"),
        ("int_keys", "entry 0 is keyed by an int"),
    ],
)
def test_a_dict_that_is_almost_a_state_dict_is_described_truly(tiny, state, message):
    import tiny as tiny_module

    weights = tiny_module.build().state_dict()
    obj = {**weights, "epoch": 3} if state == "extra" else {i: v for i, v in enumerate(weights.values())}
    torch.save(obj, tiny / "w.pth")
    result = run("convert", tiny / "w.pth", "--model", "tiny:build", "-o", tiny / "o.safetensors")
    one_line_failure(result, 4, "holds no state dict bnsurgeon can use", message)
    assert "holds no model weights" not in result.output


# ---- metadata text: bounded, unambiguous ------------------------------------------------------------


def test_huge_metadata_text_gives_a_bounded_error_line(good, tiny):
    huge = edited(good, tiny / "huge.safetensors", target="x" * 1_000_000)
    result = run("convert", huge, "--model", "tiny:build", "--to", "plain", "-o", tiny / "o.safetensors")
    one_line_failure(result, 4, "metadata bnsurgeon.target", "(1,000,000 characters)")
    assert len(result.output) < 3000
    named = edited(
        good, tiny / "named.safetensors", architecture={"kind": "factory", "name": "a" * 100_000 + ":b", "kwargs": {}}
    )
    result = run("convert", named, "--to", "plain", "-o", tiny / "o.safetensors")
    one_line_failure(result, 4, "names a factory of 100,002 characters (at most 200)")
    assert len(result.output) < 3000


def test_metadata_json_with_a_repeated_key_is_refused(good, tiny):
    """Python keeps the last 'name', another reader the first: what the file records is ambiguous."""
    twice = edited(
        good,
        tiny / "twice.safetensors",
        raw_architecture='{"kind": "factory", "name": "tiny:build", "name": "os:system", "kwargs": {}}',
    )
    result = run("convert", twice, "--model", "tiny:build", "--to", "plain", "-o", tiny / "o.safetensors")
    one_line_failure(result, 4, "metadata bnsurgeon.architecture is not valid JSON", "'name' appears twice")


# ---- option values that cannot work --------------------------------------------------------------


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["-w", "100000"], {}, "--world-size 100000 is more ranks than verify starts"),
        (["--atol", "nan"], {}, "--atol nan is not a tolerance"),
        (["--atol", "-1"], {}, "--atol -1.0 is not a tolerance"),
        (["--atol", "inf"], {}, "--atol inf is not a tolerance"),
        ([], {"BNSURGEON_DIST_TIMEOUT": "1e-9"}, "BNSURGEON_DIST_TIMEOUT='1e-9' is not a usable timeout"),
        ([], {"BNSURGEON_DIST_TIMEOUT": "1e20"}, "BNSURGEON_DIST_TIMEOUT='1e20' is not a usable timeout"),
    ],
)
def test_verify_options_that_cannot_work_are_usage_errors(tiny, args, env, message):
    result = run("verify", "tiny:build", "tiny:build", "--input-shape", "2,3,8,8", *args, env=env)
    one_line_failure(result, 2, message, "fix:")


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_the_finite_check_sees_one_bad_value_among_values_whose_sum_overflows(poison):
    from bnsurgeon.files.weights import has_non_finite

    values = torch.full((64,), 3e38)  # every value finite, their sum is inf: must not be called non-finite
    assert not has_non_finite(values)
    values[17] = poison
    assert has_non_finite(values)
    assert has_non_finite(torch.tensor([1.0, poison]).half()) and not has_non_finite(torch.zeros(0))


def test_metadata_json_with_nan_or_infinity_is_refused(good, tiny):
    """bnsurgeon writes strict JSON (no NaN or Infinity); metadata holding them was not written by it, and a
    NaN eps or momentum would shape the model: refused like any other invalid JSON."""
    for constant in ("NaN", "Infinity", "-Infinity"):
        odd = edited(
            good,
            tiny / f"odd{constant}.safetensors",
            raw_architecture='{"kind": "factory", "name": "tiny:build", "kwargs": {"eps": ' + constant + "}}",
        )
        result = run("convert", odd, "--model", "tiny:build", "--to", "plain", "-o", tiny / "o.safetensors")
        one_line_failure(result, 4, "metadata bnsurgeon.architecture is not valid JSON", f"{constant} is not a JSON")


def test_a_safetensors_file_whose_name_is_not_utf8_is_named_as_the_problem(tmp_path):
    """The safetensors library opens only UTF-8 paths: the file itself is fine, so the advice to re-download a
    'truncated or corrupt' file misstated what is on disk. The name is the problem, and the message says so."""
    import os

    from safetensors.torch import save_file

    name = os.fsdecode(b"weights\xff.safetensors")
    save_file({"w": torch.zeros(2)}, str(tmp_path / name))
    result = run("inspect", tmp_path / name, "--model", "resnet18")
    one_line_failure(result, 4, "its name is not UTF-8", "rename the file")
    assert "corrupt" not in result.output
