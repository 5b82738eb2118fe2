"""Render what compile_for did: text, JSON, graphviz DOT / SVG, and one self-contained HTML page.

Every renderer takes the Program (`compiled.program`) and returns a string:

    print(render_text(compiled.program))        # report, per-module decisions, region graphs
    Path("m.html").write_text(render_html(compiled.program))

Region graphs are shown as they evolved: the pass history records each region's graph code
after every pass that changed the program, so a region's "stages" are the passes that changed
its code, in order (capture_regions first). Text and HTML show the final code in full and a
unified diff per later stage; DOT highlights the nodes that later passes added or changed.
"""

from __future__ import annotations

import difflib
import html
import json
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from itertools import pairwise

import networkx as nx
import torch
from torch import fx

from retarget.ir.program import Program
from retarget.ir.region import Region
from retarget.report.summary import Report

#: Graph nodes drawn per region before the rest is folded into one "... N more" node.
GRAPH_NODE_CAP = 400
#: A region's graph code as it is now, when no pass record holds that text (lazy captures).
NOW = "(now)"

REPEAT, INSIDE, GLUE = "region", "inside region", "eager glue"
ROLE_COLORS = {REPEAT: "#7fb3e6", INSIDE: "#d6e6f5", GLUE: "#f2e6c9"}
#: Graph node (shape, fill) by fx op.
OP_STYLES = {
    "placeholder": ("invhouse", "#d9f2d9"),
    "get_attr": ("cylinder", "#fff2cc"),
    "call_function": ("box", "#ffffff"),
    "call_method": ("box", "#ffffff"),
    "call_module": ("component", "#e6e6ff"),
    "output": ("house", "#d9f2d9"),
}
#: Highlight (fill, border, marker) of nodes that a pass after capture added or changed.
CHANGE_STYLES = {"added": ("#ff9e9e", "#c00000", "+"), "changed": ("#ffd27f", "#b36b00", "~")}
GRAPHVIZ_HINT = (
    "graphviz 'dot' is not on PATH: install graphviz (apt-get install graphviz, or "
    "brew install graphviz), or use --format dot / --format html"
)


class GraphvizError(RuntimeError):
    """`dot` failed to lay out the graph."""


class GraphvizNotFound(GraphvizError):
    """`dot` is not installed."""


@dataclass(frozen=True)
class Change:
    """How a graph node differs from its captured form, and the last pass that touched it."""

    kind: str  # "added" or "changed"
    pass_name: str


@dataclass(frozen=True)
class ModuleRow:
    """One module of the tree and what compile_for decided for it."""

    path: str
    depth: int
    cls: str
    params: int
    role: str  # REPEAT, INSIDE or GLUE
    region: str
    decision: str
    folded: int = 0  # submodules not listed: they repeat the first repeat's


# ------------------------------------------------------------------------- graph history
def region_stages(program: Program) -> dict[str, list[tuple[str, str]]]:
    """Per region, `(pass name, graph code)` for each pass that changed the region's code."""
    stages: dict[str, list[tuple[str, str]]] = {}
    for record in program.history:
        for region, code in record.graphs.items():
            seen = stages.setdefault(region, [])
            if not seen or seen[-1][1] != code:
                seen.append((record.name, code))
    for region, code in program.graph_text().items():
        seen = stages.setdefault(region, [])
        if not seen or seen[-1][1] != code:
            seen.append((NOW, code))
    return stages


def code_statements(code: str) -> dict[str, str]:
    """Map each value defined in fx graph code to the text that computes it.

    fx writes one statement per node (`name = op(args);  dead = None`), inputs in the
    `def forward(...)` line and the output as `return ...`; the `= None` tail only frees
    memory, so it is dropped (it moves whenever a later use is added).
    """
    statements: dict[str, str] = {}
    for line in code.splitlines():
        line = line.strip()
        if line.startswith("def forward(") and line.endswith(":"):
            for name in line[len("def forward(") : -2].split(","):
                name = name.split(":")[0].split("=")[0].strip(" *")
                if name and name != "self":
                    statements[name] = "<input>"
        elif line.startswith("return "):
            statements["output"] = line[len("return ") :]
        elif match := re.match(r"([A-Za-z_][\w, ]*?),? = (.*)", line):
            rhs = match.group(2).split(";  ")[0]
            for name in match.group(1).split(","):
                statements[name.strip()] = rhs
    return statements


def node_changes(stages: list[tuple[str, str]]) -> dict[str, Change]:
    """Nodes of the last stage that a pass after the first stage (the capture) added or changed.

    >>> node_changes([("capture_regions", before), ("insert_cast", after)])["to_1"]
    Change(kind='added', pass_name='insert_cast')
    """
    if not stages:
        return {}
    first = previous = code_statements(stages[0][1])
    touched_by: dict[str, str] = {}
    for pass_name, code in stages[1:]:
        current = code_statements(code)
        touched_by.update((n, pass_name) for n, t in current.items() if previous.get(n) != t)
        previous = current
    return {
        name: Change("added" if name not in first else "changed", touched_by[name])
        for name, text in previous.items()
        if first.get(name) != text
    }


def graph_diff(before: str, after: str, before_label: str, after_label: str) -> str:
    """Unified diff of two graph codes (empty when they are equal)."""
    lines = difflib.unified_diff(
        before.splitlines(), after.splitlines(), before_label, after_label, lineterm=""
    )
    return "\n".join(lines)


def _stage_diffs(stages: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(pass name, diff against the previous stage) for every stage after the capture."""
    return [
        (name, graph_diff(before, after, f"after {previous}", f"after {name}"))
        for (previous, before), (name, after) in pairwise(stages)
    ]


# ------------------------------------------------------------------------- module decisions
def module_rows(program: Program) -> list[ModuleRow]:
    """The module tree in depth-first order, each module with its region or "eager glue".

    Below the second and later repeats of a shared region only a count is kept: they run the
    first repeat's graph, so listing their submodules again says nothing new.
    """
    owners = {path: (r, i) for r in program.regions for i, path in enumerate(r.paths)}
    rows: list[ModuleRow] = []
    stack: list[tuple[str, int, Region | None]] = [("", 0, None)] if "" in program.tree else []
    while stack:
        path, depth, enclosing = stack.pop()
        attrs = program.tree.nodes[path]
        role, region, decision = _decide(path, owners, enclosing)
        children = list(program.tree.successors(path))
        folded = 0
        if role == REPEAT and owners[path][1] > 0 and region.shared:
            folded, children = len(nx.descendants(program.tree, path)), []
        name = region.name if region else ""
        rows.append(
            ModuleRow(
                path, depth, attrs["cls"], attrs["total_params"], role, name, decision, folded
            )
        )
        stack.extend((child, depth + 1, region) for child in reversed(children))
    return rows


def _decide(path: str, owners: dict, enclosing: Region | None) -> tuple[str, Region | None, str]:
    if path in owners:
        region, index = owners[path]
        return REPEAT, region, f"{region.name} repeat {index + 1}/{region.repeats} ({_how(region)})"
    if enclosing is not None:
        return INSIDE, enclosing, f"inside {enclosing.name}"
    return GLUE, None, GLUE


def _how(region: Region) -> str:
    if region.eager_only:
        return "eager: no frontend captured it"
    if region.representative() is None:
        return "captured at first call"
    return f"{region.frontend} graph" + ("" if region.shared else ", one per repeat")


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
            lines.append(f"  no graph ({_how(region)})")
            lines += [f"  {frontend}: {why}" for frontend, why in region.failures]
            continue
        lines.append("changed by: " + ", ".join(name for name, _ in history))
        for name, diff in _stage_diffs(history):
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


# ------------------------------------------------------------------------- DOT and SVG
def render_dot(program: Program, max_nodes: int = GRAPH_NODE_CAP) -> str:
    """Graphviz DOT: the module tree colored by role, and one cluster per region's graph."""
    lines = [
        "digraph retarget {",
        f"  graph [compound=true, labelloc=t, fontname=Helvetica, label={_q(_title(program))}];",
        '  node [fontname=Helvetica, fontsize=10, shape=box, style="rounded,filled"];',
        "  edge [arrowsize=0.6];",
        *_dot_tree(program, max_nodes),
    ]
    stages = region_stages(program)
    for index, region in enumerate(program.regions):
        lines += _dot_region(index, region, stages.get(region.name, []), max_nodes)
    lines += _dot_legend()
    return "\n".join([*lines, "}"]) + "\n"


def _title(program: Program) -> str:
    return f"{type(program.original).__name__} for target {program.target}"


def _q(text: str) -> str:
    """A DOT quoted string (newlines become centred line breaks)."""
    escaped = str(text).replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n") + '"'


def _dot_tree(program: Program, max_nodes: int) -> list[str]:
    lines = ["  subgraph cluster_modules {", '    label="module tree"; style=rounded;']
    rows = module_rows(program)
    shown = {row.path for row in rows[:max_nodes]}
    for row in rows[:max_nodes]:
        label = f"{row.path.rpartition('.')[2] or '<root>'}\n{row.cls}\n{row.params:,} params"
        label += f"\n+{row.folded} submodules as repeat 1" if row.folded else ""
        attrs = f"label={_q(label)}, fillcolor={_q(ROLE_COLORS[row.role])}"
        lines.append(f"    {_q('mod:' + row.path)} [{attrs}, tooltip={_q(row.decision)}];")
        parent = row.path.rpartition(".")[0]
        if row.path and parent in shown:
            lines.append(f"    {_q('mod:' + parent)} -> {_q('mod:' + row.path)};")
    if len(rows) > max_nodes:
        lines.append(f'    "mod:..." [label="... {len(rows) - max_nodes} more", shape=plain];')
    return [*lines, "  }"]


def _dot_region(index: int, region: Region, stages: list, max_nodes: int) -> list[str]:
    cluster = f"cluster_region_{index}"
    title = f"region {region.name}\n{region.block_type} x{region.repeats}, {_how(region)}"
    lines = [f"  subgraph {cluster} {{", f'    label={_q(title)}; style="rounded,dashed";']
    captured = region.representative()
    if captured is None:
        lines.append(f'    "r{index}:none" [label={_q(_how(region))}, shape=note];')
        return [*lines, "  }"]
    nodes = list(captured.gm.graph.nodes)
    shown = nodes[:max_nodes]
    changes = node_changes(stages)
    lines += [
        f"    {_q(f'r{index}:{n.name}')} [{_node_attrs(n, changes.get(n.name))}];" for n in shown
    ]
    names = {n.name for n in shown}
    for node in shown:
        for source in node.all_input_nodes:
            if source.name in names:
                lines.append(
                    f"    {_q(f'r{index}:{source.name}')} -> {_q(f'r{index}:{node.name}')};"
                )
    if len(nodes) > max_nodes:
        more = _q(f"r{index}:...")
        lines.append(f'    {more} [label="... {len(nodes) - max_nodes} more", shape=plain];')
    # Ties each repeat's module to the graph that computes it, without moving the layout.
    link = f"{_q('mod:' + region.paths[0])} -> {_q(f'r{index}:{nodes[0].name}')}"
    return [*lines, "  }", f"  {link} [lhead={cluster}, style=dashed, constraint=false];"]


def _node_attrs(node: fx.Node, change: Change | None) -> str:
    shape, fill = OP_STYLES.get(node.op, ("box", "#ffffff"))
    label = _short_target(node)
    if node.meta.get("shape") is not None:
        label += "\n" + "x".join(str(d) for d in node.meta["shape"])
    attrs = f"shape={shape}, tooltip={_q(node.name)}"
    if change is not None:
        fill, border, marker = CHANGE_STYLES[change.kind]
        label += f"\n{marker} {change.pass_name}"
        attrs += f", color={_q(border)}, penwidth=2.5"
    return f"label={_q(label)}, fillcolor={_q(fill)}, {attrs}"


def _short_target(node: fx.Node) -> str:
    """`linear`, `add.Tensor`, `self_attn.q_proj.weight`: what a node computes, briefly."""
    target = node.target
    if node.op in ("placeholder", "output"):
        return node.name
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return target.__name__.removesuffix(".default")
    return getattr(target, "__name__", str(target))


def _dot_legend() -> list[str]:
    lines = ["  subgraph cluster_legend {", '    label="legend"; style=rounded;']
    entries = [(role, color) for role, color in ROLE_COLORS.items()]
    entries += [(f"{kind} by a pass after capture", s[0]) for kind, s in CHANGE_STYLES.items()]
    for index, (text, color) in enumerate(entries):
        lines.append(f'    "legend:{index}" [label={_q(text)}, fillcolor={_q(color)}];')
    return [*lines, "  }"]


def require_graphviz() -> str:
    """The path of graphviz's `dot`; GraphvizNotFound (saying how to install it) without it."""
    dot = shutil.which("dot")
    if dot is None:
        raise GraphvizNotFound(GRAPHVIZ_HINT)
    return dot


def render_svg(dot_text: str, timeout: float = 120.0) -> str:
    """Lay out DOT text with `dot -Tsvg`."""
    try:
        done = subprocess.run(
            [require_graphviz(), "-Tsvg"],
            input=dot_text,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise GraphvizError(f"dot took more than {timeout:.0f} s") from exc
    if done.returncode != 0:
        raise GraphvizError(f"dot failed ({done.returncode}): {done.stderr.strip()[:500]}")
    return done.stdout


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
        f"<h1>retarget inspect: {html.escape(_title(program))}</h1>",
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
        parts.append(f"<h3>region {html.escape(region.name)} ({html.escape(_how(region))})</h3>")
        history = stages.get(region.name, [])
        for name, diff in _stage_diffs(history):
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
