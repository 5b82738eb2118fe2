"""insert_autocast's graph form: casts inserted into a captured region's fx graph.

Each matmul-class op gets its floating inputs cast to the low dtype, island ops of the kinds
kept in float32 get theirs cast back, and the values leaving the graph are cast back to the
dtype eager gives; every other op runs in the dtype its inputs have. A fill-type op
(rules.SATURATES) on a value that may now be low precision saturates its float constants to
that dtype's range at run time: the float32 `finfo(x.dtype).min` a trace baked in becomes the
limit eager under autocast reads, where the op would otherwise refuse the value.
insert_autocast.py's docstring says why; autocast_rules.py holds the per-op tables this module
drives.

    >>> plan_graph(gm, AutocastOptions())            # what the rewrite would do: counts
    >>> rewrite_graph(gm, options=AutocastOptions())  # gm.meta["autocast"] records what it did
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from retarget.core.modules import original_class
from retarget.execution.autocast import LowPrecision, cast_weight_linear
from retarget.ir.nodes import op_name, traced_value
from retarget.passes.precision import autocast_rules as rules

_AUTOCAST_ELIGIBLE = (torch.float32, torch.bfloat16, torch.float16)

#: The live modules a graph's `call_module` target names: one per repeat of the region.
Modules = Callable[[str], list[nn.Module]]

# Dtype states of a graph value after the rewrite.
LOW = "low"  # the low dtype, for sure
EAGER = "eager"  # the dtype eager gives, for sure
MAYBE = "maybe"  # either: casts that need one or the other are inserted


class GraphOptions(Protocol):
    """What the graph form reads of insert_autocast's AutocastOptions."""

    @property
    def torch_dtype(self) -> torch.dtype: ...

    @property
    def keep_fp32(self) -> tuple[str, ...]: ...

    @property
    def autocast_eval(self) -> bool: ...

    @property
    def recast_weights(self) -> bool: ...


def plan_graph(
    gm: fx.GraphModule, options: GraphOptions, modules: Modules | None = None
) -> dict[str, Any]:
    """Counts of what rewrite_graph would do, without changing `gm`."""
    modules = modules or _own_modules(gm)
    decisions = rules.classify(gm.graph, gm)
    lowered = Counter(op_name(n) for n, d in decisions.items() if _lowers(n, d))
    for node in (n for n, d in decisions.items() if d == rules.MODULE):
        plain = [m for m in modules(node.target) if rules.is_plain_leaf(m)]
        if plain:
            lowered[rules.LOWER_MODULES[original_class(plain[0])] + " (module)"] += 1
    islands = Counter(f"{d}:{op_name(n)}" for n, d in decisions.items() if d in options.keep_fp32)
    total = sum(lowered.values())
    return {"lowered": total, "lowered_ops": dict(lowered), "islands": dict(islands)}


def rewrite_graph(
    gm: fx.GraphModule, *, options: GraphOptions, modules: Modules | None = None
) -> None:
    """The graph form (see the module docstring); a graph already rewritten is left alone.

    A `call_module` of a plain Linear/Conv leaf (a graph that routes calls to modules, as
    swap_fp8 does, keeping some Linears plain) runs that leaf under torch.autocast in every
    repeat (`modules` finds them; default: `gm`'s own submodules); modules of other classes,
    FP8 Linears among them, keep their own precision.

    Records what it did in `gm.meta["autocast"]` and each value's dtype state in
    `node.meta["autocast"]` (low / eager / maybe); `meta["val"]` keeps the fp32 trace.
    """
    if "autocast" in gm.meta:
        return
    if gm.meta.get("training") is False and not options.autocast_eval:
        gm.meta["autocast"] = {"skipped": "eval mode and autocast_eval=false", "casts": 0}
        return
    modules = modules or _own_modules(gm)
    summary = plan_graph(gm, options, modules)
    rewriter = _GraphRewriter(gm, options, modules)
    rewriter.run()
    recast = recast_weights_in_backward(gm.graph) if options.recast_weights else 0
    gm.meta["autocast"] = {
        **summary, "casts": rewriter.casts, "saturated": rewriter.saturated, "recast": recast
    }  # fmt: skip


def recast_weights_in_backward(graph: fx.Graph) -> int:
    """Each `linear(x, to(<parameter>, low), bias)` becomes `cast_weight_linear(x, parameter,
    bias, low)`, which saves the float32 parameter for backward rather than its low-precision
    cast (a new tensor: kept, it would hold a bf16 copy of every weight from forward to
    backward) and casts again there; how many were rewritten."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or op_name(node) != "linear" or node.kwargs:
            continue
        x, weight, *rest = node.args
        cast = isinstance(weight, fx.Node) and weight.target is torch.ops.aten.to.dtype
        if not cast or weight.args[0].op != "get_attr" or len(weight.args) != 2:
            continue
        parameter, dtype = weight.args
        node.target = cast_weight_linear
        node.args = (x, parameter, rest[0] if rest else None, dtype)
        if not weight.users:
            graph.erase_node(weight)
        count += 1
    return count


class _GraphRewriter:
    def __init__(self, gm: fx.GraphModule, options: GraphOptions, modules: Modules):
        self.graph = gm.graph
        self.modules = modules
        self.policy = LowPrecision(options.torch_dtype, options.autocast_eval)
        self.low = options.torch_dtype
        self.keep = frozenset(options.keep_fp32)
        self.decisions = rules.classify(gm.graph, gm)
        self.state: dict[fx.Node, str] = {}
        self.cache: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
        self.casts = 0
        self.saturated = 0

    def run(self) -> None:
        for node in list(self.graph.nodes):
            decision = self.decisions.get(node)
            if node.op == "output":
                self._cast_inputs(node, self._restore)
                continue
            if _lowers(node, decision):
                self._cast_inputs(node, self._lower)
                state = LOW if _is_float32(node) else MAYBE  # multi-output ops: MAYBE
            elif decision in self.keep:
                self._cast_inputs(node, self._restore)
                state = EAGER
            elif decision == rules.MODULE:
                for module in self.modules(node.target):
                    if rules.is_plain_leaf(module):
                        self.policy.install(module)
                state = self._propagate(node)  # the leaf casts its outputs back
            elif op_name(node) == "_assert_tensor_metadata":
                if self.state.get(node.args[0], EAGER) != EAGER:
                    self.graph.erase_node(node)  # export's check of a dtype we changed
                continue
            else:
                state = self._propagate(node)
                if state != EAGER and op_name(node) in rules.SATURATES:
                    self._saturate(node)
            self.state[node] = state
            node.meta["autocast"] = state

    def _saturate(self, node: fx.Node) -> None:
        """A fill-type op on a value that may now be low precision: its float constants out of
        that dtype's range become the range's limit at run time (rules.SATURATES)."""
        if not any(isinstance(a, float) for a in (*node.args, *node.kwargs.values())):
            return
        if node.op == "call_method":
            node.op, node.target = "call_function", saturating(_method(node.target))
        elif node.op == "call_function":
            node.target = saturating(node.target)
        self.saturated += 1

    def _cast_inputs(self, node: fx.Node, cast) -> None:
        node.args = fx.node.map_arg(node.args, functools.partial(cast, user=node))
        node.kwargs = fx.node.map_arg(node.kwargs, functools.partial(cast, user=node))

    def _lower(self, value: fx.Node, user: fx.Node) -> fx.Node:
        if self.state.get(value) == LOW or not _may_be_float(value):
            return value
        return self._cast(value, self.low, user)

    def _restore(self, value: fx.Node, user: fx.Node) -> fx.Node:
        if self.state.get(value, EAGER) == EAGER or not _may_be_float(value):
            return value
        known = traced_value(value)
        eager = known.dtype if isinstance(known, torch.Tensor) else torch.float32
        return self._cast(value, eager, user)

    def _cast(self, value: fx.Node, dtype: torch.dtype, user: fx.Node) -> fx.Node:
        """`value` cast to `dtype`, once per value and dtype; before its first user."""
        key = (value, dtype)
        if key not in self.cache:
            # A value of unknown dtype (no traced value) may be an integer or bool tensor.
            known = isinstance(traced_value(value), torch.Tensor)
            cast_fn = torch.ops.aten.to.dtype if known else cast_floating
            with self.graph.inserting_before(user):
                cast = self.graph.call_function(cast_fn, (value, dtype))
            cast.meta["autocast"] = LOW if dtype == self.low else EAGER
            self.state[cast] = cast.meta["autocast"]
            self.cache[key] = cast
            self.casts += 1
        return self.cache[key]

    def _propagate(self, node: fx.Node) -> str:
        """The dtype state of an op this pass does not rewrite, from its inputs' states."""
        if not _may_be_float(node) or _explicit_dtype(node):
            return EAGER
        inputs = [x for x in node.all_input_nodes if _may_be_float(x)]
        states = [self.state.get(x, EAGER) for x in inputs]
        if all(s == EAGER for s in states):
            return EAGER
        if _is_inplace(node):
            return self.state.get(node.args[0], EAGER)
        name = op_name(node)
        if name in rules.FOLLOWS and all(s == LOW for s in states):
            return LOW
        if name in rules.PROMOTES and _is_float32(node):
            pairs = zip(inputs, states, strict=True)
            if any(s == EAGER and _is_float32(x, dimensioned=True) for x, s in pairs):
                return EAGER
        return MAYBE


@functools.cache
def saturating(op: Callable[..., Any]) -> Callable[..., Any]:
    """`op`, with each finite float argument beyond the range of its first floating tensor
    argument's dtype (when bf16 or fp16) replaced by that range's limit, sign kept; inf stays
    inf."""

    def call(*args: Any, **kwargs: Any) -> Any:
        first = next((a for a in args if torch.is_tensor(a) and a.is_floating_point()), None)
        if first is not None and first.dtype in (torch.bfloat16, torch.float16):
            limit = torch.finfo(first.dtype).max
            args = tuple(_within(a, limit) for a in args)
            kwargs = {k: _within(v, limit) for k, v in kwargs.items()}
        return op(*args, **kwargs)

    call.__name__ = f"saturating_{getattr(op, '__name__', 'op')}".replace(".", "_")
    call.__qualname__ = call.__name__
    return call


def _within(value: Any, limit: float) -> Any:
    if isinstance(value, float) and math.isfinite(value) and abs(value) > limit:
        return math.copysign(limit, value)
    return value


@functools.cache
def _method(name: str) -> Callable[..., Any]:
    """A call_method target as a function: `x.name(*rest)`."""

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, name)(*args, **kwargs)

    call.__name__ = name
    return call


def _lowers(node: fx.Node, decision: str | None) -> bool:
    """A matmul-class op that eager runs in float32 (float64 stays, as under torch.autocast)."""
    if decision != rules.LOWER:
        return False
    value = traced_value(node)
    leaves = [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]
    return value is None or any(v.dtype == torch.float32 for v in leaves)


def _own_modules(gm: fx.GraphModule) -> Modules:
    return lambda target: [gm.get_submodule(target)]


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """`value.to(dtype)` for a float32/bf16/fp16 tensor, else `value` (float64 stays, as under
    torch.autocast). The cast of graph values whose traced dtype is unknown."""
    if isinstance(value, torch.Tensor) and value.dtype in _AUTOCAST_ELIGIBLE:
        return value.to(dtype)
    return value


def _is_float32(node: fx.Node, *, dimensioned: bool = False) -> bool:
    value = traced_value(node)
    if not isinstance(value, torch.Tensor):
        return value is None and not dimensioned  # unknown: a float32 value, as traced
    return value.dtype == torch.float32 and (value.dim() > 0 or not dimensioned)


def _may_be_float(node: fx.Node) -> bool:
    """False only when the traced value is known to hold no floating tensor."""
    value = traced_value(node)
    if value is None:
        return "val" not in node.meta
    leaves = tree_flatten(value)[0]
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in leaves)


def _explicit_dtype(node: fx.Node) -> bool:
    """Whether the op's output dtype is an argument (`x.to(torch.float32)`, `dtype=`)."""
    if isinstance(node.kwargs.get("dtype"), torch.dtype):
        return True
    if node.op == "call_method":
        if node.target in ("float", "double", "half", "bfloat16"):
            return True
        return node.target in ("to", "type") and any(isinstance(v, torch.dtype) for v in node.args)
    if isinstance(node.target, torch._ops.OpOverload):
        names = [argument.name for argument in node.target._schema.arguments]
        index = names.index("dtype") if "dtype" in names else len(node.args)
        return index < len(node.args) and isinstance(node.args[index], torch.dtype)
    return False


def _is_inplace(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        first = target._schema.arguments[:1]
        return bool(first) and first[0].alias_info is not None and first[0].alias_info.is_write
    name = op_name(node) or ""
    return name.endswith("_") and not name.startswith("_")
