"""Hostile files and CLI edge cases, continued (after test_untrusted and test_hostile_files):
text from a file that would drive the terminal, entries keyed by something other than a
name, an input named as an output, safetensors dtypes beyond the common ones, constructor
sizes read from a file, and output directories that are not directories. Each is one line
with its own exit code, and nothing on disk is lost or misstated."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_untrusted import edited, good, one_line_failure, run, tiny  # noqa: F401 (fixtures)


def listing(directory):
    """Every name with its size and mtime (symlinks as themselves: a dangling one too)."""
    return {p.name: (p.lstat().st_size, p.lstat().st_mtime_ns) for p in directory.iterdir() if p.name != "__pycache__"}


# ---- output directories that are not directories ------------------------------------------------


@pytest.mark.parametrize(
    "output, message",
    [
        ("afile/o.safetensors", "output directory afile is a file, not a directory"),
        ("afile/sub/o.safetensors", "output directory afile/sub cannot be created: afile is a file, not a directory"),
        ("link/o.safetensors", "output directory link is a symlink to a missing path, not a directory"),
    ],
)
def test_an_output_directory_that_is_a_file_is_named_as_one(tiny, output, message):
    (tiny / "afile").write_text("not a directory")
    (tiny / "link").symlink_to(tiny / "missing")
    before = listing(tiny)
    result = run("convert", "tiny:build", "-o", output, "--input-shape", "2,3,8,8")
    one_line_failure(result, 8, message)
    assert "does not exist" not in result.output and "mkdir" not in result.output
    assert listing(tiny) == before and (tiny / "afile").read_text() == "not a directory"


# ---- an input is never an output, --force or not ------------------------------------------------


@pytest.mark.parametrize(
    "output, example, what",
    [
        ("x.pt", "x.pt", "output"),
        ("o.safetensors", "o.safetensors.report.json", "report"),
        ("o.pt", "o.pt.report.md", "report"),
    ],
)
@pytest.mark.parametrize("force", [True, False])
def test_the_example_input_is_never_overwritten_as_an_output(tiny, output, example, what, force):
    torch.save(torch.randn(2, 3, 8, 8), tiny / example)
    before, content = listing(tiny), (tiny / example).read_bytes()
    result = run(
        "convert", "tiny:build", "-o", output, "--example-input", tiny / example, *(["--force"] if force else [])
    )
    one_line_failure(result, 8, f"{what} ", f"{example} is the --example-input file", "never overwrites an input")
    assert "pass --force" not in result.output
    assert listing(tiny) == before and (tiny / example).read_bytes() == content


def test_the_example_input_reached_by_a_symlink_or_hard_link_is_still_an_input(tiny):
    torch.save(torch.randn(2, 3, 8, 8), tiny / "x.pt")
    (tiny / "sym.pt").symlink_to(tiny / "x.pt")
    os.link(tiny / "x.pt", tiny / "hard.pt")
    content = (tiny / "x.pt").read_bytes()
    for output in ("sym.pt", "hard.pt"):
        result = run("convert", "tiny:build", "-o", tiny / output, "--example-input", "x.pt", "--force")
        one_line_failure(result, 8, "is the --example-input file")
    assert (tiny / "x.pt").read_bytes() == content and (tiny / "sym.pt").is_symlink()


# ---- safetensors dtypes beyond the common ones --------------------------------------------------


def raw_safetensors(path, state, odd_key, dtype, nbytes, shape):
    """A .safetensors file written byte by byte: ``state`` as F32/I64, and ``odd_key`` (replacing or beside
    a tensor of ``state``) of any dtype name, its bytes all 0x38."""
    import struct

    header, blobs, offset = {}, [], 0
    entries = {k: v for k, v in state.items() if k != odd_key}
    for key, value in [*entries.items(), (odd_key, None)]:
        data = b"\x38" * nbytes if value is None else value.contiguous().numpy().tobytes()
        name = dtype if value is None else {torch.float32: "F32", torch.int64: "I64"}[value.dtype]
        header[key] = {
            "dtype": name,
            "shape": list(shape if value is None else value.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return path


#: safetensors dtype -> the torch feature (core/torch_versions.py) whose dtype holds it
TORCH_FEATURE_OF = {"F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2"}


def _as_this_install_says(path, dtype, code, message):
    """What the installed safetensors and torch make of a rare dtype: a safetensors too old to know it (before 0.5
    it refuses the header, saying only "InvalidHeaderDeserialization") is named as such (exit 4, never "corrupt"); a
    torch too old for it is exit 18 naming both versions; else the expectation given (the newest releases)."""
    import safetensors
    from safetensors import SafetensorError, safe_open

    from bnsurgeon.core import torch_versions

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError:
        if dtype in OLDEST_DTYPES:
            raise
        return 4, f"dtype {dtype!r}, which safetensors {safetensors.__version__} does not know"
    feature = TORCH_FEATURE_OF.get(dtype)
    if feature is not None and not torch_versions.has(feature):
        return 18, f"needs torch >= {torch_versions.needed(feature)} (you have {torch.__version__})"
    return code, message


#: what every supported safetensors reads (0.4.3)
OLDEST_DTYPES = {"BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"}


@pytest.mark.parametrize(
    "dtype, nbytes, shape, code, message",
    [
        ("C64", 32, (4,), 6, "1.weight (complex64 -> float32)"),  # read, then refused as a lossy cast, as for .pt
        ("F8_E8M0", 4, (4,), 0, None),  # exact in float32: read and cast
        ("F8_E4M3FNUZ", 4, (4,), 0, None),
        ("F8_E5M2FNUZ", 4, (4,), 0, None),
        ("F4", 2, (4,), 6, "1.weight (float4_e2m1fn_x2, two 4-bit floats per element)"),
        ("F4", 3, (2, 3), 4, "dtype F4 and shape (2, 3)"),
        ("F6_E2M3", 3, (4,), 4, "dtype F6_E2M3 (6-bit float), which is not supported by torch"),
        ("F6_E3M2", 3, (4,), 4, "dtype F6_E3M2 (6-bit float), which is not supported by torch"),
        ("Q9", 4, (4,), 4, "dtype 'Q9', which safetensors"),
    ],
)
def test_safetensors_dtypes_are_read_or_named(tiny, dtype, nbytes, shape, code, message):
    import tiny as tiny_module

    path = raw_safetensors(tiny / "w.safetensors", tiny_module.build().state_dict(), "1.weight", dtype, nbytes, shape)
    code, message = _as_this_install_says(path, dtype, code, message)
    result = run("convert", path, "--model", "tiny:build", "-o", tiny / "o.safetensors", "--input-shape", "2,3,8,8")
    if code == 0:
        assert result.exit_code == 0, result.output
        return
    one_line_failure(result, code, message)
    assert "corrupt" not in result.output and "cannot hold" not in result.output
    assert not (tiny / "o.safetensors").exists()
    if code == 4:  # inspect maps the file instead of copying it: the same line
        one_line_failure(run("inspect", path), 4, message)


def test_an_unexpected_tensor_of_a_rare_dtype_is_listed_as_unexpected(tiny):
    import tiny as tiny_module

    for dtype, nbytes in (("C64", 32), ("F4", 2), ("F8_E8M0", 4)):
        path = raw_safetensors(tiny / "w.safetensors", tiny_module.build().state_dict(), "extra", dtype, nbytes, (4,))
        if _as_this_install_says(path, dtype, 0, None)[0] != 0:
            continue  # a dtype this safetensors or torch cannot read at all: named by the test above
        assert run("inspect", path).exit_code == 0
        result = run("convert", path, "--model", "tiny:build", "-o", tiny / "o.safetensors", "--input-shape", "2,3,8,8")
        one_line_failure(result, 6, "unexpected 1: extra")


# ---- sizes read from a file are sizes -------------------------------------------------------------

NOT_SIZES = [
    ("num_classes", True),
    ("num_classes", -3),
    ("num_classes", 2.5),
    ("num_classes", "10"),
    ("num_classes", 10**13),
    ("in_chans", 0),
    ("in_chans", False),
    ("img_size", [224, -1]),
]


@pytest.mark.parametrize("name, value", NOT_SIZES)
@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_a_recorded_size_that_is_not_a_size_is_refused_naming_the_field(good, tiny, name, value, command):
    bad = edited(
        good, tiny / "bad.safetensors", architecture={"kind": "factory", "name": "tiny:build", "kwargs": {name: value}}
    )
    before = listing(tiny)
    args = ["-o", tiny / "o.safetensors", "--input-shape", "2,3,8,8"] if command == "convert" else []
    result = run(command, bad, "--model", "tiny:build", "--accept-recorded-args", *args)
    one_line_failure(result, 4, f"bnsurgeon.architecture kwargs.{name} is {value!r}", "not a size")
    assert listing(tiny) == before and not (tiny / "called.txt").exists()


@pytest.mark.parametrize("name, value", NOT_SIZES[:6])
def test_a_training_checkpoint_size_that_is_not_a_size_is_refused_naming_the_field(tiny, name, value):
    import argparse

    torch.save(
        {
            "arch": "resnet10t",
            "state_dict": {"fc.weight": torch.zeros(2, 2)},
            "args": argparse.Namespace(**{name: value}),
        },
        tiny / "last.pth.tar",
    )
    for command, args in (("inspect", []), ("convert", ["-o", tiny / "o.pt"])):
        result = run(command, tiny / "last.pth.tar", *args)
        one_line_failure(result, 4, f"args.{name} is {value!r}", "not a size", "--model resnet10t")
    assert not (tiny / "o.pt").exists()


def test_a_training_checkpoint_naming_a_huge_architecture_is_refused_without_quoting_it(tiny):
    """A 1 MB ``arch`` was matched and quoted whole (exit 3 after 7 s, the name in the message);
    recorded architectures were already capped at 200 characters."""
    torch.save({"arch": "resnet" * 200_000, "state_dict": {"fc.weight": torch.zeros(2, 2)}}, tiny / "last.pth.tar")
    for command, args in (("inspect", []), ("convert", ["-o", tiny / "o.pt"])):
        result = run(command, tiny / "last.pth.tar", *args)
        one_line_failure(result, 4, "architecture of 1,200,000 characters (at most 200)", "--model ARCH")
        assert len(result.output) < 2000
    assert not (tiny / "o.pt").exists()


def test_sizes_that_are_sizes_still_build():
    from bnsurgeon.loading.trust import size_arg_problem

    for name, value in [
        ("num_classes", 0),
        ("num_classes", 21843),
        ("in_chans", 1),
        ("img_size", [224, 224]),
        ("img_size", 96),
        ("width", 1.5),
        ("global_pool", "avg"),
    ]:
        assert size_arg_problem(name, value) is None, (name, value)


# ---- inspect lists only a model the file's weights fit ------------------------------------------


def test_inspect_refuses_a_recorded_model_the_weights_do_not_fit(good, tiny):
    wider = edited(
        good, tiny / "wide.safetensors", architecture={"kind": "factory", "name": "tiny:build", "kwargs": {"width": 6}}
    )
    result = run("inspect", wider, "--model", "tiny:build", "--accept-recorded-args")
    one_line_failure(result, 6, "do not fit the architecture", "shape mismatch", "1.weight (4,) vs (6,)")
    assert "BN-family modules" not in result.output


def test_inspect_refuses_a_training_checkpoint_whose_weights_do_not_fit_its_arch(tiny):
    import argparse

    import tiny as tiny_module

    torch.save(
        {
            "arch": "resnet10t",
            "state_dict": tiny_module.build().state_dict(),
            "args": argparse.Namespace(num_classes=1_000_000),
        },
        tiny / "last.pth.tar",
    )
    result = run("inspect", tiny / "last.pth.tar")
    one_line_failure(result, 6, "do not fit the architecture", "missing", "unexpected")
    assert "parameters" not in result.output  # a 10^6-class model was listed as if the file held it


def test_inspect_with_model_refuses_a_state_dict_that_does_not_fit(tiny):
    import tiny as tiny_module

    torch.save(tiny_module.build(width=6).state_dict(), tiny / "w.pth")
    one_line_failure(
        run("inspect", tiny / "w.pth", "--model", "tiny:build"), 6, "shape mismatch", "(6, 3, 3, 3) vs (4, 3, 3, 3)"
    )
    assert run("inspect", tiny / "w.pth", "--model", "tiny:wide").exit_code == 0


# ---- entries keyed by something other than a name ---------------------------------------------


@pytest.mark.parametrize("output", ["o.pt", "o.safetensors"])
def test_training_checkpoint_entries_keyed_by_ints_or_tuples_are_carried_and_named(tiny, output):
    import tiny as tiny_module

    torch.save(
        {"state_dict": tiny_module.build().state_dict(), 7: "seven", "7": "the string", (1, 2): torch.ones(2)},
        tiny / "last.pth",
    )
    listed = run("inspect", tiny / "last.pth")
    assert listed.exit_code == 0 and "7 (int key)" in listed.output and "(1, 2) (tuple key)" in listed.output
    result = run("convert", tiny / "last.pth", "--model", "tiny:build", "-o", tiny / output, "--input-shape", "2,3,8,8")
    assert result.exit_code == 0, result.output
    assert "free disk space" not in result.output
    carried = json.loads((tiny / f"{output}.report.json").read_text())["carried"]
    assert set(carried) == {"7 (int key)", "7", "(1, 2) (tuple key)"}
    if output == "o.pt":
        written = torch.load(tiny / output, weights_only=True)
        assert written[7] == "seven" and written["7"] == "the string" and torch.equal(written[(1, 2)], torch.ones(2))
    else:
        assert all("not written" in what for what in carried.values())


@pytest.mark.parametrize("bnsurgeon_file", [False, True])
def test_a_state_dict_with_a_key_that_is_not_a_name_is_refused_naming_that_key(good, tiny, bnsurgeon_file):
    import tiny as tiny_module

    if bnsurgeon_file:  # a bnsurgeon .pt whose state_dict gained an int key: not "missing every key"
        assert run("convert", good, "--model", "tiny:build", "--to", "plain", "-o", tiny / "g.pt").exit_code == 0
        obj = torch.load(tiny / "g.pt", weights_only=True)
        obj["state_dict"][5] = torch.zeros(1)
    else:
        obj = {"state_dict": {**tiny_module.build().state_dict(), 5: torch.zeros(1)}, "epoch": 3}
    torch.save(obj, tiny / "w.pt")
    for command, args in (("inspect", []), ("convert", ["-o", tiny / "o.pt", "--input-shape", "2,3,8,8"])):
        result = run(command, tiny / "w.pt", "--model", "tiny:build", *args)
        one_line_failure(result, 4, "its 'state_dict' dict holds 15 tensors, but entry 5 is keyed by an int")
        assert "missing" not in result.output and "is a OrderedDict" not in result.output
    assert not (tiny / "o.pt").exists()


# ---- text from a file never drives the terminal -------------------------------------------------

HOSTILE = "x\x1b[2J\x1b[31mFAKE\rerror: forged\nline\u202eabc\x9b1m\x07"
RAW = ("\x1b", "\r", "\u202e", "\x9b", "\x07")


def assert_escaped(output):
    assert not any(ch in output for ch in RAW), repr(output)
    assert "\\x1b[2J" in output and "\\u202e" in output and "\\x9b" in output
    assert "\nerror: forged" not in output and "\nline" not in output


def test_entry_keys_of_a_file_are_escaped_in_the_listing(tiny):
    import tiny as tiny_module

    torch.save({"state_dict": tiny_module.build().state_dict(), HOSTILE: 3}, tiny / "last.pth")
    result = run("inspect", tiny / "last.pth", "--model", "tiny:build")
    assert result.exit_code == 0, result.output
    assert_escaped(result.output)


def test_state_dict_keys_are_escaped_in_error_lines(tiny):
    import tiny as tiny_module

    torch.save({**tiny_module.build().state_dict(), HOSTILE: torch.zeros(1)}, tiny / "w.pth")
    for command, args in (("inspect", []), ("convert", ["-o", tiny / "o.safetensors"])):
        result = run(command, tiny / "w.pth", "--model", "tiny:build", *args)
        one_line_failure(result, 6, "unexpected 1: x\\x1b[2J\\x1b[31mFAKE\\rerror: forged\\nline")
        assert_escaped(result.output)
        assert len(result.output.strip().splitlines()) == 2  # the error line and its fix, nothing forged


def test_metadata_strings_are_escaped_in_error_lines(good, tiny):
    bad = edited(good, tiny / "bad.safetensors", classes={"1": HOSTILE, "4": "torch.nn.modules.batchnorm.BatchNorm2d"})
    result = run("convert", bad, "--model", "tiny:build", "-o", tiny / "o.safetensors")
    one_line_failure(result, 4, "bnsurgeon.classes names classes no rule claims")
    assert_escaped(result.output)


def test_module_names_from_a_pickled_model_are_escaped_in_listings_reports_and_markdown(tiny):
    from torch import nn

    model = nn.Sequential()
    model.add_module("conv", nn.Conv2d(3, 4, 3))
    model.add_module(HOSTILE, nn.BatchNorm2d(4))
    torch.save(model, tiny / "whole.pt")
    listed = run("inspect", tiny / "whole.pt", "--trust-pickle", "-v")
    assert listed.exit_code == 0, listed.output
    assert_escaped(listed.output)
    result = run(
        "convert",
        tiny / "whole.pt",
        "--trust-pickle",
        "-o",
        tiny / "o.pt",
        "--input-shape",
        "2,3,8,8",
        "-v",
        "--to",
        "frozen",
    )
    assert result.exit_code == 0, result.output
    assert_escaped(result.output)
    markdown = (tiny / "o.pt.report.md").read_text()
    assert not any(ch in markdown for ch in RAW) and "\nline" not in markdown and "\\x1b[2J" in markdown
    assert HOSTILE in json.loads((tiny / "o.pt.report.json").read_text())["changed"][0]["path"]  # JSON keeps the truth


def test_a_file_name_with_control_characters_is_escaped(tiny):
    path = tiny / "w\x1b[31mred\u202e.pth"
    path.write_bytes(b"\x80\x02garbage that is not a pickle")
    result = run("inspect", path)
    one_line_failure(result, 4, "w\\x1b[31mred\\u202e.pth")
    assert "\x1b" not in result.output and "\u202e" not in result.output


def test_printable_escapes_what_a_terminal_acts_on_and_keeps_the_rest():
    from bnsurgeon.cli.render import printable

    assert printable("blocks.0.bn1 ü 漢字 😀 a b") == "blocks.0.bn1 ü 漢字 😀 a b"
    assert (
        printable("a\x1b[2Jb\rc\nd\te\x7ff\x85g\u200bh\u2028i\u00a0j\udcff")
        == "a\\x1b[2Jb\\rc\\nd\\te\\x7ff\\x85g\\u200bh\\u2028i\\xa0j\\udcff"
    )
    assert printable(printable(HOSTILE)) == printable(HOSTILE)


def test_weights_of_a_dtype_torch_cannot_cast_are_refused_not_a_traceback(tiny):
    import tiny as tiny_module

    state = tiny_module.build().state_dict()
    state["1.running_mean"] = torch.zeros(4, dtype=torch.uint8).view(torch.bits8)
    torch.save(state, tiny / "w.pth")
    result = run(
        "convert", tiny / "w.pth", "--model", "tiny:build", "-o", tiny / "o.safetensors", "--input-shape", "2,3,8,8"
    )
    one_line_failure(result, 6, "1.running_mean (bits8 -> float32: torch cannot cast it)")
    assert not (tiny / "o.safetensors").exists()


# ---- containers nested without end, or holding themselves -----------------------------------------


def save_deep(path, obj_of, depth=500):
    """torch.save an object holding lists nested ``depth`` deep (pickling recurses: a thread with room for it).
    5x bnsurgeon's limit of 100 levels: Python 3.12's pickler stopped between 500 and 1,000 levels in a thread,
    whatever the recursion limit, and a save that failed there left a corrupt file behind."""
    import sys
    import threading

    deep = current = []
    for _ in range(depth):
        current.append([])
        current = current[0]
    limit, size = sys.getrecursionlimit(), threading.stack_size(1 << 28)
    sys.setrecursionlimit(depth * 4 + 1000)
    try:
        failures: list = []

        def save():
            try:
                torch.save(obj_of(deep), path)
            except BaseException as error:  # a thread's exception would otherwise vanish
                failures.append(error)

        worker = threading.Thread(target=save)
        worker.start()
        worker.join()
    finally:
        sys.setrecursionlimit(limit)
        threading.stack_size(size)
    assert not failures and path.exists(), failures


def test_deeply_nested_entries_are_listed_and_refused_for_a_pt_output_without_a_traceback(tiny):
    import tiny as tiny_module

    save_deep(tiny / "deep.pt", lambda deep: {"state_dict": tiny_module.build().state_dict(), "deep": deep})
    listed = run("inspect", tiny / "deep.pt", "--model", "tiny:build")
    assert listed.exit_code == 0 and "Traceback" not in listed.output, listed.output
    result = run("convert", tiny / "deep.pt", "--model", "tiny:build", "-o", tiny / "o.pt", "--input-shape", "2,3,8,8")
    one_line_failure(result, 4, "entry 'deep' nests containers more than 100 levels deep", ".safetensors output")
    assert not (tiny / "o.pt").exists()
    result = run(
        "convert", tiny / "deep.pt", "--model", "tiny:build", "-o", tiny / "o.safetensors", "--input-shape", "2,3,8,8"
    )
    assert result.exit_code == 0 and "deep (list; not written" in " ".join(result.output.split()), result.output


def test_a_file_that_is_only_deep_lists_is_described_not_a_traceback(tiny):
    save_deep(tiny / "deep.pt", lambda deep: deep)
    for command in ("inspect", "convert"):
        args = ["-o", tiny / "o.pt"] if command == "convert" else []
        one_line_failure(run(command, tiny / "deep.pt", "--model", "tiny:build", *args), 4, "holds no model weights")


def test_a_list_that_holds_itself_is_counted_and_carried(tiny):
    import tiny as tiny_module

    loop = [torch.ones(1)]
    loop.append(loop)
    torch.save({"state_dict": tiny_module.build().state_dict(), "loop": loop}, tiny / "loop.pt")
    listed = run("inspect", tiny / "loop.pt", "--model", "tiny:build")
    assert listed.exit_code == 0, listed.output
    assert (
        run(
            "convert", tiny / "loop.pt", "--model", "tiny:build", "-o", tiny / "o.pt", "--input-shape", "2,3,8,8"
        ).exit_code
        == 0
    )
    written = torch.load(tiny / "o.pt", weights_only=True)["loop"]
    assert written[1] is written


@pytest.mark.parametrize(
    "make, held",
    [
        ("namespace", "its top level is a Namespace holding 1 tensor"),
        ("deeper", "its top level is a dict holding 1 tensor"),
    ],
)
def test_tensors_that_are_not_a_state_dict_are_not_called_no_tensors(tiny, make, held):
    import argparse

    obj = (
        argparse.Namespace(epoch=1, w=torch.zeros(2))
        if make == "namespace"
        else {"weights": {"a": {"b": torch.zeros(1)}}}
    )
    torch.save(obj, tiny / "w.pt")
    result = run("convert", tiny / "w.pt", "--model", "tiny:build", "-o", tiny / "o.pt")
    one_line_failure(result, 4, "holds no state dict bnsurgeon can use", held)
    assert "no tensors" not in result.output


# ---- a failed write says what failed -------------------------------------------------------------


@pytest.mark.parametrize(
    "error, disk",
    [
        ('IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })', True),
        ("unexpected: the writer broke", False),
    ],
)
def test_a_write_that_fails_inside_a_library_names_disk_space_only_when_it_is_disk_space(
    tiny, monkeypatch, error, disk
):
    import safetensors.torch
    from safetensors import SafetensorError

    def broken(*args, **kwargs):
        raise SafetensorError(error)

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    result = run("convert", "tiny:build", "-o", tiny / "o.safetensors", "--input-shape", "2,3,8,8")
    one_line_failure(result, 8, "could not write", "nothing was written")
    assert ("free disk space" in result.output) == disk
    assert not [p for p in tiny.iterdir() if p.name.startswith("o.safetensors") or ".bnsurgeon-tmp-" in p.name]


@pytest.mark.parametrize("count", [-5, 2**63 - 1])
def test_an_impossible_batch_count_is_refused_naming_it(tiny, count):
    import tiny as tiny_module

    state = tiny_module.build().state_dict()
    state["1.num_batches_tracked"] = torch.tensor(count)
    torch.save(state, tiny / "w.pth")
    result = run(
        "convert", tiny / "w.pth", "--model", "tiny:build", "-o", tiny / "o.safetensors", "--input-shape", "2,3,8,8"
    )
    one_line_failure(result, 4, f"impossible batch count in 1 BatchNorm module: 1.num_batches_tracked={count}")
    assert not (tiny / "o.safetensors").exists()
    state["1.num_batches_tracked"] = torch.tensor(12345)  # an ordinary count: accepted
    torch.save(state, tiny / "w.pth")
    assert (
        run(
            "convert", tiny / "w.pth", "--model", "tiny:build", "-o", tiny / "o.safetensors", "--input-shape", "2,3,8,8"
        ).exit_code
        == 0
    )


@pytest.mark.parametrize(
    "name, target, message",
    [
        ("dangling.pt", "missing.pt", "dangling.pt is a symlink to missing.pt, which does not exist"),
        (
            "loop",
            "loop",
            "loop is a symlink to loop, which leads back to itself",
        ),  # no suffix: still a file, not a timm name
    ],
)
def test_a_source_that_is_a_broken_symlink_is_named_as_one(tiny, name, target, message):
    (tiny / name).symlink_to(target)
    for args in (
        ["inspect", name],
        ["convert", name, "--model", "tiny:build", "-o", "o.pt"],
        ["verify", "tiny:build", name],
    ):
        result = run(*args)
        one_line_failure(result, 3, message)
        assert "no such file" not in result.output and "unknown timm model" not in result.output
    assert not (tiny / "o.pt").exists()


def test_an_output_that_is_a_symlink_loop_is_named_and_force_replaces_the_link(tiny):
    (tiny / "o.pt").symlink_to("o.pt")
    result = run("convert", "tiny:build", "-o", "o.pt", "--input-shape", "2,3,8,8")
    one_line_failure(result, 8, "output o.pt is a symlink that leads back to itself", "--force")
    assert (tiny / "o.pt").is_symlink()
    assert run("convert", "tiny:build", "-o", "o.pt", "--input-shape", "2,3,8,8", "--force").exit_code == 0
    assert (tiny / "o.pt").is_file() and not (tiny / "o.pt").is_symlink()


# ---- a file with thousands of entries does not flood the terminal ----------------------------------


def test_a_checkpoint_with_many_entries_lists_a_bounded_number_unless_verbose(tiny):
    import tiny as tiny_module

    obj = {f"k{i}": i for i in range(500)}
    obj["state_dict"] = tiny_module.build().state_dict()  # last in the file, but it holds the tensors: listed
    torch.save(obj, tiny / "many.pt")
    short = run("inspect", tiny / "many.pt", "--model", "tiny:build")
    assert short.exit_code == 0, short.output
    rows = [line for line in short.output.splitlines() if line.startswith("  k")]
    assert (
        len(rows) == 39
        and "state_dict" in short.output
        and "... and 461 more entries (-v lists them all)" in short.output
    )
    everything = run("inspect", tiny / "many.pt", "--model", "tiny:build", "-v", "--json")
    assert len([line for line in everything.output.splitlines() if line.startswith("  k")]) == 500
    converted = run(
        "convert", tiny / "many.pt", "--model", "tiny:build", "-o", tiny / "o.pt", "--input-shape", "2,3,8,8"
    )
    assert converted.exit_code == 0 and "... and 460 more (-v lists them all)" in " ".join(converted.output.split())
    assert len(json.loads((tiny / "o.pt.report.json").read_text())["carried"]) == 500


def test_markdown_report_cells_hold_any_module_name():
    import re

    from bnsurgeon.surgery.report import ModuleChange, ModuleKept, Report

    name = "bn|x`y\n## Injected heading"
    report = Report(
        target="sync",
        changed=[
            ModuleChange(name, [], "torch.nn.BatchNorm2d", "bnsurgeon.SyncBatchNorm", "torch-batchnorm", ["act|drop"])
        ],
        kept=[ModuleKept("kept|one", [], "torch.nn.BatchNorm2d", "torch-batchnorm", "--exclude k|*")],
        carried={"we`ird": "carried (int)"},
    )
    markdown = report.to_markdown()
    assert "\n## Injected" not in markdown
    rows = [line for line in markdown.splitlines() if line.startswith("| ") and "---" not in line]
    for row in rows[1:2] + rows[3:]:  # the data rows: 3 columns, so 4 unescaped pipes
        assert len(re.findall(r"(?<!\\)\|", row)) == 4, row
    assert "``we`ird``" in markdown and "``bn\\|x`y\\n## Injected heading``" in markdown


def test_bnsurgeon_metadata_of_a_pt_keyed_by_an_int_is_refused_not_a_traceback(good, tiny):
    assert run("convert", good, "--model", "tiny:build", "--to", "plain", "-o", tiny / "g.pt").exit_code == 0
    obj = torch.load(tiny / "g.pt", weights_only=True)
    obj["bnsurgeon"][5] = "x"
    torch.save(obj, tiny / "bad.pt")
    for command, args in (("inspect", []), ("convert", ["-o", tiny / "o.pt"])):
        one_line_failure(
            run(command, tiny / "bad.pt", "--model", "tiny:build", *args),
            4,
            "metadata 'bnsurgeon' has an entry keyed by an int, 5",
        )


def test_the_progress_line_on_a_terminal_shows_a_source_path_as_text_not_markup():
    import io

    from rich.console import Console

    from bnsurgeon.cli.render import phases

    stream = io.StringIO()
    out = Console(file=stream, force_terminal=True, width=100)
    with phases(out) as progress:
        progress("loading ckpt[/]x\x1b[2J[bold]y.pt")  # Rich markup would raise on '[/]' and eat '[bold]'
    assert "\x1b[2J" not in stream.getvalue()


def test_an_output_directory_that_is_a_device_is_named_without_advice_to_move_it(tiny):
    result = run("convert", "tiny:build", "-o", "/dev/null/o.pt", "--input-shape", "2,3,8,8")
    one_line_failure(result, 8, "output directory /dev/null is not a directory (a pipe, socket or device)")
    assert "move /dev/null" not in result.output


def test_counts_of_one_are_singular():
    """'1 tensors' in a carried entry's summary and '1 modules converted' in the Markdown report."""
    import torch
    from torch import nn

    import bnsurgeon
    from bnsurgeon.core.layout import counted
    from bnsurgeon.files.training_checkpoint import _describe
    from bnsurgeon.surgery.report import render_markdown

    assert [counted(n, "tensor") for n in (0, 1, 2)] == ["0 tensors", "1 tensor", "2 tensors"]
    assert _describe({"only": torch.zeros(1)}) == "dict, 1 tensor"
    result = bnsurgeon.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), "sync")
    assert "**1 module converted**" in render_markdown(result.report)
