"""The SVG of one plot panel (fw.commands.bench.plot's HTML pages), drawn by hand: axes with round ticks,
bars, points, lines and legends. Every mark carries its number in `data-value` and a hover
title; every text from a report is escaped."""

from __future__ import annotations

import math
from html import escape
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # for annotations only: fw.commands.bench.plot imports this module
    from fw.commands.bench.plot import Panel

COLORS = ("#2b5fad", "#d9822b", "#3c9d5d", "#b0413e", "#7b5ea7", "#8c6d31", "#17a2b8", "#7f7f7f")

WIDTH, HEIGHT = 440, 320
LEFT, RIGHT, TOP = 64, 16, 34


def fmt(x: Any) -> str:
    """A figure for a label: 3 significant digits, whole numbers from 100 up."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
    return str(x)


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]: steps of 1, 2, 2.5 or 5 times a power of ten."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return [0.0, 1.0]
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.floor(low / step) * step
    ticks, i = [], 0
    while True:
        tick = first + i * step
        ticks.append(round(tick, 12))
        if tick >= high - step * 1e-9:
            return ticks
        i += 1


def _num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def _tick_text(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 10000:
        return f"{x / 1000:g}k"
    return f"{x:.6g}"


class Canvas:
    """One panel's SVG elements in a plot area [x0, x1] x [y0, y1] (pixels, y down)."""

    def __init__(self, panel: Panel, bottom_margin: int = 48):
        self.panel = panel
        self.x0, self.x1 = LEFT, WIDTH - RIGHT
        self.y0, self.y1 = TOP, HEIGHT - bottom_margin
        self.parts: list[str] = []

    def add(self, element: str) -> None:
        self.parts.append(element)

    def text(self, x: float, y: float, text: str, anchor: str = "middle", extra: str = "") -> None:
        self.add(f'<text x="{_num(x)}" y="{_num(y)}" text-anchor="{anchor}"{extra}>{escape(text)}</text>')

    def value_axis(self, low: float, high: float) -> Callable[[float], float]:
        """Draw the y axis with its ticks and grid; return value -> pixel y."""
        ticks = nice_ticks(low, high)
        low, high = ticks[0], ticks[-1]

        def y(v: float) -> float:
            return self.y1 - (v - low) / (high - low) * (self.y1 - self.y0)

        for t in ticks:
            self.add(f'<line x1="{self.x0}" x2="{self.x1}" y1="{_num(y(t))}" y2="{_num(y(t))}" stroke="#eee"/>')
            self.text(self.x0 - 4, y(t) + 4, _tick_text(t), "end")
        self.add(f'<line x1="{self.x0}" x2="{self.x0}" y1="{self.y0}" y2="{self.y1}" stroke="#999"/>')
        self.add(f'<line x1="{self.x0}" x2="{self.x1}" y1="{self.y1}" y2="{self.y1}" stroke="#999"/>')
        self.text(14, (self.y0 + self.y1) / 2, self.panel.unit, "middle",
                  f' transform="rotate(-90 14 {_num((self.y0 + self.y1) / 2)})"')
        return y

    def rect(self, x: float, y: float, w: float, h: float, color: str, value: float, title: str) -> None:
        self.add(f'<rect x="{_num(x)}" y="{_num(y)}" width="{_num(max(w, 0.5))}" height="{_num(max(h, 0))}" '
                 f'fill="{color}" data-value="{value!r}"><title>{escape(title)}</title></rect>')

    def legend(self, entries: list[tuple[str, str]], dashed: set[str] = frozenset(), x: float | None = None) -> None:
        """Colour keys from the plot area's top left (or from `x`)."""
        x, y = (self.x0 if x is None else x) + 8, self.y0 + 6
        if entries:  # a white card under the keys, so bars behind them stay readable
            width = 22 + 6.2 * max(len(label) for label, _ in entries)
            self.add(f'<rect x="{_num(x - 4)}" y="{_num(y - 3)}" width="{_num(width)}" '
                     f'height="{14 * len(entries) + 4}" fill="#fff" fill-opacity="0.85" stroke="#ddd"/>')
        for label, color in entries:
            if label in dashed:
                self.add(f'<line x1="{_num(x)}" x2="{_num(x + 10)}" y1="{_num(y + 5)}" y2="{_num(y + 5)}" '
                         f'stroke="{color}" stroke-dasharray="3 2"/>')
            else:
                self.add(f'<rect x="{_num(x)}" y="{_num(y)}" width="10" height="10" fill="{color}"/>')
            self.text(x + 14, y + 9, label, "start")
            y += 14

    def svg(self) -> str:
        title = f'<text class="title" x="{WIDTH / 2}" y="18" text-anchor="middle">{escape(self.panel.title)}</text>'
        x_label = ""
        if self.panel.x_label:
            x_label = f'<text x="{(self.x0 + self.x1) / 2}" y="{HEIGHT - 6}" text-anchor="middle">' \
                      f"{escape(self.panel.x_label)}</text>"
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
                f'viewBox="0 0 {WIDTH} {HEIGHT}" data-kind="{self.panel.kind}" role="img" '
                f'aria-label="{escape(self.panel.title)}">{title}{"".join(self.parts)}{x_label}</svg>')


def panel_svg(panel: Panel) -> str:
    return _DRAW[panel.kind](panel)


def _histogram(panel: Panel) -> str:
    c = Canvas(panel)
    bins, markers = panel.data["bins"], panel.data["markers"]
    if not bins:
        c.text(WIDTH / 2, HEIGHT / 2, "no values")
        return c.svg()
    y = c.value_axis(0, max(b[2] for b in bins) * 1.25)  # headroom for the legend
    low = min([bins[0][0], *markers.values()])
    high = max([bins[-1][1], *markers.values()])
    if high <= low:
        low, high = low - 0.5, high + 0.5
    ticks = nice_ticks(low, high)

    def x(v: float) -> float:
        return c.x0 + (v - ticks[0]) / (ticks[-1] - ticks[0]) * (c.x1 - c.x0)

    for t in ticks:
        c.text(x(t), c.y1 + 14, _tick_text(t))
    for lo, hi, count in bins:
        left, right = x(lo), x(hi) if hi > lo else x(lo) + 4
        c.rect(left, y(count), right - left - 1, c.y1 - y(count), COLORS[0], count,
               f"{fmt(lo)}-{fmt(hi)} ms: {count}")
    entries = []
    for i, (name, value) in enumerate(markers.items()):
        color = COLORS[1 + i]
        c.add(f'<line x1="{_num(x(value))}" x2="{_num(x(value))}" y1="{c.y0}" y2="{c.y1}" stroke="{color}" '
              f'stroke-dasharray="4 3" data-value="{value!r}" data-marker="{escape(name)}">'
              f"<title>{escape(name)} {fmt(value)} ms</title></line>")
        entries.append((f"{name} {fmt(value)} ms", color))
    c.legend(entries, dashed={e[0] for e in entries}, x=c.x1 - 120)  # right: a latency tail is thin there
    return c.svg()


def _bars(panel: Panel) -> str:
    c = Canvas(panel)
    groups = panel.data["groups"]
    values = [v for g in groups for v in [g["value"], *g["points"]] if v is not None]
    y = c.value_axis(0, max(values, default=1.0))
    slot = (c.x1 - c.x0) / max(1, len(groups))
    for i, g in enumerate(groups):
        center = c.x0 + slot * (i + 0.5)
        if g["value"] is not None:
            c.rect(center - slot * 0.3, y(g["value"]), slot * 0.6, c.y1 - y(g["value"]), COLORS[i % len(COLORS)],
                   g["value"], f"{g['label']}: {fmt(g['value'])} {panel.unit}")
            c.text(center + slot * 0.3 - 2, y(max([g["value"], *g["points"]])) - 5, fmt(g["value"]), "end")
        n = len(g["points"])
        for j, p in enumerate(g["points"]):
            px = center + (j - (n - 1) / 2) * min(10.0, slot * 0.5 / max(1, n))
            c.add(f'<circle cx="{_num(px)}" cy="{_num(y(p))}" r="3" fill="#111" data-value="{p!r}">'
                  f"<title>{escape(g['label'])} pass {j + 1}: {fmt(p)} {escape(panel.unit)}</title></circle>")
        c.text(center, c.y1 + 16, g["label"])
    return c.svg()


def _grouped(panel: Panel) -> str:
    c = Canvas(panel, bottom_margin=84)
    categories, ref = panel.data["categories"], panel.data.get("reference")
    series = [s for s in panel.data["series"] if any(v is not None for v in s["values"])]  # skipped: no room
    values = [v for s in series for v in s["values"] if v is not None] + ([ref["value"]] if ref else [])
    y = c.value_axis(0, max(values, default=1.0))
    slot = (c.x1 - c.x0) / max(1, len(categories))
    width = slot * 0.8 / max(1, len(series))
    for i, category in enumerate(categories):
        for j, s in enumerate(series):
            v = s["values"][i]
            if v is None:
                continue
            left = c.x0 + slot * i + slot * 0.1 + width * j
            c.rect(left, y(v), width, c.y1 - y(v), COLORS[j % len(COLORS)], v,
                   f"{s['label']}, {category}: {fmt(v)} {panel.unit}")
        cx, cy = c.x0 + slot * (i + 0.5), c.y1 + 10
        c.text(cx, cy, category, "end", f' transform="rotate(-40 {_num(cx)} {_num(cy)})"')
    entries = [(s["label"], COLORS[j % len(COLORS)]) for j, s in enumerate(series)]
    if ref:
        c.add(f'<line x1="{c.x0}" x2="{c.x1}" y1="{_num(y(ref["value"]))}" y2="{_num(y(ref["value"]))}" '
              f'stroke="#111" stroke-dasharray="5 3" data-value="{ref["value"]!r}" data-reference="peak">'
              f"<title>{escape(ref['label'])}</title></line>")
        entries.append((ref["label"], "#111"))
    c.legend(entries, dashed={ref["label"]} if ref else set())
    return c.svg()


def _stacked(panel: Panel) -> str:
    c = Canvas(panel)
    categories, layers = panel.data["categories"], panel.data["layers"]
    totals = [sum(layer["values"][i] for layer in layers) for i in range(len(categories))]
    y = c.value_axis(0, max(totals, default=1.0))
    slot = (c.x1 - c.x0 - 110) / max(1, len(categories))  # room for the legend on the right
    for i, category in enumerate(categories):
        bottom = 0.0
        for j, layer in enumerate(layers):
            v = layer["values"][i]
            c.rect(c.x0 + slot * (i + 0.2), y(bottom + v), slot * 0.6, y(bottom) - y(bottom + v),
                   COLORS[j % len(COLORS)], v, f"{category}, {layer['label']}: {fmt(v)} {panel.unit}")
            bottom += v
        c.text(c.x0 + slot * (i + 0.5), y(bottom) - 4, f"{fmt(bottom)} {panel.unit}")
        c.text(c.x0 + slot * (i + 0.5), c.y1 + 16, category)
    c.legend([(layer["label"], COLORS[j % len(COLORS)]) for j, layer in enumerate(layers)], x=c.x1 - 110)
    return c.svg()


def _lines(panel: Panel) -> str:
    c = Canvas(panel)
    series = panel.data["series"]
    points = [p for s in series for p in s["points"]]
    y = c.value_axis(0, max((p[1] for p in points), default=1.0))
    xs = [p[0] for p in points] or [0.0, 1.0]
    ticks = nice_ticks(min(0.0, min(xs)), max(xs))

    def x(v: float) -> float:
        return c.x0 + (v - ticks[0]) / (ticks[-1] - ticks[0]) * (c.x1 - c.x0)

    for t in ticks:
        c.text(x(t), c.y1 + 14, _tick_text(t))
    for j, s in enumerate(series):
        color = COLORS[j % len(COLORS)]
        if len(s["points"]) > 1:
            path = " ".join(f"{_num(x(px))},{_num(y(py))}" for px, py in s["points"])
            c.add(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for px, py in s["points"]:
            c.add(f'<circle cx="{_num(x(px))}" cy="{_num(y(py))}" r="3.5" fill="{color}" data-value="{py!r}" '
                  f'data-x="{px!r}"><title>{escape(s["label"])} at {fmt(px)}: {fmt(py)}</title></circle>')
    c.legend([(s["label"], COLORS[j % len(COLORS)]) for j, s in enumerate(series)])
    return c.svg()


_DRAW: dict[str, Callable[[Panel], str]] = {"histogram": _histogram, "bars": _bars, "grouped": _grouped,
                                             "stacked": _stacked, "lines": _lines}
