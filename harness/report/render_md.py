"""The sign-off as Markdown (``report.md``)."""

from __future__ import annotations

from harness.report import document as doc
from harness.report.sections import Report


def cell(value: object) -> str:
    """A table cell: code in backticks, pipes and newlines made safe."""
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if isinstance(value, doc.Code) and text else text


def table(t: doc.Table) -> list[str]:
    lines = ["| " + " | ".join(t.headers) + " |", "|" + "---|" * len(t.headers)]
    lines.extend("| " + " | ".join(cell(c) for c in row) + " |" for row in t.rows)
    return lines


def render_blocks(blocks: list[doc.Block]) -> list[str]:
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
            lines += render_blocks(block.fallback)  # the picture is HTML-only; its data, flat
        elif isinstance(block, doc.Details):
            lines += [f"<details><summary>{block.summary}</summary>", ""]
            lines += render_blocks(block.blocks) + ["</details>", ""]
    return lines


def render(rep: Report) -> str:
    """The Markdown page (charts are HTML-only; the matrix's table stands in for its heat map)."""
    lines = [f"# {rep.title}", "", *render_blocks(doc.blocks(rep))]
    return "\n".join(lines).rstrip() + "\n"
