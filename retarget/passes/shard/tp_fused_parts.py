"""Fused parts a graph cuts from a Linear's output, for the tensor-parallel chain walk.

`tp_chains` records each cut of a Linear's output along the split dim (a slice, an unequal
split, an index with a constant run of positions) as a feature range and whether the part is
split or kept whole; `fuse_cuts` turns a chain's cuts into the Linear's fused parts once the walk
is over: equal split parts (`Chain.fused`), or parts of unequal widths (`Chain.parts`, with
`Chain.whole_parts`), or a break naming the spans when they do not tile the output once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx


def fuse_cuts(
    chain: Any, path: str, spans: list[tuple[int, int, bool]], features: int, size: int
) -> None:
    """Cuts that tile the Linear's output (of `features`) are its fused parts, recorded on
    `chain` (a tp_chains.Chain): equal split ones as `fused`, others as `parts` (with
    `whole_parts`, those kept whole); otherwise a break."""
    ends = [0] + [stop for _, stop, _ in spans]
    tiled = all(start == end for (start, _, _), end in zip(spans, ends, strict=False))
    if not tiled or ends[-1] != features or path in chain.fused:
        chain.breaks.append(
            f"the graph cuts {path}'s {features} output features into "
            f"{[(a, b) for a, b, _ in spans]}, which are not parts that cover them once each"
        )
        return
    widths = tuple(stop - start for start, stop, _ in spans)
    whole = tuple(i for i, (_, _, split) in enumerate(spans) if not split)
    uneven = [w for i, w in enumerate(widths) if w % size and i not in whole]
    if uneven:
        chain.breaks.append(
            f"{path}'s output is cut into parts of {list(widths)} features, and {uneven[0]} "
            f"does not divide by {size}"
        )
    elif len(set(widths)) == 1 and not whole:
        chain.fused[path] = len(widths)
    else:
        chain.parts[path] = widths
        if whole:
            chain.whole_parts[path] = whole


def lifted_constant(gm: fx.GraphModule, node: Any) -> torch.Tensor | None:
    """The value of a constant export lifted (`lift_fresh_copy` of a graph attribute)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.all_input_nodes:
        if node.target not in (torch.ops.aten.lift_fresh_copy.default,):
            return None
        node = node.all_input_nodes[0]
    if isinstance(node, fx.Node) and node.op == "get_attr":
        value = getattr(gm, str(node.target), None)
        return value if isinstance(value, torch.Tensor) else None
    return None
