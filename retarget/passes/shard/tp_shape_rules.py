"""Layout rules of the ops that only move or cut a tensor (views, transposes, slices, splits).

The sharded dim is followed through each: kept, renumbered, split into heads (the outer part
must divide by the degree), merged with inner dims. An equal split of it is a fused projection
(q|k|v); slices of it and a split into unequal parts are recorded as cuts, which tp_chains
accepts as the parts of a fused projection when they tile its output (Phi3's qkv under GQA) and
breaks the chain otherwise. A select of one index breaks it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from retarget.passes.shard.tp_layout import Break, Sharded, Tracked, wrap_dim

aten = torch.ops.aten


def reshape(t: Tracked) -> Sharded:
    """Follow the sharded dim through a view: kept, split into heads, or merged with inner dims.

    The sharded dim (width w, after the dims whose product is `outer`) stays the outermost factor
    of the view's dim j with the same outer product, of size n: each rank's block of w is then
    a contiguous block of n, whole in every inner dim, when n is a multiple of w (w merged with
    inner sizes, as CodeGen's [.., 4 groups, 256] -> [.., 16 heads, 64]) or a divisor of w that
    the degree divides (w split into n heads). Any other view mixes ranks' elements.
    """
    value, layout = t.source()
    before, after = t.shapes(value), t.shapes(t.node)
    outer, width = math.prod(before[: layout.dim]), before[layout.dim]
    index = next(
        (
            j
            for j in range(len(after))
            if math.prod(after[:j]) == outer and (after[j] != 1 or width == 1)
        ),
        None,
    )
    if index is None:
        raise Break(f"the view to {list(after)} merges the sharded dim into an outer one")
    new = after[index]
    if new % width == 0:
        return Sharded(index, layout.group)
    if width % new == 0:
        if new % t.size:
            raise Break(
                f"the view splits the sharded width {width} into {new} heads of {width // new}, "
                f"and {new} heads do not divide by {t.size}"
            )
        return Sharded(index, layout.group)
    raise Break(f"the view to {list(after)} mixes the sharded dim with others")


def transpose(t: Tracked) -> Sharded:
    value, layout = t.source()
    rank = len(t.shapes(value))
    a, b = wrap_dim(t.node.args[1], rank), wrap_dim(t.node.args[2], rank)
    dim = b if layout.dim == a else a if layout.dim == b else layout.dim
    return Sharded(dim, layout.group)


def permute(t: Tracked) -> Sharded:
    value, layout = t.source()
    rank = len(t.shapes(value))
    order = [wrap_dim(d, rank) for d in t.node.args[1]]
    return Sharded(order.index(layout.dim), layout.group)


def matrix_t(t: Tracked) -> Sharded:
    value, layout = t.source()
    return Sharded(1 - layout.dim if len(t.shapes(value)) == 2 else layout.dim, layout.group)


def unsqueeze(t: Tracked) -> Sharded:
    _, layout = t.source()
    dim = wrap_dim(t.node.args[1], len(t.shapes(t.node)))
    return Sharded(layout.dim + (dim <= layout.dim), layout.group)


def squeeze(t: Tracked) -> Sharded:
    value, layout = t.source()
    before, after = t.shapes(value), t.shapes(t.node)
    dropped = sum(1 for d in range(layout.dim) if before[d] == 1) - sum(
        1 for d in range(len(after)) if d < layout.dim and after[d] == 1
    )
    return Sharded(layout.dim - max(dropped, 0), layout.group)


def expand(t: Tracked) -> Sharded:
    value, layout = t.source()
    return Sharded(layout.dim + len(t.shapes(t.node)) - len(t.shapes(value)), layout.group)


def slice_(t: Tracked) -> Sharded:
    value, layout = t.source()
    shape = t.shapes(value)
    dim = wrap_dim(t.arg(1, "dim", 0), len(shape))
    if dim == layout.dim and t.shapes(t.node)[dim] != shape[dim]:
        start, stop, step = t.arg(2, "start"), t.arg(3, "end"), t.arg(4, "step", 1)
        bounds = (start, stop, step)
        if not all(b is None or type(b) is int for b in bounds) or step != 1:
            raise Break(f"it slices the sharded dim with {bounds}")
        start, stop, _ = slice(start, stop).indices(shape[dim])
        t.cuts.append((start, stop))
    return layout


def select(t: Tracked) -> Sharded:
    value, layout = t.source()
    dim = wrap_dim(t.node.args[1], len(t.shapes(value)))
    if dim == layout.dim:
        raise Break("it selects one index of the sharded dim")
    return Sharded(layout.dim - (dim < layout.dim), layout.group)


def split(t: Tracked) -> tuple[Sharded, ...]:
    """Split on another dim: every part keeps the layout. On the sharded dim into equal parts: a
    fused projection (q|k|v), each part split on its own; into unequal parts: cuts."""
    value, layout = t.source()
    shape = t.shapes(value)
    dim = wrap_dim(t.arg(2, "dim", 0), len(shape))
    parts = [tuple(p.shape) for p in t.node.meta.get("val", ())]
    if dim == layout.dim:
        if len(parts) < 2:
            raise Break("it splits the sharded dim into one part")
        widths = {p[dim] for p in parts}
        if len(widths) != 1:
            offset = 0
            for part in parts:
                t.cuts.append((offset, offset + part[dim]))
                offset += part[dim]
            return tuple(Sharded(layout.dim, layout.group) for _ in parts)
        width = widths.pop()
        if width % t.size:
            raise Break(f"each of its {len(parts)} fused parts has {width}, not divisible")
        t.fused_parts = len(parts)
    return tuple(Sharded(layout.dim, layout.group) for _ in parts)


def index(t: Tracked) -> Sharded:
    """Advanced indexing with one index tensor (`x[..., [-2], :]`): on another dim it keeps the
    layout; on the sharded dim a constant run of consecutive indices is a cut."""
    value, layout = t.source()
    shape = t.shapes(value)
    indices = list(t.node.args[1])
    tensors = [i for i, x in enumerate(indices) if x is not None]
    if len(tensors) != 1:
        raise Break("it indexes with several index tensors")
    dim = tensors[0]
    constant = t.constant(indices[dim])
    if constant is None or constant.ndim != 1 or constant.dtype not in (torch.long, torch.int):
        if dim == layout.dim:
            raise Break("it indexes the sharded dim with a computed index")
        if constant is None or constant.ndim != 1:
            raise Break("it indexes with an index tensor that is not one list of positions")
        return layout
    if dim != layout.dim:
        return layout
    positions = [int(i) % shape[dim] for i in constant.tolist()]
    start = positions[0] if positions else 0
    if positions != list(range(start, start + len(positions))) or not positions:
        raise Break(f"it picks positions {positions} of the sharded dim")
    t.cuts.append((start, start + len(positions)))
    return layout


def getitem(t: Tracked) -> Any:
    container, index = t.node.args
    layout = t.layout(container)
    return layout[index] if isinstance(layout, tuple) else None


def cat(t: Tracked) -> Sharded:
    """Along another dim (a KV cache growing by the new keys): the cache's own tensors, graph
    inputs, then hold each rank's heads too."""
    tensors = list(t.node.args[0])
    dims = {t.layout(v).dim for v in tensors if isinstance(t.layout(v), Sharded)}
    rank = len(t.shapes(t.node))
    dim = wrap_dim(t.arg(1, "dim", 0), rank)
    if len(dims) != 1 or dim in dims:
        raise Break("it concatenates along the sharded dim")
    for value in tensors:
        if not isinstance(t.layout(value), Sharded) and not _graph_input(value):
            raise Break(f"it concatenates with {value.name}, a replicated value")
    return Sharded(dims.pop(), min(t.groups()))


def stack(t: Tracked) -> Sharded:
    """Stacking values sharded alike on a new dim (an interleaved rotary's pairs)."""
    tensors = list(t.node.args[0])
    layouts = [t.layout(v) for v in tensors]
    if not all(isinstance(x, Sharded) for x in layouts) or len({x.dim for x in layouts}) != 1:
        raise Break("it stacks values that are not all sharded on the same dim")
    dim = wrap_dim(t.arg(1, "dim", 0), len(t.shapes(t.node)))
    sharded = layouts[0].dim
    return Sharded(sharded + (dim <= sharded), min(t.groups()))


def _graph_input(node: fx.Node) -> bool:
    if node.op in ("placeholder", "get_attr"):
        return True
    passthrough = (aten.lift_fresh_copy.default, aten.detach_.default, aten.detach.default)
    return node.target in passthrough and all(_graph_input(n) for n in node.all_input_nodes)
