"""How each region's graph code evolved, pass by pass: the stages, their diffs, changed nodes.

The pass history records each region's graph code after every pass that changed the program,
so a region's "stages" are the passes that changed its code, in order (capture_regions first).
The renderers show the final code and a unified diff per later stage, and highlight the nodes
that later passes added or changed.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from itertools import pairwise

from retarget.ir.program import Program

#: A region's graph code as it is now, when no pass record holds that text (lazy captures).
NOW = "(now)"


@dataclass(frozen=True)
class Change:
    """How a graph node differs from its captured form, and the last pass that touched it."""

    kind: str  # "added" or "changed"
    pass_name: str


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


def stage_diffs(stages: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(pass name, diff against the previous stage) for every stage after the capture."""
    return [
        (name, graph_diff(before, after, f"after {previous}", f"after {name}"))
        for (previous, before), (name, after) in pairwise(stages)
    ]
