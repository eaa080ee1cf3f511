"""The Python API the CLI is a thin layer over: a facade, no logic of its own.

``bnsurgeon.convert(module)`` is the surgery itself; ``convert_source`` is the whole
``bnsurgeon convert`` pipeline (resolve SOURCE, convert, check, write). Each step lives
in its own module; nothing imports back from here. ``resolve_source`` resolves a SOURCE once; its
``ResolvedSource`` is what ``inspect``, ``convert_source``, ``verify``, ``recalibrate_source`` and ``load`` take
(a string is resolved on entry).
"""

from __future__ import annotations

from bnsurgeon.calibration.recalibrate import RecalibrationReport, recalibrate  # noqa: F401
from bnsurgeon.calibration.training import averaged_module, recalibrate_averaged  # noqa: F401
from bnsurgeon.checks.eval_check import (  # noqa: F401
    CHECK_SEED,
    CHECK_SIDE,
    check_shapes,
    compare_eval,
    first_runnable_shape,
    infer_input_shape,
)
from bnsurgeon.core.running import preserved_modes  # noqa: F401
from bnsurgeon.files.conversion import save, write_reports  # noqa: F401
from bnsurgeon.launch.gaps import SyncGapRecording, record_sync_gaps  # noqa: F401
from bnsurgeon.launch.script import ScriptRaised, run_script  # noqa: F401
from bnsurgeon.loading.architecture import Architecture, LoadedSource  # noqa: F401
from bnsurgeon.loading.rebuild import load, rebuild_from_checkpoint  # noqa: F401
from bnsurgeon.loading.resolve import ResolvedSource, resolve_source  # noqa: F401
from bnsurgeon.pipeline import ConvertOutcome, RecalibrateOutcome, convert_source, inspect, recalibrate_source, verify  # noqa: F401  # noqa: F401
from bnsurgeon.surgery.walk import (  # noqa: F401
    ConvertResult,
    class_map,  # noqa: F401
    convert,
)
