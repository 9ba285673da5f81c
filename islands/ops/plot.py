"""A line chart as hand-written SVG: the run report's loss curve without a plotting dependency.

The SVG goes into a markdown artifact as a data: URI image, so the Prefect UI shows it inline.
"""

from __future__ import annotations

import base64
import math
from html import escape

WIDTH, HEIGHT = 640, 360
LEFT, RIGHT, TOP, BOTTOM = 64, 170, 24, 48
COLORS = ["#111111", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
TICKS = 5

Series = dict[str, list[tuple[float, float]]]


def _finite(series: Series) -> Series:
    return {name: [(x, y) for x, y in pts if math.isfinite(x) and math.isfinite(y)] for name, pts in series.items()}


def _span(values: list[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    return (lo - 0.5, hi + 0.5) if hi == lo else (lo, hi)


def _tick(value: float) -> str:
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def line_chart(series: Series, x_label: str, y_label: str) -> str:
    """An SVG document with one polyline per series (the first drawn thick), axes and a legend."""
    series = {k: v for k, v in _finite(series).items() if v}
    if not series:
        raise ValueError("line_chart needs at least one finite point")
    x0, x1 = _span([x for pts in series.values() for x, _ in pts])
    y0, y1 = _span([y for pts in series.values() for _, y in pts])
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return TOP + (y1 - y) / (y1 - y0) * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>',
    ]
    for i in range(TICKS + 1):
        xv, yv = x0 + (x1 - x0) * i / TICKS, y0 + (y1 - y0) * i / TICKS
        out.append(f'<text x="{sx(xv):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{_tick(xv)}</text>')
        out.append(f'<text x="{LEFT - 6}" y="{sy(yv) + 4:.1f}" text-anchor="end">{_tick(yv)}</text>')
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{sy(yv):.1f}" y2="{sy(yv):.1f}" stroke="#eee"/>')
    out.append(f'<text x="{LEFT + plot_w / 2:.0f}" y="{HEIGHT - 8}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(
        f'<text x="14" y="{TOP + plot_h / 2:.0f}" text-anchor="middle" transform="rotate(-90 14 {TOP + plot_h / 2:.0f})">'
        f"{escape(y_label)}</text>"
    )
    for i, (name, pts) in enumerate(series.items()):
        color, width = COLORS[i % len(COLORS)], 2.5 if i == 0 else 1.2
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sorted(pts))
        out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="{width}"/>')
        for x, y in pts:
            out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="{width}" fill="{color}"/>')
        ly = TOP + 14 + 16 * i
        out.append(
            f'<line x1="{WIDTH - RIGHT + 12}" x2="{WIDTH - RIGHT + 32}" y1="{ly - 4}" y2="{ly - 4}" stroke="{color}" stroke-width="{width}"/>'
        )
        out.append(f'<text x="{WIDTH - RIGHT + 38}" y="{ly}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def data_uri(svg: str) -> str:
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()
