"""The layout a tensor-parallel walk gives each graph value, and the node a rule looks at.

`Sharded(dim, group)`: split on `dim` among the ranks, in chain `group`; None: replicated. A
rule (`tp_layout_rules`, `tp_shape_rules`) raises `Break` when an op does not keep the sharded
dim independent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from retarget.ir.nodes import op_name, traced_value

aten = torch.ops.aten


class Break(Exception):
    """The op does not keep the sharded dim independent; the message says why."""


@dataclass(frozen=True)
class Sharded:
    """The value is split on `dim` among the ranks, as part of chain `group`."""

    dim: int
    group: int


@dataclass(frozen=True)
class Whole:
    """A part of chain `group`'s fused output that every rank holds whole (Falcon's one-head k
    and v beside its split q): each rank's gradient of it is partial (only that rank's heads
    read it), so it may only meet the chain's split values (attention, broadcast over their
    heads) or leave as a KV cache's state; anything else breaks the chain."""

    group: int


def tensor_shape(node: Any) -> tuple[int, ...] | None:
    """The value's shape; a symbolic size (a graph serving several lengths) by its example value.

    None when the frontend recorded no shape or a size has no example value (data-dependent).
    """
    while isinstance(node, fx.Node) and "val" not in node.meta and _is_cast(node):
        node = node.args[0]  # a cast a precision pass inserted keeps its input's shape
    value = traced_value(node)
    if not isinstance(value, torch.Tensor):
        return None
    sizes = [s if isinstance(s, int) else getattr(s.node, "hint", None) for s in value.shape]
    return None if None in sizes else tuple(int(s) for s in sizes)


#: Dtype casts (a graph-form autocast inserts them, without a recorded value).
CASTS = (
    torch.ops.aten.to.dtype,
    torch.ops.aten.to.dtype_layout,
    torch.ops.aten._to_copy.default,
    torch.ops.prims.convert_element_type.default,
)


def _is_cast(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in CASTS and bool(node.args)


@dataclass
class Tracked:
    """One node during the walk: its inputs' layouts, and what its rule found out."""

    node: fx.Node
    layouts: dict[fx.Node, Any]
    size: int
    fused_parts: int = 0
    cuts: list[tuple[int, int]] = field(default_factory=list)
    """[start, stop) ranges of the sharded dim the op cuts out (slices; a split into unequal
    parts): parts of a fused projection when they tile its output (tp_chains)."""
    constant: Callable[[Any], torch.Tensor | None] = lambda _node: None
    """The value of a graph constant (an index tensor export lifted), None if not one."""
    whole_parameters: list[str] = field(default_factory=list)

    def groups(self) -> set[int]:
        found = set()
        for layout in self.layouts.values():
            for item in layout if isinstance(layout, tuple) else (layout,):
                if isinstance(item, (Sharded, Whole)):
                    found.add(item.group)
        return found

    @property
    def first_sharded(self) -> fx.Node | None:
        return next((n for n, lay in self.layouts.items() if isinstance(lay, Sharded)), None)

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        if len(self.node.args) > index:
            return self.node.args[index]
        return self.node.kwargs.get(name, default)

    def layout(self, value: Any) -> Any:
        return self.layouts.get(value) if isinstance(value, fx.Node) else None

    def source(self) -> tuple[fx.Node, Sharded]:
        """The first argument, which must be sharded."""
        value = self.node.args[0]
        layout = self.layout(value)
        if not isinstance(layout, Sharded):
            raise Break(f"{op_label(self.node)} reads a sharded value in an unexpected position")
        return value, layout

    def shapes(self, value: fx.Node) -> tuple[int, ...]:
        shape = tensor_shape(value)
        if shape is None:
            raise Break(f"no concrete shape for {value.name} (not recorded, or data-dependent)")
        return shape


Rule = Callable[[Tracked], Any]


def op_label(node: fx.Node) -> str:
    """How a Break names a node's op: with its overload ("add.Tensor"), else the node's name."""
    return op_name(node, overload=True) or node.name


def wrap_dim(dim: int, rank: int) -> int:
    return dim % rank if rank else dim
