"""Inline SVG plots of a golden cell: the run's curve over the golden curve, per series, and the
relative drift per step on a log scale (a 1e-6 drift is invisible on the curves themselves, so the
drift panel is what shows where it starts and how it grows). No script, no external library: the
page stays self-contained, and hovering a point shows its numbers through SVG ``<title>``."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from harness.report.golden_view import GoldenCell, SeriesView

PANEL_W, PANEL_H, GAP, LEGEND_H = 300, 180, 16, 18
LEFT, RIGHT, TOP, BOTTOM = 64, 10, 24, 30
RUN, GOLDEN, MARK = "#c62828", "#9e9e9e", "#ef6c00"
SERIES_COLOURS = ("#c62828", "#1565c0", "#6a1b9a", "#2e7d32", "#ef6c00", "#00838f")
DRIFT_FLOOR = 1e-18  # where an exact step sits on the log axis
MAX_MARKERS = 50  # hover points per series (each ~140 bytes); the curve itself keeps every step


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _num(v: float) -> str:
    return f"{v:.6g}"


class _Frame:
    """One panel's coordinate system: data (step, y) to pixels inside the panel at ``x0``."""

    def __init__(self, x0: float, steps: int, lo: float, hi: float) -> None:
        self.x0, self.steps = x0, max(steps, 2)
        pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
        self.lo, self.hi = lo - pad, hi + pad

    def x(self, step: float) -> float:
        return self.x0 + LEFT + (PANEL_W - LEFT - RIGHT) * step / (self.steps - 1)

    def y(self, value: float) -> float:
        frac = (value - self.lo) / (self.hi - self.lo)
        return TOP + (PANEL_H - TOP - BOTTOM) * (1.0 - frac)

    def box(self, title: str, y_labels: Sequence[tuple[float, str]]) -> list[str]:
        x1, x2 = self.x0 + LEFT, self.x0 + PANEL_W - RIGHT
        y1, y2 = TOP, PANEL_H - BOTTOM
        out = [f'<rect x="{x1}" y="{y1}" width="{x2 - x1}" height="{y2 - y1}" fill="#fff" stroke="#bbb"/>',
               f'<text x="{self.x0 + LEFT}" y="{TOP - 8}" font-weight="bold">{_esc(title)}</text>',
               f'<text x="{x1}" y="{y2 + 14}" text-anchor="middle">0</text>',
               f'<text x="{x2}" y="{y2 + 14}" text-anchor="middle">{self.steps - 1}</text>',
               f'<text x="{(x1 + x2) / 2}" y="{y2 + 26}" text-anchor="middle" fill="#666">step</text>']
        for value, label in y_labels:
            out.append(f'<text x="{x1 - 4}" y="{self.y(value) + 4:.1f}" text-anchor="end">{_esc(label)}</text>')
        return out

    def line(self, values: Sequence[float], colour: str, width: float, extra: str = "") -> str:
        points = " ".join(f"{self.x(i):.1f},{self.y(v):.1f}" for i, v in enumerate(values) if math.isfinite(v))
        return f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="{width}"{extra}/>'

    def marker(self, step: int, label: str) -> list[str]:
        x = self.x(step)
        return [f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{PANEL_H - BOTTOM}" stroke="{MARK}" '
                'stroke-dasharray="4 3"/>',
                f'<text x="{x + 3:.1f}" y="{TOP + 12}" fill="{MARK}">{_esc(label)}</text>']


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def marker_steps(steps: int, first_drift: int | None) -> list[int]:
    """The steps that get a hover point: all of a short series; of a long one ``MAX_MARKERS``
    evenly spaced, the first drifting step and the last (so 20 plots of 300 steps stay small)."""
    if steps <= MAX_MARKERS:
        return list(range(steps))
    every = math.ceil(steps / MAX_MARKERS)
    extra = {steps - 1} | ({first_drift} if first_drift is not None and 0 <= first_drift < steps else set())
    return sorted(set(range(0, steps, every)) | extra)


def values_panel(s: SeriesView, x0: float) -> list[str]:
    """The golden curve (wide, grey) with the run's on top (thin, red); hover a point for its numbers."""
    golden = s.golden or []
    both = _finite([*s.run, *golden]) or [0.0]
    frame = _Frame(x0, max(len(s.run), len(golden)), min(both), max(both))
    out = frame.box(f"{s.name}: run over golden", [(min(both), _num(min(both))), (max(both), _num(max(both)))])
    out.append(frame.line(golden, GOLDEN, 5, ' stroke-opacity="0.7"'))
    out.append(frame.line(s.run, RUN, 1.5))
    for i in marker_steps(len(s.run), s.first_drift_step):
        v = s.run[i]
        if not math.isfinite(v):
            continue
        want = golden[i] if i < len(golden) else math.nan
        drift = abs(v - want) / max(abs(want), 1e-30) if math.isfinite(want) else math.nan
        out.append(f'<circle cx="{frame.x(i):.1f}" cy="{frame.y(v):.1f}" r="2.2" fill="{RUN}"><title>'
                   f"step {i}: run {v!r}, golden {want!r}, relative drift {drift:.3g}</title></circle>")
    if s.first_drift_step is not None:
        out += frame.marker(s.first_drift_step, f"first drift: step {s.first_drift_step}")
    return out


def _drifts(s: SeriesView) -> list[float]:
    golden = s.golden or []
    return [abs(r - g) / max(abs(g), 1e-30) if math.isfinite(r) and math.isfinite(g) else math.nan
            for r, g in zip(s.run, golden, strict=False)]


def drift_panel(series: Sequence[SeriesView], x0: float) -> list[str]:
    """log10 of the relative drift per step, one line per series; exact steps sit on the floor."""
    drifts = {s.name: _drifts(s) for s in series if s.golden is not None}
    seen = [d for ds in drifts.values() for d in ds if math.isfinite(d) and d > 0]
    tols = [s.tolerance for s in series if s.tolerance > 0]
    hi = math.log10(max([*seen, *tols, 1e-12]) * 10)
    lo = math.log10(min([*seen, *tols], default=1e-12) / 100) if seen or tols else hi - 8
    steps = max((len(d) for d in drifts.values()), default=2)
    frame = _Frame(x0, steps, lo, hi)
    every = max(1, round((hi - lo) / 4))
    decades = [float(d) for d in range(math.ceil(lo), math.floor(hi) + 1, every)]
    exact = any(d == 0 for ds in drifts.values() for d in ds)
    labels = [(d, f"1e{d:.0f}") for d in decades if not exact or d - lo > (hi - lo) / 8]
    out = frame.box("relative drift per step (log)", labels + ([(lo, "exact")] if exact else []))
    for d in decades:
        out.append(f'<line x1="{x0 + LEFT}" y1="{frame.y(d):.1f}" x2="{x0 + PANEL_W - RIGHT}" y2="{frame.y(d):.1f}" '
                   'stroke="#eee"/>')
    x = x0 + 8.0
    for k, (name, ds) in enumerate(drifts.items()):
        colour = SERIES_COLOURS[k % len(SERIES_COLOURS)]
        logs = [math.log10(max(d, DRIFT_FLOOR)) if math.isfinite(d) else math.nan for d in ds]
        out.append(frame.line([max(v, lo) for v in logs], colour, 1.5))
        out.append(f'<line x1="{x}" y1="{PANEL_H + 6}" x2="{x + 14}" y2="{PANEL_H + 6}" stroke="{colour}" '
                   f'stroke-width="2"/><text x="{x + 17}" y="{PANEL_H + 10}" fill="{colour}">{_esc(name)}</text>')
        x += 30 + 7 * len(name)
    for tol in sorted(set(tols)):
        y = frame.y(math.log10(tol))
        out.append(f'<line x1="{x0 + LEFT}" y1="{y:.1f}" x2="{x0 + PANEL_W - RIGHT}" y2="{y:.1f}" stroke="#555" '
                   f'stroke-dasharray="2 2"><title>tolerance {tol:g}</title></line>')
    return out


def golden_svg(cell: GoldenCell) -> str:
    """Small multiples: each series' curves, then the drift panel."""
    series = [s for s in cell.series if s.run]
    panels = [s for s in series if s.golden is not None] or series
    parts: list[str] = []
    for i, s in enumerate(panels):
        parts += values_panel(s, i * (PANEL_W + GAP))
    if any(s.golden is not None for s in series):
        parts += drift_panel(series, len(panels) * (PANEL_W + GAP))
        count = len(panels) + 1
    else:
        count = len(panels)
    width = count * PANEL_W + (count - 1) * GAP
    label = f"golden cell {cell.cell} ({cell.platform}): run over golden values and relative drift per step"
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="golden-plot" data-cell="{_esc(cell.cell)}" '
            'font-family="system-ui,-apple-system,Segoe UI,Roboto,sans-serif" font-size="12" '
            f'width="{width}" height="{PANEL_H + LEGEND_H}" viewBox="0 0 {width} {PANEL_H + LEGEND_H}" role="img" '
            f'aria-label="{_esc(label)}"><title>{_esc(label)}</title>' + "".join(parts) + "</svg>")
