"""What sync buys: how far each rank's own batch statistics are from the global batch's, per sync layer.

Plain (per-rank) BN normalizes each rank's batch with that batch's mean and variance; sync BN with the global
batch's. The sync layer's forward already gathers every rank's (count, mean, var) to merge them, so the gap is
read from those rows: no extra collective, and nothing read on the host while it records (the gaps stay
tensors on the layer's device until the summary). Per call and per channel, for every rank r:

    mean gap   (mean_r - mean) / sqrt(var + eps)          how far plain BN would shift the normalized output
    scale gap  sqrt((var + eps) / (var_r + eps)) - 1      how much plain BN would rescale it (relative)

in units of the global batch's standard deviation, so 0.3 means plain BN moves every normalized value by 0.3.
An empty rank has no statistics of its own: its gaps are NaN and left out of every summary.

``GapRecorder`` keeps what the first ``steps`` training steps gathered (a step: one synchronized call of the first layer that
recorded) of the layers its name patterns select; ``start_recording`` makes it the process's recorder, which
the sync layer asks for with one ``is None`` test per call (nothing else where none is recording). The summary
(``summarize``) is plain numbers, the same on every rank (every rank gathered the same rows).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from bnsurgeon.runtime import device_checks

_recorder: "GapRecorder | None" = None


def current() -> "GapRecorder | None":
    """The recorder the sync layers feed, or None (the layers then do nothing more)."""
    return _recorder


def start_recording(recorder: "GapRecorder") -> None:
    """Make ``recorder`` the one the sync layers of this process feed from their next call."""
    global _recorder
    _recorder = recorder


def stop_recording(recorder: "GapRecorder | None" = None) -> None:
    """No recorder any more (only where it is still ``recorder``, when given)."""
    global _recorder
    if recorder is None or _recorder is recorder:
        _recorder = None


@dataclass
class Call:
    """What one synchronized call gathered, kept as the tensors it made (nothing computed while recording): every
    rank's count (W,), mean and spread (W, C), and the global batch's mean and spread (C,). The spread is the
    variance, or where ``invstd`` (the device path's rows) 1 / sqrt(var + eps)."""

    counts: torch.Tensor
    means: torch.Tensor
    spreads: torch.Tensor
    mean: torch.Tensor
    spread: torch.Tensor
    eps: float
    invstd: bool


@dataclass
class LayerGaps:
    """One layer's recorded calls."""

    name: str
    order: int
    channels: int
    samples: int  # this rank's samples in its first recorded call (the input's first dimension)
    values_per_sample: int  # values per channel in one sample (the product of the spatial sizes)
    calls: list[Call] = field(default_factory=list)

    def counts(self) -> torch.Tensor:
        """(calls, W) on the CPU, float64."""
        return torch.stack([call.counts.reshape(-1) for call in self.calls]).to("cpu", torch.float64)

    def gaps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean gaps, scale gaps), each (calls, W, C) on the CPU in float64; NaN for a rank with no values."""
        mean_gaps, scale_gaps = [], []
        for call in self.calls:
            means, mean = call.means.to("cpu", torch.float64), call.mean.to("cpu", torch.float64)
            spreads, spread = call.spreads.to("cpu", torch.float64), call.spread.to("cpu", torch.float64)
            if call.invstd:  # the device path gathers 1 / sqrt(var + eps): its std is its inverse
                rank_std, std = spreads.reciprocal(), spread.reciprocal()
            else:
                rank_std, std = (spreads + call.eps).sqrt(), (spread + call.eps).sqrt()
            empty = call.counts.reshape(-1, 1).to("cpu") <= 0
            mean_gaps.append(((means - mean) / std).masked_fill(empty, float("nan")))
            scale_gaps.append((std / rank_std - 1).masked_fill(empty, float("nan")))
        return torch.stack(mean_gaps), torch.stack(scale_gaps)


class GapRecorder:
    """Records the gaps of the first ``steps`` training steps of the layers whose names match ``layers`` (shell
    patterns, as ``fnmatch``; none: every layer). ``on_complete(recorder)`` runs once, at the first call of step
    ``steps + 1`` (or where ``finish`` is called first, as at the end of a shorter run)."""

    def __init__(
        self,
        steps: int = 20,
        layers: Sequence[str] = (),
        on_complete: Callable[["GapRecorder"], None] | None = None,
    ) -> None:
        if steps < 1:
            raise ValueError(f"steps must be at least 1, not {steps}")
        self.steps = steps
        self.patterns = list(layers)
        self.on_complete = on_complete
        self.layers: dict[int, LayerGaps] = {}
        #: the names of the layers that synchronized but no pattern selected, in the order they first did
        self.passed_over: dict[str, None] = {}
        self.step = 0
        self.done = False
        #: this process's rank in the default group, read at the first call recorded (the group may be gone when
        #: the summary is written, at exit)
        self.rank: int | None = None
        self._first: int | None = None
        self._seen = 0

    def selects(self, name: str) -> bool:
        return not self.patterns or any(fnmatch.fnmatchcase(name, pattern) for pattern in self.patterns)

    def record(
        self,
        identity: Any,
        counts: torch.Tensor,
        means: torch.Tensor,
        spreads: torch.Tensor,
        mean: torch.Tensor,
        spread: torch.Tensor,
        eps: float,
        shape: Sequence[int],
        invstd: bool = False,
    ) -> None:
        """One synchronized call of a layer: ``counts`` (W,), ``means`` and ``spreads`` (W, C) as gathered, in rank
        order; ``mean`` and ``spread`` the global batch's (C,); ``shape`` this rank's input shape. The spreads are
        variances, or ``invstd`` 1 / sqrt(var + eps). Keeps the tensors, fresh ones of this call that nothing
        changes afterwards: no op is dispatched and nothing read here (the gaps are computed in ``summarize``)."""
        if self.done or device_checks.capturing(mean.device):  # a graph replays into the same tensors
            return
        token = identity.token
        if self._first is None:
            import torch.distributed as dist

            self._first = token
            self.rank = dist.get_rank()
        if token == self._first:
            self.step += 1
            if self.step > self.steps:
                self.finish()
                return
        layer = self.layers.get(token)
        if layer is None:
            if not self.selects(identity.name):
                self.passed_over[identity.name] = None
                return
            values_per_sample = math.prod(int(size) for size in shape[2:])
            layer = self.layers[token] = LayerGaps(
                identity.name, self._seen, int(shape[1]), int(shape[0]), values_per_sample
            )
            self._seen += 1
        layer.calls.append(Call(counts, means, spreads, mean, spread, eps, invstd))

    def finish(self) -> None:
        """Stop recording and run ``on_complete`` once."""
        if self.done:
            return
        self.done = True
        stop_recording(self)
        if self.on_complete is not None:
            self.on_complete(self)

    def summarize(self) -> dict[str, Any]:
        """Plain numbers per layer, in the order the layers first recorded (the model's order as it runs), and over
        all of them. The gaps are computed here, in float64 on the CPU (one read of what was recorded)."""
        ordered = sorted(self.layers.values(), key=lambda gaps: gaps.order)
        computed = [(gaps, *gaps.gaps()) for gaps in ordered if gaps.calls]
        layers = [summarize_layer(gaps, mean_gaps, scale_gaps) for gaps, mean_gaps, scale_gaps in computed]
        first = layers[0] if layers else None
        return {
            "steps": min(self.step, self.steps),
            "layers": layers,
            "samples_per_rank": first["samples_per_rank"] if first else [],
            "noise": first["noise"] if first else None,
            "mean_gap": _spread(torch.cat([_finite(gaps) for _, gaps, _ in computed] or [_EMPTY])),
            "scale_gap": _spread(torch.cat([_finite(gaps) for _, _, gaps in computed] or [_EMPTY])),
        }


_EMPTY = torch.zeros(0, dtype=torch.float64)


def _spread(values: torch.Tensor) -> dict[str, float | None]:
    if values.numel() == 0:
        return {"median": None, "max": None}
    return {"median": float(values.median()), "max": float(values.max())}


def summarize_layer(gaps: LayerGaps, mean_gaps: torch.Tensor, scale_gaps: torch.Tensor) -> dict[str, Any]:
    """One layer's numbers: its ranks' samples (values per channel over values per sample), the global batch's own
    sampling noise in standard deviations (1 / sqrt(global samples), the standard error of its mean where every
    sample's values vary together), and the mean and scale gaps' median and largest value (absolute), over all and
    per rank."""
    first = gaps.counts()[0]
    per_sample = max(gaps.values_per_sample, 1)
    samples = [_samples(float(count), per_sample) for count in first.tolist()]
    total = sum(samples)
    mean_gaps, scale_gaps = mean_gaps.abs(), scale_gaps.abs()
    return {
        "name": gaps.name,
        "channels": gaps.channels,
        "calls": len(gaps.calls),
        "samples_per_rank": samples,
        "values_per_channel_per_rank": [int(count) for count in first.tolist()],
        "noise": 1.0 / math.sqrt(total) if total > 0 else None,
        "mean_gap": {**_spread(_finite(mean_gaps)), "per_rank_median": _per_rank(mean_gaps)},
        "scale_gap": {**_spread(_finite(scale_gaps)), "per_rank_median": _per_rank(scale_gaps)},
    }


def _samples(count: float, per_sample: int) -> float | int:
    """A rank's samples from its values per channel: exact where its samples have this rank's spatial size."""
    value = count / per_sample
    return int(value) if value.is_integer() else round(value, 2)


def _finite(values: torch.Tensor) -> torch.Tensor:
    """The absolute gaps, flat, empty ranks (NaN) left out."""
    flat = values.abs().flatten()
    return flat[~flat.isnan()]


def _per_rank(values: torch.Tensor) -> list[float | None]:
    return [_spread(_finite(values[:, rank]))["median"] for rank in range(values.shape[1])]
