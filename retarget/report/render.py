"""Render what compile_for did: text, JSON, graphviz DOT / SVG, and one self-contained HTML page.

Every renderer takes the Program (`compiled.program`) and returns a string:

    print(render_text(compiled.program))        # report, per-module decisions, region graphs
    Path("m.html").write_text(render_html(compiled.program))

Region graphs are shown as they evolved (graph_history.py): text and HTML show the final code in
full and a unified diff per later stage; the DOT figure (dot_figure.py) highlights the nodes that
later passes added or changed. `render` picks one of FORMATS, as `retarget inspect` does.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict

from retarget.ir.program import Program
from retarget.report.dot_figure import (
    GRAPH_NODE_CAP,
    GraphvizError,
    GraphvizNotFound,
    program_title,
    render_dot,
    render_svg,
    require_graphviz,
)
from retarget.report.graph_history import region_stages, stage_diffs
from retarget.report.module_decisions import how_captured, module_rows
from retarget.report.summary import Report

# What `retarget inspect` needs, graphviz's errors and check included, from one module.
__all__ = [
    "FORMATS",
    "GRAPH_NODE_CAP",
    "GraphvizError",
    "GraphvizNotFound",
    "render",
    "render_dot",
    "render_html",
    "render_json",
    "render_svg",
    "render_text",
    "require_graphviz",
]

#: The formats `render` writes.
FORMATS = ("text", "json", "dot", "svg", "html")


def render(program: Program, fmt: str, *, max_nodes: int = GRAPH_NODE_CAP) -> str:
    """`program` in one of FORMATS; `max_nodes` caps each region's drawn graph (dot/svg/html)."""
    if fmt == "text":
        return render_text(program)
    if fmt == "json":
        return render_json(program)
    dot_text = render_dot(program, max_nodes)
    if fmt == "dot":
        return dot_text
    if fmt == "svg":
        return render_svg(dot_text)
    if fmt == "html":
        return render_html(program, dot_text)
    raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")


# ------------------------------------------------------------------------- text and JSON
def render_text(program: Program) -> str:
    """The report, the per-module decisions and every region's graph with its pass diffs."""
    parts = [str(Report(program)), "", "module decisions", *_modules_text(program), ""]
    parts += ["region graphs", *_regions_text(program)]
    return "\n".join(parts) + "\n"


def _modules_text(program: Program) -> list[str]:
    rows = [("module", "class", "params", "decision")]
    for row in module_rows(program):
        decision = row.decision + (f"; {row.folded} submodules as repeat 1" if row.folded else "")
        rows.append(
            ("  " * row.depth + (row.path or "<root>"), row.cls, f"{row.params:,}", decision)
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _regions_text(program: Program) -> list[str]:
    if not program.regions:
        return [f"  no regions (capture={program.capture!r}): the whole model runs eagerly"]
    stages = region_stages(program)
    lines: list[str] = []
    for region in program.regions:
        lines += ["", f"=== region {region.name}: {region.block_type} x{region.repeats} ==="]
        history = stages.get(region.name, [])
        if not history:
            lines.append(f"  no graph ({how_captured(region)})")
            lines += [f"  {frontend}: {why}" for frontend, why in region.failures]
            continue
        lines.append("changed by: " + ", ".join(name for name, _ in history))
        for name, diff in stage_diffs(history):
            lines += [f"--- diff by {name}", diff or "(no textual change)"]
        lines += [f"--- final graph (after {history[-1][0]})", history[-1][1]]
    return lines


def render_json(program: Program) -> str:
    """`Report.to_dict()` plus the region graph code now and after each pass, and the tree."""
    data = Report(program).to_dict()
    data["graphs"] = program.graph_text()
    data["history_graphs"] = {record.name: dict(record.graphs) for record in program.history}
    data["module_tree"] = [asdict(row) for row in module_rows(program)]
    return json.dumps(data, indent=2, default=str) + "\n"


# ------------------------------------------------------------------------- HTML
_CSS = """body{font-family:Helvetica,Arial,sans-serif;margin:2em;max-width:100%}
pre{background:#f6f8fa;padding:1em;overflow:auto;font-size:12px}
.add{color:#116329;background:#dafbe1}.del{color:#82071e;background:#ffebe9}
.note{color:#7a4d00}.figure{overflow:auto;border:1px solid #ddd}"""


def render_html(program: Program, dot_text: str | None = None) -> str:
    """One self-contained page: report, module decisions, the SVG (or DOT) and graph diffs.

    The figure is `dot_text` (by default `render_dot(program)`) laid out by graphviz, or the DOT
    text itself with a note when graphviz is missing or fails.
    """
    body = [
        f"<h1>retarget inspect: {html.escape(program_title(program))}</h1>",
        "<h2>report</h2>",
        f"<pre>{html.escape(str(Report(program)))}</pre>",
        "<h2>module tree and region graphs</h2>",
        _html_figure(dot_text or render_dot(program)),
        "<h2>module decisions</h2>",
        f"<pre>{html.escape(chr(10).join(_modules_text(program)))}</pre>",
        "<h2>region graphs</h2>",
        *_html_regions(program),
    ]
    head = f"<meta charset='utf-8'><title>retarget inspect</title><style>{_CSS}</style>"
    return (
        f"<!DOCTYPE html>\n<html><head>{head}</head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _html_figure(dot_text: str) -> str:
    try:
        svg = render_svg(dot_text)
    except GraphvizError as exc:
        note = f"<p class='note'>{html.escape(str(exc))}; the DOT source follows.</p>"
        return f"{note}<pre>{html.escape(dot_text)}</pre>"
    # The XML prolog and doctype are not allowed inside an HTML document; the <svg> element is.
    return f"<div class='figure'>{svg[svg.find('<svg') :]}</div>"


def _html_regions(program: Program) -> list[str]:
    stages = region_stages(program)
    parts: list[str] = []
    for region in program.regions:
        title = f"region {html.escape(region.name)} ({html.escape(how_captured(region))})"
        parts.append(f"<h3>{title}</h3>")
        history = stages.get(region.name, [])
        for name, diff in stage_diffs(history):
            parts += [f"<h4>diff by {html.escape(name)}</h4>", f"<pre>{_html_diff(diff)}</pre>"]
        if history:
            parts.append(f"<h4>final graph (after {html.escape(history[-1][0])})</h4>")
            parts.append(f"<pre>{html.escape(history[-1][1])}</pre>")
    return parts or ["<p>no regions: the whole model runs eagerly</p>"]


def _html_diff(diff: str) -> str:
    lines = []
    for line in diff.splitlines():
        kind = "add" if line.startswith("+") else "del" if line.startswith("-") else ""
        text = html.escape(line)
        lines.append(f"<span class='{kind}'>{text}</span>" if kind else text)
    return "\n".join(lines)
