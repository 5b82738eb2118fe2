"""Run a captured graph's code against a live module.

fx code reads state as `self.layer1.conv.weight` and calls leaves as `self.layer1.conv(x)`. We run
the generated `forward` with `self` bound to a `_LiveSelf` that answers from the live module, so
parameters swapped by later passes (FSDP's unsharded views, FP8 modules) are seen at every call,
and one graph serves every repeat of a block. Names that belong to the graph itself (pytree
specs, lifted constants, export's guard function) are answered from the graph module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.graph_module import _copy_attr

from retarget.core.capturing import capturing
from retarget.frontends.state import StateCall, checkpointed_call
from retarget.frontends.state_layers import layer_index

_GRAPH_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {
    "_graph",
    "_code",
    "_lineno_map",
    "_prologue_start",
    "_tracer_cls",
    "_tracer_extras",
    "meta",
    "_replace_hooks",
    "_create_node_hooks",
    "_erase_node_hooks",
    "_deepcopy_hooks",
}


@dataclass
class CapturedGraph:
    """A graph module plus how to call it.

    `positional` lists the forward's parameter names when the graph takes every argument
    positionally (fx with concrete arguments renames placeholders); None means the graph's
    forward takes the module's own (args, kwargs). `state` is set when the call carries a
    stateful object (a KV cache): the graph then takes its tensors first and returns
    (output, tensors after), and `state` writes them back into the live object.
    """

    frontend: str
    gm: fx.GraphModule
    positional: tuple[str, ...] | None = None
    signature: Any = None
    state: StateCall | None = None
    dynamic_inputs: tuple[tuple[int, int], ...] = ()
    """(flat input index, dim) pairs the tracer left symbolic (`export.capture_dynamic`)."""
    dynamic: frozenset = frozenset()
    """The same, as positions in the call signature (`retarget.ir.region.call_key`)."""
    pattern: Any = None
    """The signature with the symbolic sizes blanked: which calls the graph may serve."""
    checkpointed: bool = False
    """The block checkpoints part of itself (torch.utils.checkpoint), which tracing inlines."""

    def run(
        self,
        live: nn.Module,
        args: tuple,
        kwargs: dict[str, Any],
        private: dict,
        call_forward: CallForward | None = None,
    ) -> Any:
        """Run the graph for `live`. `call_forward` replaces `call_graph_forward`, the call of the
        graph's own code, as a compiled version of it does (passes/compile); the KV-cache
        bookkeeping and argument binding around it stay outside."""
        if self.checkpointed and torch.is_grad_enabled() and not capturing():
            # Keep the user's memory saving: recompute the whole block in backward.
            return checkpointed_call(
                lambda *a, **k: self.run_graph(live, a, k, private, call_forward), args, kwargs
            )
        return self.run_graph(live, args, kwargs, private, call_forward)

    def run_graph(
        self,
        live: nn.Module,
        args: tuple,
        kwargs: dict[str, Any],
        private: dict,
        call_forward: CallForward | None = None,
    ) -> Any:
        call = call_graph_forward if call_forward is None else call_forward
        forward = type(self.gm).forward
        if self.state is not None:
            index = layer_index(live)
            return self.state.run(
                lambda *a, **k: call(forward, live, private, a, k), args, kwargs, index
            )
        if self.positional is None:
            return call(forward, live, private, args, kwargs)
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return call(forward, live, private, tuple(bound.arguments[n] for n in self.positional), {})

    def private_attributes(self, live: nn.Module) -> dict[str, Any]:
        """The graph module's own attributes that the live module does not have."""
        gm = self.gm
        names = {k for k in gm.__dict__ if k not in _GRAPH_MODULE_INTERNALS}
        names |= set(gm._modules) | set(gm._parameters) | set(gm._buffers)
        names.discard("forward")
        return {n: getattr(gm, n) for n in names if not _owns(live, n)}


def call_graph_forward(
    forward: Callable[..., Any], live: nn.Module, private: dict, args: tuple, kwargs: dict
) -> Any:
    """Call a graph module's generated `forward` with `self` answering from `live`."""
    return forward(_LiveSelf(live, private), *args, **kwargs)


#: `call_graph_forward`'s signature: what a compiled replacement of it takes.
CallForward = Callable[[Callable[..., Any], nn.Module, dict, tuple, dict], Any]


def _owns(module: nn.Module, name: str) -> bool:
    return name in module._modules or name in module._parameters or name in module._buffers


class _LiveSelf:
    """`self` for graph code: graph-private names first, then the live module."""

    def __init__(self, live: nn.Module, private: dict[str, Any]):
        self.__dict__.update(private)
        self.__dict__["_live"] = live

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_live"], name)


def relink_attributes(gm: fx.GraphModule, module: nn.Module) -> None:
    """Point get_attr nodes that read one of `module`'s tensors at that tensor's own path.

    dynamo lifts `self.l.weight` to a graph attribute `L__self___l_weight`; relinking by identity
    makes the graph read `l.weight` from whichever module it runs against.
    """
    paths: dict[int, str] = {}
    for path, tensor in module.named_parameters(remove_duplicate=False):
        paths.setdefault(id(tensor), path)
    for path, tensor in module.named_buffers(remove_duplicate=False):
        paths.setdefault(id(tensor), path)
    changed = False
    for node in gm.graph.find_nodes(op="get_attr"):
        value = _resolve(gm, node.target)
        path = paths.get(id(value))
        if path is not None and path != node.target:
            node.target = path
            _copy_attr(module, gm, path)  # keeps graph.lint() able to resolve the new path
            changed = True
        elif path is None and "." in node.target and _resolve(module, node.target) is None:
            # A constant the tracer made inside a submodule (export's `self_attn.lifted_tensor_0`
            # for a `torch.tensor([])` in the block's code): the live submodule lacks it, so
            # the graph keeps it under a top-level name of its own.
            name = "_const_" + node.target.replace(".", "_")
            setattr(gm, name, value)
            node.target = name
            changed = True
    if changed:
        gm.recompile()


def _resolve(root: nn.Module, path: str) -> Any:
    value: Any = root
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value
