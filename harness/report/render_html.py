"""The sign-off as one self-contained HTML page (``report.html``): inline CSS and SVG, no script, no
network. The matrix is a heat map (one colour per outcome; hovering a cell shows its tests through
the SVG ``<title>``), each suite gets a stacked bar of its outcomes, and each drifting golden cell
its curves over the golden ones (``plots``)."""

from __future__ import annotations

import html
import re
from collections.abc import Sequence

from harness.report import document as doc
from harness.report import outline, plots
from harness.report.junit_read import OUTCOMES, Counts, TestCase
from harness.report.matrix_view import MatrixView
from harness.report.sections import Report

COLOURS = {"passed": "#2e7d32", "flaky": "#f9a825", "xfailed": "#7b1fa2", "skipped": "#b0bec5",
           "not run": "#37474f", "error": "#ef6c00", "failed": "#c62828"}
DARK_TEXT = frozenset({"flaky", "skipped"})
CELL_W, CELL_H, CHAR_W, PAD = 74, 20, 7, 8
MAX_TITLE_TESTS = 40
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em;color:#222;max-width:1400px}
table{border-collapse:collapse;margin:0.5em 0 1em}th,td{border:1px solid #ccc;padding:3px 7px;text-align:left;
vertical-align:top;font-size:13px}th{background:#f3f3f3}code{font-size:12px;background:#f6f6f6;padding:0 2px}
h2{border-bottom:2px solid #ddd;padding-bottom:3px;margin-top:1.6em}.PASS{color:#2e7d32}.FAIL{color:#c62828}
svg text{font-family:system-ui,sans-serif;font-size:12px}.legend span{display:inline-block;margin-right:12px}
.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:middle}
details{margin:0.3em 0 1em}summary{cursor:pointer;color:#1f4e8c}
svg.golden-plot{max-width:100%;height:auto;display:block;margin:0.3em 0}
"""


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def inline(text: str) -> str:
    """Escape, then the two Markdown inlines the report uses: `code` and **bold**."""
    out = esc(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)


def _cell(value: object) -> str:
    if isinstance(value, doc.Code):
        return f"<code>{esc(value)}</code>"
    return inline(value) if isinstance(value, doc.Md) else esc(value)


def table(t: doc.Table) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in t.headers)
    body = "".join("<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in row) + "</tr>" for row in t.rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _title(lines: Sequence[str]) -> str:
    return f"<title>{esc(chr(10).join(lines))}</title>"


def _text_width(texts: Sequence[str]) -> int:
    return max((len(t) for t in texts), default=1) * CHAR_W + 2 * PAD


def _cell_title(m: MatrixView, row: tuple[str, ...], col: str, cases: list[TestCase], outcome: str) -> str:
    where = ", ".join(f"{a}={v}" for a, v in zip(m.row_axes, row, strict=True))
    lines = [f"{where}, {m.column_axis}={col}", f"{outcome}: {sum(c.outcome == outcome for c in cases)} of "
             f"{len(cases)} test(s)"]
    lines += [f"{c.outcome}: {c.test_id} ({c.run})" for c in cases[:MAX_TITLE_TESTS]]
    if len(cases) > MAX_TITLE_TESTS:
        lines.append(f"... and {len(cases) - MAX_TITLE_TESTS} more")
    return _title(lines)


def heatmap(m: MatrixView) -> str:
    """The matrix as an SVG grid: row-axis label columns, then one coloured cell per column value
    (the column axis named above its values)."""
    widths = [_text_width([a, *(r[i] for r in m.rows)]) for i, a in enumerate(m.row_axes)]
    col_w = [max(CELL_W, _text_width([c, *(cell.label for (_, cc), cell in m.cells.items() if cc == c)]))
             for c in m.columns]
    left, top = sum(widths), 2 * CELL_H + 4
    width, height = left + sum(col_w) + 2, top + CELL_H * len(m.rows) + 2
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="heatmap" width="{width}" height="{height}" '
             f'role="img" aria-label="configuration matrix heat map">',
             f'<text x="{left + sum(col_w) / 2}" y="{CELL_H - 6}" text-anchor="middle" '
             f'font-weight="bold">{esc(m.column_axis or "")}</text>']
    x = 0
    for axis, w in zip(m.row_axes, widths, strict=True):
        parts.append(f'<text x="{x + PAD}" y="{2 * CELL_H - 6}" font-weight="bold">{esc(axis)}</text>')
        x += w
    xs = [left + sum(col_w[:j]) for j in range(len(m.columns))]
    for col, cx, w in zip(m.columns, xs, col_w, strict=True):
        parts.append(f'<text x="{cx + w / 2}" y="{2 * CELL_H - 6}" text-anchor="middle">{esc(col)}</text>')
    for i, row in enumerate(m.rows):
        y = top + i * CELL_H
        x = 0
        for value, w in zip(row, widths, strict=True):
            parts.append(f'<text x="{x + PAD}" y="{y + CELL_H - 6}">{esc(value)}</text>')
            x += w
        for col, cx, w in zip(m.columns, xs, col_w, strict=True):
            parts.append(_heat_cell(m, row, col, cx, y, w - 2))
    parts.append("</svg>")
    return "".join(parts)


def _heat_cell(m: MatrixView, row: tuple[str, ...], col: str, x: float, y: float, w: float) -> str:
    cell = m.cells.get((row, col))
    if cell is None:
        return (f'<rect x="{x}" y="{y}" width="{w}" height="{CELL_H - 2}" fill="#fff" stroke="#e0e0e0">'
                "<title>no test covers this cell</title></rect>")
    fill, ink = COLOURS[cell.outcome], "#000" if cell.outcome in DARK_TEXT else "#fff"
    return (f'<g class="cell" data-outcome="{esc(cell.outcome)}">'
            f'<rect x="{x}" y="{y}" width="{w}" height="{CELL_H - 2}" fill="{fill}">'
            f"{_cell_title(m, row, col, cell.cases, cell.outcome)}</rect>"
            f'<text x="{x + w / 2}" y="{y + CELL_H - 6}" text-anchor="middle" fill="{ink}" '
            f'pointer-events="none">{esc(cell.label)}</text></g>')


def legend() -> str:
    items = "".join(f'<span><i style="background:{c}"></i>{esc(o)}</span>' for o, c in COLOURS.items())
    return f'<p class="legend">{items}</p>'


def suite_bars(groups: dict[str, list[TestCase]]) -> str:
    """One stacked bar per suite, segments proportional to its outcome counts."""
    label_w, bar_w = _text_width(list(groups)) + 60, 600
    height = CELL_H * len(groups) + 4
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="suite-bars" width="{label_w + bar_w + 4}" '
             f'height="{height}" role="img" aria-label="outcomes per suite">']
    for i, (suite, cases) in enumerate(groups.items()):
        y = i * CELL_H
        counts = Counts.of(cases)
        parts.append(f'<text x="0" y="{y + CELL_H - 6}">{esc(suite)} ({counts.total})</text>')
        x = float(label_w)
        for outcome, n in zip(OUTCOMES, (getattr(counts, o.replace(" ", "_")) for o in OUTCOMES), strict=True):
            if n:
                w = bar_w * n / counts.total
                parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{CELL_H - 4}" '
                             f'fill="{COLOURS[outcome]}">{_title([f"{suite}: {n} {outcome}"])}</rect>')
                x += w
    parts.append("</svg>")
    return "".join(parts)


def _chart(block: doc.Chart, rep: Report) -> list[str]:
    if block.kind == "golden_plot":
        return [plots.golden_svg(block.data)]
    return [legend(), heatmap(rep.matrix) if block.kind == "heatmap" else suite_bars(rep.by("suite"))]


def render_blocks(blocks: list[doc.Block], rep: Report) -> list[str]:
    out: list[str] = []
    for block in blocks:
        if isinstance(block, doc.Heading):
            cls = ""
            if block.text.startswith("Verdict: "):
                cls = f' class="{"PASS" if rep.passed else "FAIL"}"'
            out.append(f"<h{block.level}{cls}>{esc(block.text)}</h{block.level}>")
        elif isinstance(block, doc.Para):
            out.append(f"<p>{inline(block.text)}</p>")
        elif isinstance(block, doc.Bullets):
            out.append("<ul>" + "".join(f"<li>{inline(i)}</li>" for i in block.items) + "</ul>")
        elif isinstance(block, doc.Table):
            out.append(table(block))
        elif isinstance(block, doc.Details):
            out.append(f"<details><summary>{esc(block.summary)}</summary>"
                       + "".join(render_blocks(block.blocks, rep)) + "</details>")
        elif isinstance(block, doc.Chart):
            out += _chart(block, rep)
            if block.fallback:  # the same data as text, folded: the picture already shows it
                out += render_blocks([doc.Details("The same as a table", block.fallback)], rep)
    return out


def render(rep: Report) -> str:
    body = "\n".join(render_blocks(outline.blocks(rep), rep))
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(rep.title)}</title>'
            f"<style>{CSS}</style></head><body><h1>{esc(rep.title)}</h1>\n{body}\n</body></html>\n")
