"""Tensor-parallel chains in one region graph: which Linears split, and where a chain breaks.

One walk over the graph in topological order gives every value a layout: replicated, or
`Sharded(dim, group)`: split on `dim` among the ranks, in chain `group`. A Linear that reads a
replicated value starts (or joins) a chain column-wise: its output is sharded on its features.
Ops that act independently per feature or per head carry the layout on (`LAYOUT_RULES`:
elementwise ops, activations, gating products, views into heads, transposes, rotary slices on
another dim, scaled-dot-product attention, GQA's repeat of key/value heads, a KV cache's
concatenation along the sequence). A Linear that reads a value sharded on its input features
closes the chain row-wise: its output is reduced (one all-reduce) and replicated again. Ops
that meet two chains join them (q, k and v meet in attention; gate and up in the product).

Anything else breaks the chain, and the break names its node and why: a norm or softmax over
the sharded dim, a slice of it, a head count that does not divide by the degree, a sum with a
replicated tensor of full width, a sharded value leaving the region. A fused projection whose
sharded output is split into equal parts along the sharded dim (GPT-2's c_attn into q|k|v) is
recorded as fused: each part is split on its own. Slices (or an unequal split) of a Linear's
output along the sharded dim that tile it, each part a multiple of the degree, are fused parts
of unequal widths (Phi3's qkv under GQA: q|k|v of 32, 8 and 8 heads); cuts of anything else,
or that leave a gap or overlap, break the chain. A broken chain is replicated, so what it
computes is whole: a Linear reading it may start a chain of its own (MLA's q_b_proj after the
norm that broke q_a_proj's).

With `forced` styles (a hand plan) the Linears do what they are told and a layout they cannot
take is a `HandPlanConflict` naming the module and node, instead of a break.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from torch import fx, nn

from retarget.passes.shard.tp_fused_parts import fuse_cuts, lifted_constant
from retarget.passes.shard.tp_layout import Break, Sharded, Tracked, Whole, tensor_shape
from retarget.passes.shard.tp_layout_rules import layout_rule
from retarget.passes.shard.tp_linear_sites import LinearSite, linear_site


class HandPlanConflict(ValueError):
    """A hand plan splits a module in a way the region's graph cannot run."""


@dataclass
class Chain:
    """Linears split together: column-wise ones, then the row-wise ones that close the chain."""

    colwise: list[str] = field(default_factory=list)
    rowwise: list[str] = field(default_factory=list)
    fused: dict[str, int] = field(default_factory=dict)
    """Linear path -> equal parts its output is split into."""
    parts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Linear path -> the unequal widths of the parts its output is cut into, in order."""
    whole_parts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Linear path -> the indices of its `parts` every rank holds whole (Falcon's k and v)."""
    cuts: dict[str, set[tuple[int, int, bool]]] = field(default_factory=dict)
    """Linear path -> the [start, stop) feature ranges the graph cuts from its output, and
    whether each is split (else kept whole)."""
    widths: set[int] = field(default_factory=set)
    """Sizes the sharded dim takes along the chain (feature widths, head counts)."""
    per_shard_params: list[str] = field(default_factory=list)
    """Parameters read whole on sharded values (a per-head norm): their gradients are partial."""
    breaks: list[str] = field(default_factory=list)

    @property
    def members(self) -> list[str]:
        return self.colwise + self.rowwise

    @property
    def complete(self) -> bool:
        return not self.breaks and bool(self.colwise) and bool(self.rowwise)


@dataclass
class ChainAnalysis:
    """Every Linear of one graph, and the chains they form."""

    linears: dict[str, LinearSite]
    chains: list[Chain]

    def chain_of(self, path: str) -> Chain | None:
        return next((c for c in self.chains if path in c.members), None)


def find_chains(
    gm: fx.GraphModule,
    root: nn.Module,
    size: int,
    *,
    state_outputs: int = 0,
    forced: dict[str, str] | None = None,
    whole_parts: bool = True,
) -> ChainAnalysis:
    """Walk `gm` (a region graph whose attributes resolve on `root`) for a degree of `size`.

    `state_outputs` is how many trailing flat outputs are a KV cache's tensors (they may leave
    sharded: the cache then holds each rank's heads). `forced` maps relative module paths to
    styles (a hand plan); unlisted Linears are replicated. `whole_parts=False`: a fused part
    whose heads do not divide by the degree breaks its chain instead of being kept whole.
    """
    walk = _Walk(gm, root, size, forced, whole_parts)
    for node in gm.graph.nodes:
        walk.visit(node, state_outputs)
    return walk.result()


class _Walk:
    def __init__(
        self,
        gm: fx.GraphModule,
        root: nn.Module,
        size: int,
        forced: dict | None,
        whole_parts: bool,
    ):
        self.gm, self.root, self.size, self.forced = gm, root, size, forced
        self.whole_parts = whole_parts
        self.layouts: dict[fx.Node, Any] = {}
        self.parents: list[int] = []
        self.chains: list[Chain] = []
        self.linears: dict[str, LinearSite] = {}
        self.origins: dict[fx.Node, str] = {}

    # -- chain groups (union-find) ---------------------------------------------------------
    def new_chain(self) -> int:
        self.parents.append(len(self.parents))
        self.chains.append(Chain())
        return len(self.parents) - 1

    def find(self, group: int) -> int:
        while self.parents[group] != group:
            self.parents[group] = self.parents[self.parents[group]]
            group = self.parents[group]
        return group

    def join(self, a: int, b: int) -> int:
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parents[b] = a
            keep, gone = self.chains[a], self.chains[b]
            keep.colwise += gone.colwise
            keep.rowwise += gone.rowwise
            keep.fused.update(gone.fused)
            for path, spans in gone.cuts.items():
                keep.cuts.setdefault(path, set()).update(spans)
            keep.widths |= gone.widths
            keep.per_shard_params += gone.per_shard_params
            keep.breaks += gone.breaks
        return a

    def chain(self, group: int) -> Chain:
        return self.chains[self.find(group)]

    def break_chains(self, node: fx.Node, groups: set[int], why: str) -> None:
        reason = f"node {node.name}: {why}"
        if self.forced is not None:
            raise HandPlanConflict(self._conflict(groups, reason))
        for group in {self.find(g) for g in groups}:
            self.chains[group].breaks.append(reason)

    def _conflict(self, groups: set[int], reason: str) -> str:
        members = sorted({p for g in groups for p in self.chain(g).members})
        return f"the hand plan splits {', '.join(members) or 'a value'}, but {reason}"

    # -- the walk ---------------------------------------------------------------------------
    def visit(self, node: fx.Node, state_outputs: int) -> None:
        if node.op == "output":
            self.visit_output(node, state_outputs)
            return
        site = linear_site(node, self.root)
        if site is not None:
            self.layouts[node] = self.visit_linear(node, site)
            return
        inputs = {n: self.layout_of(n) for n in node.all_input_nodes}
        sharded = {n: lay for n, lay in inputs.items() if isinstance(lay, (Sharded, tuple))}
        wholes = {lay.group for lay in inputs.values() if isinstance(lay, Whole)}
        if not sharded:
            self.layouts[node] = self.carry_whole(node, wholes) if wholes else None
            return
        tracked = Tracked(node, inputs, self.size, constant=partial(lifted_constant, self.gm))
        groups = tracked.groups()
        try:
            rule = layout_rule(node.target) if node.op == "call_function" else None
            if rule is None:
                raise Break(f"{_describe(node)} is not known to act per feature or per head")
            layout = rule(tracked)
        except Break as why:
            self.break_chains(node, groups, str(why))
            self.layouts[node] = None  # the broken chain is replicated: this value is whole
            return
        if tracked.cuts:
            layout = self.cut_parts(node, tracked, groups, layout)
            if layout is None:
                self.layouts[node] = None
                return
        for a, b in zip(sorted(groups), sorted(groups)[1:], strict=False):
            self.join(a, b)
        for param in tracked.whole_parameters:
            self.chain(next(iter(groups))).per_shard_params.append(param)
        self.record(node, layout, tracked)
        self.layouts[node] = layout

    def record(self, node: fx.Node, layout: Any, tracked: Tracked) -> None:
        if tracked.fused_parts and tracked.first_sharded in self.origins:
            origin = self.origins[tracked.first_sharded]
            group = next(iter(tracked.groups()))
            self.chain(group).fused[origin] = tracked.fused_parts
        for item in layout if isinstance(layout, tuple) else (layout,):
            if isinstance(item, Sharded):
                shape = tensor_shape(node)
                if shape is not None and not isinstance(layout, tuple):
                    self.chain(item.group).widths.add(int(shape[item.dim]))
        if tracked.cuts:
            return  # a part: cutting it again is not cutting the Linear's output
        if tracked.first_sharded in self.origins and len(tracked.groups()) == 1:
            self.origins[node] = self.origins[tracked.first_sharded]

    def cut_parts(self, node: fx.Node, tracked: Tracked, groups: set[int], layout: Any) -> Any:
        """Record the ranges `node` cuts from a Linear's output, in that Linear's output
        features, and give each part its layout: split when its size on the sharded dim (heads,
        after a view into heads) divides by the degree, else kept whole (`Whole`). None (the
        chain broken) when the value cut is not a Linear's whole output."""
        value, sharded = tracked.source()
        origin = self.origins.get(value)
        width = tensor_shape(value)[sharded.dim]  # type: ignore[index]
        features = self.linears[origin].out_features if origin is not None else 0
        if origin is None or features % width:
            self.break_chains(node, groups, "it slices the sharded dim")
            return None
        unit = features // width  # features per index of the sharded dim (a head's width)
        parts = []
        for start, stop in tracked.cuts:
            split = (stop - start) % self.size == 0
            if not split and not self.whole_parts:
                self.break_chains(
                    node,
                    groups,
                    f"it cuts a part of {stop - start} on the sharded dim, which does not "
                    f"divide by {self.size} (kept whole beside the split parts only under tp "
                    "alone)",
                )
                return None
            parts.append(sharded if split else Whole(sharded.group))
        spans = self.chain(sharded.group).cuts.setdefault(origin, set())
        spans.update(
            (start * unit, stop * unit, isinstance(part, Sharded))
            for (start, stop), part in zip(tracked.cuts, parts, strict=True)
        )
        return tuple(parts) if isinstance(layout, tuple) else parts[0]

    def carry_whole(self, node: fx.Node, groups: set[int]) -> Any:
        """An op on parts kept whole (and replicated values): the part's shape ops, its rotary,
        its KV cache's concatenation. Its output is kept whole too (and checked where it is
        read); values of two chains, or a Linear, break."""
        if node.op != "call_function" or len(groups) != 1:
            self.break_chains(node, groups, f"{_describe(node)} reads a part kept whole")
            return None
        return Whole(next(iter(groups)))

    def layout_of(self, node: fx.Node) -> Any:
        layout = self.layouts.get(node)
        if isinstance(layout, (Sharded, Whole)) and self.chain(layout.group).breaks:
            return None  # a broken chain is replicated: its values are whole
        return layout

    def visit_linear(self, node: fx.Node, site: LinearSite) -> Sharded | None:
        self.linears.setdefault(site.path, site)
        source = node.args[1] if site.kind == "conv1d" else node.args[0]
        layout = self.layout_of(source) if isinstance(source, fx.Node) else None
        style = None if self.forced is None else self.forced.get(site.path, "replicate")
        if isinstance(layout, Whole):
            self.break_chains(node, {layout.group}, f"{site.path} reads a part kept whole")
            return None
        if isinstance(layout, Sharded):
            ndim = len(tensor_shape(source) or ())
            if layout.dim != ndim - 1 or (style is not None and style != "rowwise"):
                what = "its input features" if layout.dim == ndim - 1 else f"dim {layout.dim}"
                named = site.path if style is None else f"{site.path} ({style})"
                self.break_chains(node, {layout.group}, f"{named} reads a value sharded on {what}")
                return None
            self.chain(layout.group).rowwise.append(site.path)
            return None
        if style is not None and style != "colwise":
            if style == "rowwise":
                raise HandPlanConflict(
                    f"the hand plan makes {site.path} rowwise, but its input (node "
                    f"{_name(source)}) is not the output of a column-wise chain"
                )
            return None
        group = self.new_chain()
        chain = self.chains[group]
        chain.colwise.append(site.path)
        chain.widths.add(site.out_features)
        self.origins[node] = site.path
        shape = tensor_shape(node)
        return Sharded(len(shape) - 1 if shape is not None else -1, group)

    def visit_output(self, node: fx.Node, state_outputs: int) -> None:
        flat = [a for a in _flatten(node.args[0])]
        kept = len(flat) - state_outputs
        for index, value in enumerate(flat):
            layout = self.layout_of(value) if isinstance(value, fx.Node) else None
            if isinstance(layout, Whole) and index < kept:
                self.break_chains(value, {layout.group}, "a part kept whole leaves the region")
            if isinstance(layout, Sharded) and index < kept:
                self.break_chains(
                    value,
                    {layout.group},
                    "the value leaves the region sharded (no row-wise Linear)",
                )

    def result(self) -> ChainAnalysis:
        roots = sorted({self.find(g) for g in range(len(self.parents))})
        chains = [self.chains[r] for r in roots]
        for chain in chains:
            for path, spans in chain.cuts.items():
                fuse_cuts(chain, path, sorted(spans), self.linears[path].out_features, self.size)
            for path in chain.colwise:
                parts = chain.fused.get(path, 1)
                features = self.linears[path].out_features
                if features % (parts * self.size):
                    chain.breaks.append(
                        f"{path} has {features} output features"
                        + (f" in {parts} fused parts" if parts > 1 else "")
                        + f", which do not divide by {self.size}"
                    )
            if self.forced is not None and chain.breaks:
                raise HandPlanConflict(
                    self._conflict({roots[chains.index(chain)]}, chain.breaks[0])
                )
        return ChainAnalysis(self.linears, chains)


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _flatten(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _flatten(item)]
    return [value]


def _name(value: Any) -> str:
    return value.name if isinstance(value, fx.Node) else repr(value)


def _describe(node: fx.Node) -> str:
    target = getattr(node.target, "__name__", str(node.target))
    return f"{node.op} {target}"
