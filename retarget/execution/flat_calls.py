"""A graph's compiled call on flat inputs: pytree specs and export's input check stay outside.

A graph module from `torch.export` (`ep.module()`) takes the block's (args, kwargs), flattens them
against `self._in_spec`, calls `self._guards_fn` (export's re-check of the input shapes) and
rebuilds its output with `self._out_spec`. Compiled as it is, dynamo guards each of those objects
at every call, and the two specs share children, which costs an aliasing guard evaluated as
Python (a Llama layer: 461 guard lines against 390 for `layer.compile()`).

`FlatGraph` is the same graph with plain code generation (flat inputs in, flat outputs out) and
without the `_guards_fn` call: the region's call signature (`ir/call_key.py`) already pins every
input's structure, shape, dtype and device before a graph is chosen, and the uncompiled path
(`CapturedGraph.run`, used for captures, checks and fallback) still runs export's check. What is
compiled is `binding.call_graph_forward` of the flat code, so dynamo sees only tensors and the
live module; flattening and rebuilding the output run in Python around the compiled call, the
way the generated code did them. A graph without pytree code (fx, positional) has no flat form:
`FlatGraph.of` returns None and the graph's own code is compiled as before.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

from torch import fx
from torch.fx import _pytree as fx_pytree
from torch.fx.graph import CodeGen, _PyTreeCodeGen
from torch.utils import _pytree as pytree

from retarget.frontends.binding import CallForward

#: export's input check: a call_module node on the graph module's own `_guards_fn`.
EXPORT_GUARDS = "_guards_fn"


_LEAF, _EMPTY, _SEQUENCE, _TREE = "leaf", "empty", "sequence", "tree"


def _plan(spec: Any) -> tuple[str, Any, int]:
    """How one input's leaves are taken, as `tree_flatten_spec` would take them: the value itself
    (a leaf), nothing (None), a tuple/list of leaves as it is, or `tree_flatten_spec` itself."""
    if spec.is_leaf():
        return (_LEAF, spec, 1)
    if spec.type is type(None):
        return (_EMPTY, spec, 0)
    if spec.type in (tuple, list) and all(child.is_leaf() for child in spec.children()):
        return (_SEQUENCE, spec, spec.num_children)
    return (_TREE, spec, 0)


class FlatGraph:
    """One graph's flat form, and the Python that flattens a call for it."""

    def __init__(self, gm: fx.GraphModule, info: Any, names: tuple[str, ...]):
        self.source_forward = type(gm).forward
        """The forward this was made from: a later rewrite of the graph makes a new one."""
        self.in_spec = info.in_spec
        self.out_spec = info.out_spec
        self.names = names
        spec = self.in_spec
        self.split = (  # the codegen's test for an (args, kwargs) input tree
            spec.type is tuple
            and spec.num_children == 2
            and spec.child(0).type is tuple
            and spec.child(1).type is dict
        )
        self.count = spec.child(0).num_children if self.split else len(names)
        self.keys = tuple(spec.child(1).context) if self.split else ()
        tops = spec.children()
        if self.split:
            tops = [*spec.child(0).children(), *spec.child(1).children()]
        self.plan = tuple(_plan(child) for child in tops) if len(tops) == len(names) else None
        """Per input, how its leaves are taken (`_plan`); None: always `tree_flatten_spec`."""
        graph = copy.deepcopy(gm.graph)
        for node in list(graph.find_nodes(op="call_module", target=EXPORT_GUARDS)):
            if not node.users:
                graph.erase_node(node)
        graph._codegen = CodeGen()
        self.gm = fx.GraphModule(gm, graph)
        self.forward = type(self.gm).forward
        self.roots = tuple(
            sorted(
                {
                    str(node.target).split(".")[0]
                    for node in graph.nodes
                    if node.op in ("get_attr", "call_module")
                }
            )
        )
        """The first names of what the flat code reads from `self` (private or live)."""
        self.signature = inspect.signature(self.source_forward)
        self._private: tuple[dict, dict] | None = None

    @classmethod
    def of(cls, gm: fx.GraphModule) -> FlatGraph | None:
        """The flat form of a graph with pytree code (export's), else None."""
        codegen = gm.graph._codegen
        info = getattr(codegen, "pytree_info", None)
        if not isinstance(codegen, _PyTreeCodeGen) or info is None or info.in_spec is None:
            return None
        names = tuple(info.orig_args)
        if names[:1] == ("self",):
            return None  # a module's own `self` among the inputs: not export's form
        return cls(gm, info, names)

    def inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        """The call's flat inputs, as the graph's own code flattens them."""
        names = self.names
        if len(args) + len(kwargs) == len(names):
            try:
                values = (*args, *(kwargs[n] for n in names[len(args) :]))
            except KeyError:
                values = self._bound(args, kwargs)
        else:
            values = self._bound(args, kwargs)
        if self.plan is not None:
            flat: list[Any] = []
            for value, (mode, spec, size) in zip(values, self.plan, strict=True):
                if mode is _LEAF:
                    flat.append(value)
                elif mode is _SEQUENCE and type(value) is spec.type and len(value) == size:
                    flat.extend(value)
                elif not (mode is _EMPTY and value is None):
                    flat.extend(fx_pytree.tree_flatten_spec(value, spec))
            return flat
        if self.split:
            keyed = dict(zip(self.keys, values[self.count :], strict=True))
            tree: Any = (list(values[: self.count]), keyed)
        else:
            tree = list(values)
        return fx_pytree.tree_flatten_spec(tree, self.in_spec)

    def _bound(self, args: tuple, kwargs: dict) -> tuple:
        bound = self.signature.bind(None, *args, **kwargs)  # raises as the graph's call would
        return tuple(bound.arguments[n] for n in self.names)

    def output(self, flat: Any) -> Any:
        if self.out_spec is None:
            return flat
        return pytree.tree_unflatten(list(flat), self.out_spec)

    def private(self, private: dict) -> dict:
        """The graph-private values the flat code reads (none for most blocks)."""
        held = self._private
        if held is not None and held[0] is private:
            return held[1]
        flat = {n: private[n] for n in self.roots if n in private}
        self._private = (private, flat)
        return flat

    def call_forward(self, compiled: CallForward) -> CallForward:
        """A `CallForward` that runs `compiled` (a compile of `call_graph_forward`) flat."""

        def flat_call(
            forward: Callable[..., Any], live: Any, private: dict, args: tuple, kwargs: dict
        ) -> Any:
            if forward is not self.source_forward:
                raise RuntimeError("flat graph called for another graph's code")
            flat = self.inputs(args, kwargs)
            return self.output(compiled(self.forward, live, self.private(private), flat, {}))

        return flat_call
