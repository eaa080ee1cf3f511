"""Run a model for a check: its modes restored afterwards, and a model that raises on the input
reported as such (exit 9), not as a crash. Surgery (fusion tracing) and every check use these."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from bnsurgeon.core.errors import BnSurgeonError, ModelCannotRunError, first_line

if TYPE_CHECKING:
    from torch import nn


@contextmanager
def preserved_modes(*models: "nn.Module"):
    """Restore every module's training flag afterwards (source and result share modules)."""
    saved = [(module, module.training) for model in models for module in model.modules()]
    try:
        yield
    finally:
        for module, training in saved:
            module.training = training


def run_forward(model: "nn.Module", x: Any, what: str, described: str | None = None):
    """``model(x)``, with a model that raises on this input reported as such (exit 9), not as a crash."""
    try:
        return model(x)
    except BnSurgeonError:
        raise
    except Exception as error:
        shown = described or str(tuple(x.shape))
        raise ModelCannotRunError(
            f"{what} cannot run on the input {shown}: {type(error).__name__}: {first_line(error)}",
            "pass the input it takes: --input-shape N,C,H,W or --example-input x.pt",
        ) from None
