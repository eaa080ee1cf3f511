"""scripts/pre-commit-verify, the bnsurgeon-verify hook, on files others wrote (issue 47, findings 1 and 6).

A report is data: a factory it names is never imported unless the hook's args confirm it, nothing read from it
is ever an option, and every file is checked, whatever happened to the ones before it, with one line per problem
and the hook's exit code for it. Most tests run the hook against a stand-in ``bnsurgeon`` on PATH that records
its arguments (no torch, no model); test_ci_examples.py runs the hook with pre-commit and the real verify.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HOOK = ROOT / "scripts" / "pre-commit-verify"

pytestmark = pytest.mark.skipif(shutil.which("sh") is None, reason="the stand-in bnsurgeon is a shell script")

#: records each call's arguments, one per line, then "." (verify's exit: 4 for a file named bad*, else 0)
FAKE_BNSURGEON = """#!/bin/sh
if [ -n "$FAKE_BROKEN" ]; then echo "ModuleNotFoundError: No module named 'torch'" >&2; exit 1; fi
for arg in "$@"; do printf '%s\\n' "$arg" >> "$BNSURGEON_LOG"; done
echo . >> "$BNSURGEON_LOG"
for arg in "$@"; do case "$arg" in --bogus) echo "Error: No such option: --bogus" >&2; exit 2;; bad*) exit 4;; esac; done
for arg in "$@"; do [ "$arg" = "--help" ] && exit 0; done  # as Click: --help is eager, values are not judged
for arg in "$@"; do case "$arg" in abc) echo "Error: Invalid value for '-w': abc" >&2; exit 2;; esac; done
for arg in "$@"; do [ "$arg" = "--" ] && exit 0; done
echo "Error: Missing argument 'SOURCE'." >&2; exit 2
"""


@pytest.fixture
def repo(tmp_path):
    """A working directory with a stand-in bnsurgeon on PATH, and an evilmod.py that leaves a mark when imported."""
    work = tmp_path / "repo"
    work.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "bnsurgeon"
    fake.write_text(FAKE_BNSURGEON)
    fake.chmod(0o755)
    (work / "evilmod.py").write_text(
        f"import pathlib, sys\npathlib.Path({str(tmp_path / 'IMPORTED')!r}).write_text('x')\n"
        "def make():\n    sys.exit(0)\n"
    )
    return work


def checkpoint(repo: Path, name: str | bytes, report: str | bytes | None) -> None:
    """A checkpoint file (its bytes never matter here) and, unless None, its report."""
    raw = os.fsencode(name) if isinstance(name, str) else name
    (Path(os.fsdecode(repo)) / os.fsdecode(raw)).write_bytes(b"\0" * 8)
    if report is not None:
        data = report.encode() if isinstance(report, str) else report
        Path(os.fsdecode(os.path.join(os.fsencode(str(repo)), raw + b".report.json"))).write_bytes(data)


def hook(
    repo: Path,
    *args: str | bytes,
    path: str | None = None,
    python: tuple[str, ...] = (sys.executable,),
    extra: dict[str, str] | None = None,
):
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "PYTHONIOENCODING", "PYTHONUTF8", "LC_ALL", "LC_CTYPE")
    }
    env.update(
        PATH=str(repo.parent / "bin") if path is None else path,
        BNSURGEON_LOG=str(repo.parent / "calls"),
        LANG="C.UTF-8",  # a user's UTF-8 locale: stdout refuses what is not UTF-8 unless the hook escapes it
        LC_ALL="C.UTF-8",
        **(extra or {}),
    )
    done = subprocess.run([*python, str(HOOK), *args], cwd=repo, env=env, capture_output=True, timeout=120)
    return done.returncode, (done.stdout + done.stderr).decode("utf-8", "replace")


def calls(repo: Path) -> list[list[str]]:
    """The stand-in bnsurgeon's calls, each as its argument list."""
    log = repo.parent / "calls"
    if not log.exists():
        return []
    text = os.fsdecode(log.read_bytes())
    return [call.strip("\n").split("\n") if call.strip("\n") else [] for call in text.split(".\n")[:-1]]


def verified(repo: Path) -> list[list[str]]:
    """The calls that verified a file (SOURCE and FILE after "--"): not the one that lets verify's parser judge
    the options first."""
    return [call for call in calls(repo) if "--" in call]


def one_line_each(output: str, count: int) -> None:
    assert "Traceback" not in output, output
    assert len([line for line in output.splitlines() if line.strip()]) == count, output


# finding 1: a report is data


def test_a_factory_a_report_names_is_not_imported_and_the_hook_fails_with_exit_10(repo):
    checkpoint(repo, "m.safetensors", '{"source": "evilmod:make"}')
    code, output = hook(repo, "--", "m.safetensors")
    assert code == 10, output
    assert "evilmod:make" in output and "--allow-factory evilmod:make" in output, output
    assert calls(repo) == [] and not (repo.parent / "IMPORTED").exists()
    one_line_each(output, 1)


def test_a_factory_confirmed_by_allow_factory_goes_to_verify_after_the_separator(repo):
    checkpoint(repo, "m.safetensors", '{"source": "evilmod:make"}')
    code, output = hook(repo, "--allow-factory", "evilmod:make", "-w", "2", "--", "m.safetensors")
    assert code == 0, output
    assert verified(repo) == [["verify", "-w", "2", "--", "evilmod:make", "m.safetensors"]]


@pytest.mark.parametrize("confirmation", ["evilmod:mak", "evilmod", "other:make"])
def test_only_exactly_the_same_name_confirms_a_factory(repo, confirmation):
    checkpoint(repo, "m.safetensors", '{"source": "evilmod:make"}')
    code, output = hook(repo, "--allow-factory", confirmation, "--", "m.safetensors")
    assert code == 10 and calls(repo) == [], output


def test_timm_prefix_does_not_hide_a_factory(repo):
    checkpoint(repo, "m.safetensors", '{"source": "timm:evilmod:make"}')
    code, output = hook(repo, "--", "m.safetensors")
    assert code == 10 and calls(repo) == [], output


@pytest.mark.parametrize(
    "source", ["--help", "-w", "--source=x", "a b", "x.safetensors (timm:resnet18, sync)", "r" * 200_000]
)
def test_a_source_that_is_no_timm_name_or_factory_is_refused_never_an_option(repo, source):
    checkpoint(repo, "m.safetensors", json.dumps({"source": source}))
    code, output = hook(repo, "--", "m.safetensors")
    assert code == 4 and calls(repo) == [], output
    one_line_each(output, 1)


@pytest.mark.parametrize("source", ["evil.pt", "timm:evil.pth", "resnet18"])
def test_a_source_that_names_a_file_is_refused_it_may_be_a_pickle_the_pull_request_added(repo, source):
    checkpoint(repo, "m.safetensors", json.dumps({"source": source}))
    (repo / "resnet18").mkdir()  # a directory named like a timm model: verify would read it as a model directory
    code, output = hook(repo, "--", "m.safetensors")
    assert code == 4 and "names a file" in output and verified(repo) == [], output


def test_a_timm_source_and_the_file_follow_the_separator_after_verifys_options(repo):
    checkpoint(repo, "m.safetensors", '{"source": "timm:resnet18"}')
    code, output = hook(repo, "-w", "2", "--", "m.safetensors")
    assert code == 0, output
    # the first call is verify's parser judging the options (--help first: it stops there), then the file
    assert calls(repo) == [["verify", "-w", "2"], ["verify", "-w", "2", "--", "resnet18", "m.safetensors"]]
    assert "$ bnsurgeon verify -w 2 -- resnet18 m.safetensors" in output


def test_a_file_whose_name_starts_with_a_dash_is_a_file_after_the_separator(repo):
    checkpoint(repo, "-w.safetensors", '{"source": "resnet18"}')
    code, output = hook(repo, "--", "-w.safetensors")
    assert code == 0 and verified(repo) == [["verify", "--", "resnet18", "-w.safetensors"]], output


def test_source_named_in_the_hooks_args_needs_no_confirmation(repo):
    checkpoint(repo, "m.safetensors", None)
    code, output = hook(repo, "--source", "evilmod:make", "--", "m.safetensors")
    assert code == 0 and verified(repo) == [["verify", "--", "evilmod:make", "m.safetensors"]], output


# finding 6: every file is checked; one line per problem; exit codes


def test_every_file_is_checked_after_broken_reports_one_line_each(repo):
    checkpoint(repo, "a.safetensors", "{not json")
    checkpoint(repo, "b.safetensors", '["source", "resnet18"]')
    checkpoint(repo, "c.safetensors", '{"source": 5}')
    checkpoint(repo, "d.safetensors", b'{"source": "resnet18\xff"}')
    checkpoint(repo, "e.safetensors", "{}")
    checkpoint(repo, "f.safetensors", '{"source": ""}')
    checkpoint(repo, "bad.safetensors", '{"source": "resnet18"}')
    checkpoint(repo, "good.safetensors", '{"source": "resnet18"}')
    names = "abcdef"
    code, output = hook(repo, "--", *[f"{n}.safetensors" for n in names], "bad.safetensors", "good.safetensors")
    assert code == 4, output  # the first problem's code
    for name, said in zip(names, ["is not JSON", "JSON list", "JSON int", "not UTF-8", "records no source", "empty"]):
        assert any(line.startswith(f"{name}.safetensors: ") and said in line for line in output.splitlines()), output
    assert "bad.safetensors: verify exited 4" in output
    assert [call[-1] for call in verified(repo)] == ["bad.safetensors", "good.safetensors"]
    one_line_each(output, 6 + 2 + 1)  # six problems, two commands, one failed verify


def test_a_failed_verify_exits_1_and_the_next_file_is_still_verified(repo):
    checkpoint(repo, "bad.safetensors", '{"source": "resnet18"}')
    checkpoint(repo, "good.safetensors", '{"source": "resnet18"}')
    code, output = hook(repo, "--", "bad.safetensors", "good.safetensors")
    assert code == 1 and [call[-1] for call in verified(repo)] == ["bad.safetensors", "good.safetensors"], output


def test_a_report_that_is_a_directory_a_fifo_or_a_dangling_link_is_a_problem_not_a_skip(repo):
    checkpoint(repo, "a.safetensors", None)
    (repo / "a.safetensors.report.json").mkdir()
    checkpoint(repo, "b.safetensors", None)
    (repo / "b.safetensors.report.json").symlink_to(repo / "missing")
    checkpoint(repo, "c.safetensors", None)
    os.mkfifo(repo / "c.safetensors.report.json")  # reading it would wait for a writer forever
    code, output = hook(repo, "--", "a.safetensors", "b.safetensors", "c.safetensors")
    assert code == 4 and calls(repo) == [], output
    one_line_each(output, 3)


def test_a_file_name_that_is_not_utf8_is_verified_and_printed_escaped(repo):
    checkpoint(repo, b"\xff.safetensors", '{"source": "resnet18"}')
    code, output = hook(repo, "--", b"\xff.safetensors")
    assert code == 0 and "Traceback" not in output, output
    assert "$ bnsurgeon verify -- resnet18 '\\xff.safetensors'" in output, output
    assert verified(repo) == [["verify", "--", "resnet18", os.fsdecode(b"\xff.safetensors")]]


def test_a_broken_report_of_a_file_name_that_is_not_utf8_is_one_line(repo):
    checkpoint(repo, b"\xfe.safetensors", "[]")
    code, output = hook(repo, "--", b"\xfe.safetensors")
    assert code == 4 and output.startswith("\\xfe.safetensors: "), output
    one_line_each(output, 1)


def test_no_bnsurgeon_anywhere_is_one_line_exit_127_and_later_reports_are_still_checked(repo, tmp_path):
    checkpoint(repo, "a.safetensors", '{"source": "resnet18"}')
    checkpoint(repo, "b.safetensors", '{"source": "evilmod:make"}')
    empty = tmp_path / "empty"
    empty.mkdir()
    # -S: this Python without site-packages, where no bnsurgeon is installed (and PYTHONPATH is unset)
    code, output = hook(repo, "--", "a.safetensors", "b.safetensors", path=str(empty), python=(sys.executable, "-S"))
    assert code == 127, output
    assert "no bnsurgeon to run" in output and "b.safetensors: " in output and "--allow-factory" in output, output
    one_line_each(output, 2)


def test_a_relative_path_entry_is_the_repository_and_is_never_searched(repo, tmp_path):
    (repo / "bnsurgeon").write_text(FAKE_BNSURGEON.replace("exit 0", "touch PLANTED; exit 0"))
    (repo / "bnsurgeon").chmod(0o755)
    checkpoint(repo, "a.safetensors", '{"source": "resnet18"}')
    code, output = hook(repo, "--", "a.safetensors", path=f".{os.pathsep}", python=(sys.executable, "-S"))
    assert code == 127 and not (repo / "PLANTED").exists(), output


def hook_with_this_python(repo, tmp_path, *args):
    """The hook run by this interpreter with no bnsurgeon on PATH: it runs this python's, the real one."""
    empty = tmp_path / "empty"
    empty.mkdir(exist_ok=True)
    done = subprocess.run(
        [sys.executable, str(HOOK), *args],
        cwd=repo,
        env={**os.environ, "PATH": str(empty), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done, done.stdout + done.stderr


def test_without_bnsurgeon_on_path_this_pythons_runs_with_the_working_directory_off_its_path(repo, tmp_path):
    """The real bnsurgeon (PYTHONPATH), and a bnsurgeon/ package committed in the repository that must not run."""
    planted = repo / "bnsurgeon"
    planted.mkdir()
    for module in ("__init__.py", "__main__.py"):
        (planted / module).write_text(f"open({str(tmp_path / 'PLANTED')!r}, 'w')\n")
    checkpoint(repo, "a.safetensors", '{"source": "resnet18"}')
    done, output = hook_with_this_python(repo, tmp_path, "--source", "missing.safetensors", "--", "a.safetensors")
    assert not (tmp_path / "PLANTED").exists(), output
    # the real verify ran: SOURCE is not found (exit 3), said by bnsurgeon itself
    assert done.returncode == 1 and "a.safetensors: verify exited 3" in output, output


@pytest.mark.parametrize(
    "args, said",
    [
        (["--source"], "--source: options (the hook's and verify's) must be ended by \"--\""),
        (["--source", "--", "a.safetensors"], "--source: expected one argument"),
        (["--allow-factory"], "--allow-factory: options (the hook's and verify's) must be ended by \"--\""),
        (["-w", "2", "a.safetensors"], "-w: options (the hook's and verify's) must be ended by \"--\""),
        (["--allow-factroy", "x:y", "a.safetensors"], "--allow-factroy: options (the hook's and verify's) must be"),
        (["--bogus", "--", "a.safetensors"], "bnsurgeon verify refuses the options --bogus: No such option: --bogus"),
        (["--help", "--", "a.safetensors"], "verify would print its help and check nothing"),
    ],
)
def test_bad_hook_arguments_are_one_line_and_exit_2_with_no_file_verified(repo, args, said):
    checkpoint(repo, "a.safetensors", '{"source": "resnet18"}')
    code, output = hook(repo, *args)
    assert code == 2 and said in output, output
    assert verified(repo) == [], output  # no file verified
    one_line_each(output, 1)


def test_a_bnsurgeon_that_does_not_start_is_one_line_not_a_refusal_of_the_options(repo):
    checkpoint(repo, "a.safetensors", '{"source": "resnet18"}')
    checkpoint(repo, "b.safetensors", '{"source": "resnet18"}')
    code, output = hook(repo, "-w", "2", "--", "a.safetensors", "b.safetensors", extra={"FAKE_BROKEN": "1"})
    assert code == 127 and "does not run (exit 1): ModuleNotFoundError: No module named 'torch'" in output, output
    one_line_each(output, 1)


def test_require_report_fails_a_checkpoint_whose_report_was_left_out(repo):
    """Without a report a checkpoint is skipped (not a converted one); on a pull request that is a way past the
    hook, so --require-report makes it a problem (exit 4), and the other files are still verified."""
    checkpoint(repo, "no_report.safetensors", None)
    checkpoint(repo, "good.safetensors", json.dumps({"source": "resnet18"}))
    code, output = hook(repo, "--", "no_report.safetensors", "good.safetensors")
    assert code == 0 and "skipped" in output, output
    code, output = hook(repo, "--require-report", "--", "no_report.safetensors", "good.safetensors")
    assert code == 4 and "no_report.safetensors: no no_report.safetensors.report.json" in output, output
    assert "--require-report" in output and ["verify", "--", "resnet18", "good.safetensors"] in verified(repo)
    one_line_each(output, 2)


def test_without_dashes_a_file_named_like_an_option_is_never_taken_for_one(repo):
    """pre-commit appends the files to the args: with args of the user's not ended by "--", a pull request's file
    named --source=x.pt was parsed as the hook's --source (and x.pt, its pickle, became every file's SOURCE; a
    --require-report was bypassed). Anything option-shaped without "--" is refused now, nothing verified."""
    checkpoint(repo, "tampered.safetensors", None)
    checkpoint(repo, "--source=x.pt", None)
    checkpoint(repo, "x.pt", None)
    code, output = hook(repo, "--require-report", "tampered.safetensors", "--source=x.pt", "x.pt")
    assert code == 2 and 'must be ended by "--"' in output, output
    assert verified(repo) == []
    code, output = hook(repo, "tampered.safetensors", "--source=x.pt")
    assert code == 2 and verified(repo) == [], output
    code, output = hook(repo, "x.pt")  # plain names without "--" are files, as before
    assert code == 0 and "skipped" in output, output


def test_a_report_naming_source_twice_or_with_a_newline_is_refused(repo):
    """Readers disagree on which of two "source" entries counts, and "resnet18\n" is no timm name."""
    checkpoint(repo, "twice.safetensors", '{"source": "evilmod:make", "source": "resnet18"}')
    checkpoint(repo, "newline.safetensors", json.dumps({"source": "resnet18\n"}))
    code, output = hook(repo, "--", "twice.safetensors", "newline.safetensors")
    assert code == 4 and "names source twice" in output, output
    assert "newline.safetensors" in output and verified(repo) == [], output


def test_a_bnsurgeon_on_path_that_cannot_be_executed_is_one_line_exit_127(repo, tmp_path):
    """A bad interpreter line made the options pre-check raise OSError: a traceback, exit 1, later files unchecked."""
    bad = tmp_path / "badbin"
    bad.mkdir()
    (bad / "bnsurgeon").write_text("#!/nonexistent/python\n")
    (bad / "bnsurgeon").chmod(0o755)
    checkpoint(repo, "a.safetensors", json.dumps({"source": "resnet18"}))
    code, output = hook(repo, "--", "a.safetensors", path=str(bad))
    assert code == 127 and "cannot run" in output and "Traceback" not in output, output


def test_a_bad_option_value_for_verify_is_one_line_exit_2_before_any_file(repo):
    """verify --help OPTIONS stopped at --help (Click's eager option) before judging -w abc: every file then ran
    verify, which refused it, and the hook said "verify exited 2" once per file with exit 1."""
    checkpoint(repo, "a.safetensors", json.dumps({"source": "resnet18"}))
    checkpoint(repo, "b.safetensors", json.dumps({"source": "resnet18"}))
    code, output = hook(repo, "-w", "abc", "--", "a.safetensors", "b.safetensors")
    assert code == 2 and "Invalid value for '-w'" in output and verified(repo) == [], output
    one_line_each(output, 1)


@pytest.mark.parametrize(
    "args, said",
    [
        (["-w", "0"], "--world-size must be at least 2 (got 0)"),
        (["--input-shape", "abc"], "--input-shape 'abc' is not a list of integers"),
        (["--atol", "nan"], "--atol nan is not a tolerance"),
    ],
)
def test_option_values_verify_refuses_later_are_refused_by_the_real_verifys_probe(repo, tmp_path, args, said):
    """-w 0 and --input-shape abc are ints and strings to Click: the probe took them, every file ran verify, which
    refused them, and the hook exited 1. They are judged as Click reads them now: exit 2, one line, no file run."""
    checkpoint(repo, "a.safetensors", '{"source": "resnet18"}')
    done, output = hook_with_this_python(repo, tmp_path, *args, "--", "a.safetensors")
    assert done.returncode == 2 and said in output, output
    assert "a.safetensors" not in output, output
