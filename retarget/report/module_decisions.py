"""What compile_for decided for each module of the tree: a region repeat, inside one, or glue.

>>> for row in module_rows(compiled.program):
...     print("  " * row.depth + (row.path or "<root>"), row.decision)
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from retarget.ir.program import Program
from retarget.ir.region import Region

REPEAT, INSIDE, GLUE = "region", "inside region", "eager glue"


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
        decision = f"{region.name} repeat {index + 1}/{region.repeats} ({how_captured(region)})"
        return REPEAT, region, decision
    if enclosing is not None:
        return INSIDE, enclosing, f"inside {enclosing.name}"
    return GLUE, None, GLUE


def how_captured(region: Region) -> str:
    """How a region runs, briefly: "export graph", "captured at first call", "eager: ..."."""
    if region.deferred and region.recaptured:  # capture="auto" under tp: execution/tp_regions.py
        return "own forward: split by tp, no pass rewrites or compiles its graph"
    if region.deferred:
        return "own forward: no pass rewrites its graph"
    if region.eager_only and region.reason and not region.failures:
        return f"eager: {region.reason}"  # made eager on purpose (shard_tp), not a failed capture
    if region.eager_only:
        return "eager: no frontend captured it"
    if region.representative() is None:
        return "captured at first call"
    return f"{region.frontend} graph" + ("" if region.shared else ", one per repeat")
