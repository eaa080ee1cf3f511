"""What ``recalibrate`` did: the pass (batches, samples, ranks, collectives) and each module's change, as a record
the pipeline writes beside the output (JSON and Markdown) and the CLI renders."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from bnsurgeon.core.layout import counted

if TYPE_CHECKING:
    import torch


@dataclass
class ModuleRecalibration:
    """What recalibration did to one module (the report's row)."""

    path: str
    cls: str
    channels: int
    elements: int  # per channel, over every call on every rank
    calls: int  # over every batch on every rank
    calls_per_batch: float
    mean_change_max: float  # max |new - old| over channels
    mean_change_rel: float  # max |new - old| / new std over channels
    var_change_max: float
    var_change_rel: float  # max |new - old| / old over channels
    aliases: list[str] = field(default_factory=list)


@dataclass
class RecalibrationReport:
    """The pass (batches, samples, ranks, collectives) and each module's change."""

    modules: list[ModuleRecalibration] = field(default_factory=list)
    unreached: list[str] = field(default_factory=list)  # tracked, but the forward never called them: unchanged
    skipped: list[dict[str, str]] = field(default_factory=list)  # {path, cls, reason}
    batches: int = 0  # over every rank
    samples: int = 0  # over every rank
    ranks: int = 1
    rank_batches: list[int] = field(default_factory=list)
    rank_samples: list[int] = field(default_factory=list)
    collectives: int = 0  # this pass's own (the sync layers' per-forward collectives are not counted)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    #: float64 population statistics per tracked path: (n, mean, population var); not serialised
    statistics: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    data: dict[str, Any] = field(default_factory=dict)  # what the data was (filled by the pipeline)
    source: str = ""
    output: str = ""

    @property
    def called_several_times(self) -> list[str]:
        return [m.path for m in self.modules if m.calls_per_batch > 1]

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if k != "statistics"}
        data["called_several_times"] = self.called_several_times
        return data

    def to_json(self) -> str:
        from bnsurgeon.core.json_text import dumps

        return dumps(self.to_dict(), indent=2)

    def to_markdown(self) -> str:
        lines = [
            f"# bnsurgeon recalibrate: {self.source or 'model'}",
            "",
            f"- {counted(len(self.modules), 'BN module')} recalibrated over {counted(self.samples, 'sample')} "
            f"in {batches_counted(self.batches)} on {counted(self.ranks, 'rank')}"
            f" ({counted(self.collectives, 'collective')}, {self.seconds:.2f} s)",
        ]
        if self.data:
            lines.append(f"- data: {self.data.get('description', '')} (sha256 {self.data.get('sha256', '')[:16]}...)")
        if self.unreached:
            lines.append(f"- never reached by the forward, left unchanged: {', '.join(self.unreached)}")
        for item in self.skipped:
            lines.append(f"- skipped {item['path']} ({item['cls']}): {item['reason']}")
        for note in self.notes:
            lines.append(f"- {note}")
        lines += [
            "",
            "| module | class | elements | calls/batch | max |d mean| | rel | max |d var| | rel |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for m in self.modules:
            lines.append(
                f"| {m.path} | {m.cls.rsplit('.', 1)[-1]} | {m.elements} | {m.calls_per_batch:g} | "
                f"{m.mean_change_max:.3g} | {m.mean_change_rel:.3g} | {m.var_change_max:.3g} | "
                f"{m.var_change_rel:.3g} |"
            )
        return "\n".join(lines) + "\n"


def batches_counted(number: int) -> str:
    return f"{number} batch{'' if number == 1 else 'es'}"
