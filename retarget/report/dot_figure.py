"""The module tree and the region graphs as one Graphviz figure: DOT text, laid out to SVG.

Modules are colored by role (region repeat, inside a region, eager glue); each region's graph
is a cluster whose nodes added or changed by a pass after capture are highlighted.

    >>> Path("m.dot").write_text(render_dot(compiled.program))
    >>> Path("m.svg").write_text(render_svg(render_dot(compiled.program)))   # needs graphviz
"""

from __future__ import annotations

import shutil
import subprocess

import torch
from torch import fx

from retarget.ir.program import Program
from retarget.ir.region import Region
from retarget.report.graph_history import Change, node_changes, region_stages
from retarget.report.module_decisions import GLUE, INSIDE, REPEAT, how_captured, module_rows

#: Graph nodes drawn per region before the rest is folded into one "... N more" node.
GRAPH_NODE_CAP = 400
#: The figure is scaled down to fit this (inches: a screen), never up.
FIGURE_SIZE = "14,9"
#: Nodes that check a capture's inputs and compute nothing (torch.export's guards and metadata
#: asserts): left out of the drawing, counted in the region's title.
CHECK_TARGETS = frozenset({"_guards_fn", "_assert_tensor_metadata", "_assert_scalar"})

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


def program_title(program: Program) -> str:
    """The model's class and the target: the title of the figure and of the HTML page."""
    return f"{type(program.original).__name__} for target {program.target}"


def render_dot(program: Program, max_nodes: int = GRAPH_NODE_CAP) -> str:
    """Graphviz DOT: the module tree colored by role, and one cluster per region's graph."""
    title = _q(program_title(program))
    lines = [
        "digraph retarget {",
        f"  graph [compound=true, labelloc=t, fontname=Helvetica, label={title}, "
        f'size="{FIGURE_SIZE}", ratio=compress];',
        '  node [fontname=Helvetica, fontsize=10, shape=box, style="rounded,filled"];',
        "  edge [arrowsize=0.6];",
        *_dot_tree(program, max_nodes),
    ]
    stages = region_stages(program)
    for index, region in enumerate(program.regions):
        checkpointed = _checkpointed(program, region)
        lines += _dot_region(index, region, stages.get(region.name, []), max_nodes, checkpointed)
    lines += _dot_legend()
    return "\n".join([*lines, "}"]) + "\n"


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
        policy = _checkpoint_policy(program, row.path)
        label += f"\nac: {policy}" if policy else ""
        attrs = f"label={_q(label)}, fillcolor={_q(ROLE_COLORS[row.role])}"
        attrs += ', penwidth=3, color="#6a3d9a"' if policy else ""
        lines.append(f"    {_q('mod:' + row.path)} [{attrs}, tooltip={_q(row.decision)}];")
        parent = row.path.rpartition(".")[0]
        if row.path and parent in shown:
            lines.append(f"    {_q('mod:' + parent)} -> {_q('mod:' + row.path)};")
    if len(rows) > max_nodes:
        lines.append(f'    "mod:..." [label="... {len(rows) - max_nodes} more", shape=plain];')
    return [*lines, "  }"]


def _dot_region(
    index: int, region: Region, stages: list, max_nodes: int, checkpointed: str = ""
) -> list[str]:
    cluster = f"cluster_region_{index}"
    title = f"region {region.name}\n{region.block_type} x{region.repeats}, {how_captured(region)}"
    title += f"\n{checkpointed}" if checkpointed else ""
    captured = region.representative()
    if captured is None:
        lines = [f"  subgraph {cluster} {{", f'    label={_q(title)}; style="rounded,dashed";']
        lines.append(f'    "r{index}:none" [label={_q(how_captured(region))}, shape=note];')
        return [*lines, "  }"]
    every = list(captured.gm.graph.nodes)
    nodes = [n for n in every if not is_check(n)]
    if len(nodes) < len(every):
        title += f"\n({len(every) - len(nodes)} input checks not drawn)"
    lines = [f"  subgraph {cluster} {{", f'    label={_q(title)}; style="rounded,dashed";']
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


def is_check(node: fx.Node) -> bool:
    """A node that checks the capture's inputs and computes nothing drawn."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return node.op in ("call_module", "call_function") and (
        name in CHECK_TARGETS or name.removesuffix(".default") in CHECK_TARGETS
    )


def _checkpoint_policy(program: Program, path: str) -> str:
    plan = (program.analysis.checkpoint or {}).get("plan", {})
    policy = plan.get(path, "none")
    return "" if policy == "none" else policy


def _checkpointed(program: Program, region: Region) -> str:
    """`ac: 2 of 2 repeats (full)`: which repeats of the region recompute in backward."""
    policies = [_checkpoint_policy(program, path) for path in region.paths]
    chosen = [p for p in policies if p]
    if not chosen:
        return ""
    kinds = ", ".join(sorted(set(chosen)))
    return f"ac: {len(chosen)} of {len(policies)} repeats ({kinds})"


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
