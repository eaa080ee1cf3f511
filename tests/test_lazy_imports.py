"""bnsurgeon's layers and rules import neither torch._dynamo nor timm nor torchvision until the process does.

``bnsurgeon run`` of a script that imports only torch paid 1.5 s on its first conversion for them (dynamo for
two ``torch.compiler.disable`` marks, timm and torchvision for their rules); the start-up benchmark is
``scripts/bench_run_startup.py``. What is deferred must still arrive: the marks once dynamo is imported, the rules
once timm or torchvision is.
"""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import inspect, json, sys
import bnsurgeon.runtime
from bnsurgeon.rules import default_registry
from bnsurgeon.runtime import replicas
from bnsurgeon.runtime.layers import SyncBatchNorm

names = lambda: {rule.name for rule in default_registry()}
before = {
    "loaded": [name for name in ("torch._dynamo", "timm", "torchvision") if name in sys.modules],
    "rules": sorted(names()),
}
originals = (SyncBatchNorm.__dict__["_normalize_eagerly"], replicas.normalize_replica)
import torch._dynamo
marked = (SyncBatchNorm.__dict__["_normalize_eagerly"], replicas.normalize_replica)
import torchvision.ops.misc
with_torchvision = sorted(names())
import timm.layers
print(json.dumps({
    **before,
    "marked": [new is not old and inspect.unwrap(new) is old for new, old in zip(marked, originals)],
    "with_torchvision": with_torchvision,
    "with_timm": sorted(names()),
}))
"""


def test_dynamo_timm_and_torchvision_wait_until_the_process_imports_them():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["loaded"] == []
    assert "timm-batchnorm-act" not in seen["rules"] and "torch-batchnorm" in seen["rules"]
    assert seen["marked"] == [True, True]  # the compile marks arrived with dynamo
    assert "torchvision-frozen" in seen["with_torchvision"] and "timm-frozen-act" not in seen["with_torchvision"]
    assert {"timm-batchnorm-act", "timm-frozen-act"} <= set(seen["with_timm"])


def test_the_built_in_rule_names_known_without_imports_are_the_built_in_rules():
    from bnsurgeon.rules import BUILTIN_RULE_NAMES, builtin_rules

    assert {rule.name for rule in builtin_rules()} | {"detectron2-frozen"} == BUILTIN_RULE_NAMES
