"""The Python API the CLI is a thin layer over: a facade, no logic of its own.

``bnsurgeon.convert(module)`` is the surgery itself; ``convert_source`` is the whole
``bnsurgeon convert`` pipeline (resolve SOURCE, convert, check, write). Each step lives
in its own module; nothing imports back from here.
"""

from __future__ import annotations

from .architecture import Architecture, LoadedSource  # noqa: F401
from .checks import (  # noqa: F401
    CHECK_SEED,
    CHECK_SIDE,
    check_shapes,
    compare_eval,
    first_runnable_shape,
    infer_input_shape,
    preserved_modes,
)
from .pipeline import ConvertOutcome, convert_source, inspect, verify  # noqa: F401
from .rebuild import load, rebuild_from_checkpoint  # noqa: F401
from .recorded import class_map  # noqa: F401
from .surgery import ConvertResult, convert  # noqa: F401
from .writing import save, write_reports  # noqa: F401
