"""How each op carries a tensor-parallel layout: the rule table `tp_chains` walks a graph with.

A rule takes the `Tracked` node (its inputs' layouts) and returns its output's layout: None
(replicated), `Sharded(dim, group)`, or a tuple of them for ops returning several tensors. It
raises `Break` with the reason when the op does not act independently per feature or per head
on the sharded dim. Ops tagged pointwise by torch (every elementwise op and activation) need no
entry; everything else unknown breaks the chain.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from retarget.passes.shard.tp_layout import (
    Break,
    Rule,
    Sharded,
    Tracked,
    Whole,
    op_label,
    tensor_shape,
    wrap_dim,
)
from retarget.passes.shard.tp_shape_rules import (
    cat,
    expand,
    getitem,
    index,
    matrix_t,
    permute,
    reshape,
    select,
    slice_,
    split,
    squeeze,
    stack,
    transpose,
    unsqueeze,
)

aten = torch.ops.aten


# -- elementwise ------------------------------------------------------------------------------
def pointwise(t: Tracked) -> Sharded | None:
    """Every sharded input on the same (right-aligned) dim; the rest broadcast over it."""
    out = t.shapes(t.node)
    rank, dims = len(out), set()
    for value, layout in t.layouts.items():
        if isinstance(layout, Sharded):
            dims.add(layout.dim + rank - len(t.shapes(value)))
    if len(dims) != 1:
        raise Break(f"{op_label(t.node)} combines values sharded on different dims")
    dim = dims.pop()
    for value in t.node.all_input_nodes:
        if isinstance(t.layouts.get(value), Sharded) or tensor_shape(value) is None:
            continue
        shape = t.shapes(value)
        local = dim - (rank - len(shape))
        if local >= 0 and shape[local] != 1:
            raise Break(
                f"{op_label(t.node)} combines it with {value.name}, a replicated tensor of full "
                f"width {shape[local]} on the sharded dim"
            )
        if value.op == "get_attr":
            t.whole_parameters.append(str(value.target))
    return Sharded(dim, min(t.groups()))


def same_layout(t: Tracked) -> Sharded:
    return t.source()[1]


def no_tensor(t: Tracked) -> None:
    return None


def pair(t: Tracked) -> tuple[Sharded, Sharded]:
    layout = t.source()[1]
    return (layout, layout)


def attention(t: Tracked) -> Sharded:
    """scaled_dot_product_attention: q, k and v split on the same heads dim (or k and v parts
    kept whole with one head, which broadcasts over each rank's query heads); a mask
    broadcasts."""
    q, k, v = t.node.args[:3]
    layouts = [t.layout(x) for x in (q, k, v)]
    if all(isinstance(x, Whole) for x in layouts[1:]) and isinstance(layouts[0], Sharded):
        heads = layouts[0].dim
        if any(t.shapes(x)[heads] != 1 for x in (k, v)):
            raise Break("attention reads k and v kept whole with more than one head")
        layouts = [layouts[0]] * 3
    if not all(isinstance(x, Sharded) for x in layouts) or len({x.dim for x in layouts}) != 1:
        raise Break("attention reads q, k and v that are not all split on the same heads dim")
    dim, rank = layouts[0].dim, len(t.shapes(q))
    if dim >= rank - 2:
        raise Break("attention would contract over the sharded dim")
    mask = t.arg(3, "attn_mask")
    if isinstance(mask, fx.Node) and not isinstance(t.layout(mask), Sharded):
        shape = t.shapes(mask)
        local = dim - (rank - len(shape))
        if local >= 0 and shape[local] != 1:
            raise Break(f"the attention mask {mask.name} has full width on the heads dim")
    return Sharded(dim, min(t.groups()))


def batched_matmul(t: Tracked) -> Sharded:
    """matmul over batch dims (eager attention's q @ k^T, probs @ v): split on a batch dim."""
    a, b = t.node.args[:2]
    rank = len(t.shapes(t.node))
    dims = set()
    for value in (a, b):
        layout = t.layout(value)
        shape = t.shapes(value)
        if isinstance(layout, Sharded):
            dim = layout.dim + rank - len(shape)
            if dim >= rank - 2:
                raise Break("the matmul contracts over the sharded dim outside a Linear")
            dims.add(dim)
        elif len(shape) == rank and next(iter(dims), 0) < rank - 2:
            continue
    if len(dims) != 1:
        raise Break("the matmul reads values sharded on different dims")
    dim = dims.pop()
    for value in (a, b):
        if not isinstance(t.layout(value), Sharded):
            shape = t.shapes(value)
            local = dim - (rank - len(shape))
            if local >= 0 and shape[local] != 1:
                raise Break(f"the matmul combines it with {value.name}, replicated on that dim")
    return Sharded(dim, min(t.groups()))


def over_dims(position: int, name: str, what: str) -> Rule:
    """A reduction or softmax over `dims`: fine unless the sharded dim is one of them."""

    def rule(t: Tracked) -> Sharded:
        value, layout = t.source()
        rank = len(t.shapes(value))
        dims = t.arg(position, name)
        dims = range(rank) if dims is None or dims == [] else dims
        dims = {wrap_dim(d, rank) for d in ([dims] if isinstance(dims, int) else dims)}
        if layout.dim in dims:
            raise Break(f"{what} over the sharded dim")
        kept = len(t.shapes(t.node)) == rank
        return Sharded(
            layout.dim - (0 if kept else sum(d < layout.dim for d in dims)), layout.group
        )

    return rule


def norm(t: Tracked) -> Any:
    """layer_norm / rms_norm over the last len(normalized_shape) dims."""
    value, layout = t.source()
    rank = len(t.shapes(value))
    if layout.dim >= rank - len(t.node.args[1]):
        raise Break(f"{op_label(t.node)} normalises over the sharded dim")
    for weight in t.node.args[2:4]:
        if isinstance(weight, fx.Node) and weight.op == "get_attr":
            t.whole_parameters.append(str(weight.target))
    if t.node.target is aten.native_layer_norm.default:
        return (layout, None, None)
    return layout


LAYOUT_RULES: dict[Any, Rule] = {
    operator.getitem: getitem,
    aten.view.default: reshape,
    aten.reshape.default: reshape,
    aten._unsafe_view.default: reshape,
    aten.flatten.using_ints: reshape,
    aten.transpose.int: transpose,
    aten.permute.default: permute,
    aten.t.default: matrix_t,
    aten.unsqueeze.default: unsqueeze,
    aten.squeeze.dim: squeeze,
    aten.squeeze.dims: squeeze,
    aten.expand.default: expand,
    aten.slice.Tensor: slice_,
    aten.select.int: select,
    aten.index.Tensor: index,
    aten.split.Tensor: split,
    aten.split_with_sizes.default: split,
    aten.chunk.default: split,
    aten.unbind.int: split,
    aten.cat.default: cat,
    aten.stack.default: stack,
    aten.view_as.default: reshape,
    aten.scaled_dot_product_attention.default: attention,
    aten.matmul.default: batched_matmul,
    aten.bmm.default: batched_matmul,
    aten._softmax.default: over_dims(1, "dim", "softmax"),
    aten.softmax.int: over_dims(1, "dim", "softmax"),
    aten._log_softmax.default: over_dims(1, "dim", "log_softmax"),
    aten.log_softmax.int: over_dims(1, "dim", "log_softmax"),
    aten.mean.dim: over_dims(1, "dim", "a mean (a norm's statistics)"),
    aten.sum.dim_IntList: over_dims(1, "dim", "a sum"),
    aten.amax.default: over_dims(1, "dim", "a max"),
    aten.amin.default: over_dims(1, "dim", "a min"),
    aten.logsumexp.default: over_dims(1, "dim", "a logsumexp"),
    aten.var.correction: over_dims(1, "dim", "a variance (a norm's statistics)"),
    aten.var_mean.correction: over_dims(1, "dim", "a variance (a norm's statistics)"),
    aten.layer_norm.default: norm,
    aten.native_layer_norm.default: norm,
    aten.rms_norm.default: norm,
    aten.dropout.default: same_layout,
    aten.native_dropout.default: pair,
    aten.clone.default: same_layout,
    aten.contiguous.default: same_layout,
    aten.detach.default: same_layout,
    aten.alias.default: same_layout,
    aten.to.dtype: same_layout,
    aten.to.dtype_layout: same_layout,
    aten._to_copy.default: same_layout,
    aten.type_as.default: pointwise,
    aten.ones_like.default: same_layout,
    aten.zeros_like.default: same_layout,
    aten.empty_like.default: same_layout,
    aten.full_like.default: same_layout,
    aten._assert_tensor_metadata.default: no_tensor,
    aten.sym_size.int: no_tensor,
}


def layout_rule(target: Any) -> Rule | None:
    """The table's rule, or `pointwise` for ops torch tags pointwise."""
    rule = LAYOUT_RULES.get(target)
    if rule is None and isinstance(target, torch._ops.OpOverload):
        if torch.Tag.pointwise in target.tags:
            return pointwise
    return rule
