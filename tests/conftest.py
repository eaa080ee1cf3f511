"""Every test gets the process-wide rule registry back as it found it; ``cli`` for the ``run`` command.

A test that names ``--rules`` or registers a rule in the pytest process would otherwise leave the rule for the
next test of the same worker, which then sees a registry no user process has (which tests share a worker
depends on timing: the failures were ordering-dependent). Families of rules that join when their package is
imported (timm's, torchvision's, OpenMMLab's) are forgotten with the rest and join again on the next look-up.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _rule_registry_as_found():
    import bnsurgeon.rules as rules

    registry = rules._default
    saved = None if registry is None else (list(registry._rules), dict(registry._by_class), set(registry.joined))
    named = dict(rules._named_specs)
    yield
    if registry is not None and saved is not None:
        registry._rules[:], registry._by_class, registry.joined = saved[0], saved[1], saved[2]
    rules._default = registry  # None again where the test made the first one
    rules._named_specs.clear()
    rules._named_specs.update(named)


@pytest.fixture
def cli():
    """CliRunner for `run`: the command leaves the script's state in place (its process ends with it); put back."""
    from typer.testing import CliRunner

    from bnsurgeon.launch.script import put_back

    try:
        yield CliRunner()
    finally:
        put_back()
