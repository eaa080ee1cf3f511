"""The picture of a sync-gap document: one self-contained HTML file, an inline SVG chart, no script, no network.

The layers in the order they ran, left to right. Per layer, each rank's median mean gap is a dot (one colour
per rank), a vertical line runs up to the layer's largest gap, and a dashed line marks the global batch's own
sampling error (1 / sqrt(global samples)): dots above it are layers where plain BN would shift normalized values
by more than the batch statistics are uncertain by anyway. A second, smaller chart shows the scale gaps the same
way. Hovering a layer names it, with its numbers.
"""

from __future__ import annotations

import html
import math
from typing import Any

#: rank colours (Okabe-Ito, readable by colour-blind readers), cycled past eight ranks
COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
MARK = "<!-- bnsurgeon sync gaps -->"


def render(document: dict[str, Any]) -> str:
    """The HTML page of ``document`` (``gaps.document``)."""
    layers = document["layers"]
    world = document["world_size"]
    noise = document.get("noise")
    title = "What sync buys: each rank's batch statistics against the global batch's"
    charts = [
        _chart(layers, "mean_gap", "mean gap (global standard deviations)", noise, world, 300),
        _chart(layers, "scale_gap", "scale gap (relative)", None, world, 200),
    ]
    legend = " ".join(
        f'<span class="key"><span class="dot" style="background:{COLOURS[rank % len(COLOURS)]}"></span>rank {rank}'
        "</span>"
        for rank in range(world)
    )
    verdict = html.escape(document["verdict"]["line"])
    return f"""<!doctype html>
{MARK}
<html lang="en">
<head>
<meta charset="utf-8">
<title>{html.escape(title)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }}
h1 {{ font-size: 18px; }}
p.verdict {{ font-weight: 600; }}
.key {{ margin-right: 14px; white-space: nowrap; }}
.dot {{ display: inline-block; width: 10px; height: 10px; border-radius: 5px; margin-right: 4px; }}
svg {{ display: block; margin: 12px 0; }}
table {{ border-collapse: collapse; margin-top: 16px; }}
td, th {{ padding: 2px 10px; text-align: right; border-bottom: 1px solid #eee; }}
td:first-child, th:first-child {{ text-align: left; }}
</style>
</head>
<body>
<h1>{html.escape(title)}</h1>
<p class="verdict">{verdict}</p>
<p>{len(layers)} layers in the order they ran, {world} ranks, {document["steps"]} steps. A dot: a rank's median over
channels and steps; a line: up to the layer's largest gap; dashed: the global batch's own sampling error. {legend}</p>
{"".join(charts)}
{_table(layers)}
</body>
</html>
"""


def _chart(layers: list[dict], key: str, label: str, noise: float | None, world: int, height: int) -> str:
    left, right, top, bottom = 56, 16, 30, 28
    step = max(8.0, min(48.0, 900.0 / max(len(layers), 1)))
    width = max(480.0, left + right + step * max(len(layers), 1))
    step = (width - left - right) / max(len(layers), 1)
    tallest = max([noise or 0.0, *(_number(layer[key]["max"]) for layer in layers)] or [0.0])
    scale_top = _nice(tallest * 1.08 or 1.0)
    plot = height - top - bottom

    def y(value: float) -> float:
        return top + plot * (1 - min(value, scale_top) / scale_top)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" role="img" '
        f'aria-label="{html.escape(label)}">',
        "<style>text { font: 11px system-ui, sans-serif; fill: #333; }</style>",  # the chart alone reads the same
        f'<text x="{left}" y="14">{html.escape(label)}</text>',
    ]
    for tick in _ticks(scale_top):
        parts.append(
            f'<line x1="{left}" x2="{width - right:.1f}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#eee"/>'
            f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:g}</text>'
        )
    if noise is not None:
        parts.append(
            f'<line x1="{left}" x2="{width - right:.1f}" y1="{y(noise):.1f}" y2="{y(noise):.1f}" stroke="#c00" '
            f'stroke-dasharray="5,4"><title>the global batch\'s own sampling error: {noise:.3g}</title></line>'
        )
    for index, layer in enumerate(layers):
        x = left + step * (index + 0.5)
        gap = layer[key]
        medians = [value for value in gap["per_rank_median"] if value is not None]
        tip = html.escape(
            f"{layer['name']}: median {_text(gap['median'])}, largest {_text(gap['max'])}; "
            f"samples per rank {layer['samples_per_rank']}"
        )
        parts.append(f"<g><title>{tip}</title>")
        if medians:
            parts.append(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y(min(medians)):.1f}" y2="{y(_number(gap["max"])):.1f}" '
                'stroke="#999"/>'
            )
        for rank, value in enumerate(gap["per_rank_median"]):
            if value is not None:
                colour = COLOURS[rank % len(COLOURS)]
                parts.append(f'<circle cx="{x:.1f}" cy="{y(value):.1f}" r="3" fill="{colour}"/>')
        parts.append("</g>")
    label_every = max(1, math.ceil(len(layers) / 30))
    for index in range(0, len(layers), label_every):
        x = left + step * (index + 0.5)
        parts.append(f'<text x="{x:.1f}" y="{height - 10}" text-anchor="middle">{index + 1}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _table(layers: list[dict]) -> str:
    rows = "".join(
        f"<tr><td>{index + 1}. {html.escape(layer['name'])}</td><td>{layer['channels']}</td>"
        f"<td>{_text(layer['mean_gap']['median'])}</td><td>{_text(layer['mean_gap']['max'])}</td>"
        f"<td>{_text(layer['scale_gap']['median'])}</td><td>{_text(layer['scale_gap']['max'])}</td></tr>"
        for index, layer in enumerate(layers)
    )
    return (
        "<table><tr><th>layer</th><th>channels</th><th>mean gap, median</th><th>largest</th>"
        f"<th>scale gap, median</th><th>largest</th></tr>{rows}</table>"
    )


def _number(value: float | None) -> float:
    return 0.0 if value is None else float(value)


def _text(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _nice(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten at least ``value``."""
    power = 10 ** math.floor(math.log10(value))
    return next(factor * power for factor in (1, 2, 2.5, 5, 10) if factor * power >= value)


def _ticks(top: float) -> list[float]:
    return [round(top * share, 10) for share in (0, 0.25, 0.5, 0.75, 1)]
