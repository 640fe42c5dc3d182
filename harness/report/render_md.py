"""The sign-off as Markdown (``report.md``); a drifting golden cell's plot is an SVG file next to it
(``golden-plots/``, written by ``harness-signoff``) that the page shows as an image."""

from __future__ import annotations

import re

from harness.report import document as doc
from harness.report import outline, plots
from harness.report.sections import Report

PLOT_DIR = "golden-plots"


def cell(value: object) -> str:
    """A table cell: code in backticks, pipes and newlines made safe."""
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if isinstance(value, doc.Code) and text else text


def table(t: doc.Table) -> list[str]:
    lines = ["| " + " | ".join(t.headers) + " |", "|" + "---|" * len(t.headers)]
    lines.extend("| " + " | ".join(cell(c) for c in row) + " |" for row in t.rows)
    return lines


def plot_path(chart: doc.Chart) -> str:
    """Where a golden plot's SVG goes, relative to the Markdown file."""
    g = chart.data
    return f"{PLOT_DIR}/" + re.sub(r"[^A-Za-z0-9._-]+", "_", f"{g.case.run}-{g.cell}") + ".svg"


def _charts(blocks: list[doc.Block]) -> list[doc.Chart]:
    out: list[doc.Chart] = []
    for block in blocks:
        if isinstance(block, doc.Chart):
            out.append(block)
        elif isinstance(block, doc.Details):
            out += _charts(block.blocks)
    return out


def assets(rep: Report) -> dict[str, str]:
    """The image files the Markdown links to: relative path -> SVG text."""
    return {plot_path(c): plots.golden_svg(c.data) for c in _charts(outline.blocks(rep)) if c.kind == "golden_plot"}


def render_blocks(blocks: list[doc.Block], with_assets: bool = False) -> list[str]:
    lines: list[str] = []
    for block in blocks:
        if isinstance(block, doc.Heading):
            lines += ["#" * block.level + " " + block.text, ""]
        elif isinstance(block, doc.Para):
            lines += [block.text, ""]
        elif isinstance(block, doc.Bullets):
            lines += [f"- {item}" for item in block.items] + [""]
        elif isinstance(block, doc.Table):
            lines += table(block) + [""]
        elif isinstance(block, doc.Chart):
            if block.kind == "golden_plot" and with_assets:
                lines += [f"![{block.data.cell}: run over golden, relative drift per step]({plot_path(block)})", ""]
            lines += render_blocks(block.fallback, with_assets)  # the picture's data, flat
        elif isinstance(block, doc.Details):
            lines += [f"<details><summary>{block.summary}</summary>", ""]
            lines += render_blocks(block.blocks, with_assets) + ["</details>", ""]
    return lines


def render(rep: Report, with_assets: bool = False) -> str:
    """The Markdown page: the matrix's table stands in for its heat map; golden plots are image links
    to ``assets(rep)`` when ``with_assets`` (the caller writes them next to the page)."""
    lines = [f"# {rep.title}", "", *render_blocks(outline.blocks(rep), with_assets)]
    return "\n".join(lines).rstrip() + "\n"
