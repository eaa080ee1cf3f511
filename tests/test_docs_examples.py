"""Every command and Python block of the README and docs/ runs and is checked, or is marked with why not.

The runner is tests/_docs_examples.py; the marks are HTML comments above each block. A marked
block is still syntax-checked and shows up here as a skip with its reason.
"""

from __future__ import annotations

import pytest
from _docs_examples import ROOT, Block, ExampleError, Session, all_blocks, output_matches, pages, parse, run_block

BLOCKS = all_blocks()


@pytest.fixture(scope="session")
def docs_session(tmp_path_factory):
    return Session(tmp_path_factory.mktemp("docs-examples"))


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_example(block: Block, docs_session):
    run_block(block, docs_session)
    if block.skip:
        pytest.skip(f"not run: {block.skip} (syntax checked)")


def test_the_examples_are_found():
    assert "README.md" in pages() and "docs/getting-started.md" in pages()
    run = [b for b in BLOCKS if not b.skip]
    assert len(run) >= 15 and any(b.path == "README.md" and not b.skip for b in BLOCKS)
    assert {b.language for b in run} == {"bash", "console", "python"}


# the runner must be able to fail ------------------------------------------------------------


def _one(markdown: str) -> Block:
    (block,) = parse(markdown, "broken.md")
    return block


def test_a_command_that_fails_fails_the_example(tmp_path):
    block = _one("```console\n$ bnsurgeon inspect no_such_model_at_all\n```\n")
    with pytest.raises(ExampleError, match="exited 3"):
        run_block(block, Session(tmp_path))


def test_output_that_differs_from_the_page_fails_the_example(tmp_path):
    block = _one("```console\n$ bnsurgeon rules\n  rule  classes\n  torch-batchnorm  NoSuchClass\n```\n")
    with pytest.raises(ExampleError, match="the page shows"):
        run_block(block, Session(tmp_path))
    assert output_matches(["a ... c", "...", "z"], "a b c\nx\ny\nz\n")
    assert not output_matches(["a ... c", "z"], "a b c\nx\nz\n")


def test_a_python_block_that_raises_fails_and_a_broken_skipped_block_too(tmp_path):
    with pytest.raises(ZeroDivisionError):
        run_block(_one("```python\n1 / 0\n```\n"), Session(tmp_path))
    with pytest.raises(SyntaxError):
        run_block(_one("<!-- docs-test: skip (needs a GPU) -->\n```python\ndef f(:\n```\n"), Session(tmp_path))
    with pytest.raises(ExampleError, match="bash -n"):
        run_block(_one("<!-- docs-test: skip (needs a GPU) -->\n```bash\nif then fi (\n```\n"), Session(tmp_path))


def test_a_skip_needs_a_reason_and_unknown_marks_are_refused():
    with pytest.raises(ExampleError, match="reason"):
        _one("<!-- docs-test: skip -->\n```bash\ntrue\n```\n")
    with pytest.raises(ExampleError, match="unknown"):
        _one("<!-- docs-test: sikp (typo) -->\n```bash\ntrue\n```\n")


def test_every_page_is_in_the_site_navigation_or_linked():
    """mkdocs build --strict (scripts/test.sh) checks links; this checks that the sweep outputs stay reachable."""
    config = (ROOT / "mkdocs.yml").read_text()
    for page in ("zoo_sweep.md", "fused_sweep.md", "report-schema.md", "architecture.md", "testing.md"):
        assert page in config, page
