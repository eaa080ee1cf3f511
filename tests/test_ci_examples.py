"""The CI examples of docs/verify.md: the bnsurgeon-verify pre-commit hook run by pre-commit itself, and the workflow."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
HOOK_ID = "bnsurgeon-verify"


def test_the_pasted_files_name_the_hook_and_their_steps_are_valid_bash():
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert [h["id"] for h in hooks] == [HOOK_ID] and os.access(ROOT / hooks[0]["entry"], os.X_OK)
    config = yaml.safe_load((ROOT / "docs/ci/pre-commit-config.yaml").read_text())
    assert config["repos"][0]["hooks"][0]["id"] == HOOK_ID
    workflow = yaml.safe_load((ROOT / "docs/ci/github-actions.yml").read_text())
    steps = [s for job in workflow["jobs"].values() for s in job["steps"] if "run" in s]
    assert any(HOOK_ID in s["run"] for s in steps)
    for step in steps:
        result = subprocess.run(["bash", "-n"], input=step["run"], text=True, capture_output=True)
        assert result.returncode == 0, (step["name"], result.stderr)
    # a pull request never brings its own hook configuration or workflow: both come from the base branch
    triggers = workflow.get("on", workflow.get(True))
    assert "pull_request_target" in triggers and "pull_request" not in triggers, triggers
    assert workflow["permissions"] == {"contents": "read"}
    checkouts = [s for job in workflow["jobs"].values() for s in job["steps"] if "checkout" in s.get("uses", "")]
    assert all(s["with"]["persist-credentials"] is False for s in checkouts)
    assert any("base.sha" in s["with"]["ref"] and s["with"]["path"] == "base" for s in checkouts)
    verify_step = next(s for s in steps if HOOK_ID in s["run"])
    assert '--config "$GITHUB_WORKSPACE/base/.pre-commit-config.yaml"' in verify_step["run"]
    page = (ROOT / "docs/verify.md").read_text()
    assert '--8<-- "docs/ci/pre-commit-config.yaml"' in page and '--8<-- "docs/ci/github-actions.yml"' in page


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_pre_commit_try_repo_runs_the_hook_on_changed_checkpoints(tmp_path):
    pytest.importorskip("pre_commit", reason="pip install pre-commit (the test extra)")
    import bnsurgeon

    repo = tmp_path / "user-repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    # a fused checkpoint: verify runs eval checks only (no rank processes), the cheapest real verify
    cwd = os.getcwd()
    os.chdir(repo)
    try:
        bnsurgeon.convert_source("resnet18", "r18.fused.safetensors", to="fused", input_shape=(2, 3, 32, 32))
    finally:
        os.chdir(cwd)
    (repo / "broken.safetensors").write_bytes(b"\x00" * 64)
    (repo / "broken.safetensors.report.json").write_text('{"source": "timm:resnet18"}')
    (repo / "raw.safetensors").write_bytes(b"\x00" * 8)  # no report: not a converted checkpoint
    git("add", "-A")
    env = {
        **os.environ,
        "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"),
        "PYTHONPATH": str(ROOT),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }

    def try_repo(*files):
        return subprocess.run(
            [sys.executable, "-m", "pre_commit", "try-repo", str(ROOT), HOOK_ID, "--verbose", "--files", *files],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
        )

    # a commit where nothing fails passes (no verify starts for a file that is not a converted checkpoint)
    skipped = try_repo("raw.safetensors")
    assert skipped.returncode == 0 and "Passed" in skipped.stdout, skipped.stdout + skipped.stderr
    assert "raw.safetensors: no raw.safetensors.report.json and no --source" in skipped.stdout
    # one pre-commit run over all three (each run clones this repository and starts verify afresh)
    done = try_repo("r18.fused.safetensors", "raw.safetensors", "broken.safetensors")
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "Failed" in done.stdout, output
    assert "bnsurgeon verify -- resnet18 r18.fused.safetensors" in done.stdout, output
    assert "all checks passed" in done.stdout and "r18.fused.safetensors: verify exited" not in done.stdout, output
    assert "raw.safetensors: no raw.safetensors.report.json and no --source" in done.stdout, output
    assert "broken.safetensors: verify exited 4" in done.stdout, output  # not a readable checkpoint
