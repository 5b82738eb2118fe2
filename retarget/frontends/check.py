"""Accept a captured graph only if it reproduces eager bit for bit on the real inputs.

Both runs start from the same RNG state (so dropout draws the same mask) and the same buffers (so
BatchNorm statistics are not advanced twice); afterwards RNG and buffers are put back, so checking
leaves no trace on training. Stateful arguments (KV caches) are copied for each run, and the
objects they leave behind must be equal too: same structure, same tensors bit for bit.

Both run in the caller's grad mode (it is part of the call signature). The eager run also notes
whether the block checkpoints part of itself with torch.utils.checkpoint (seen only with grad
on): tracers inline that, so the graph then runs under checkpoint as a whole
(`CapturedGraph.checkpointed`) to keep the user's memory saving. With grad on, a block that
calls a user-defined autograd.Function (its own backward formula, Bloom's GeLU) is refused to
the frontends whose graphs would differentiate the Function's forward instead: the forward
would be bitwise and the gradients not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map_only

from retarget.frontends.binding import CapturedGraph
from retarget.frontends.state import copy_state_args, state_objects
from retarget.frontends.state_layers import layer_index, moved_state_args
from retarget.frontends.state_layout import is_state, layout


class CaptureMismatch(AssertionError):
    """The graph computes something other than the eager module."""


def check_against_eager(
    module: nn.Module, graph: CapturedGraph, args: tuple, kwargs: dict[str, Any]
) -> bool:
    """Raise CaptureMismatch unless `graph` run on `module` equals `module`'s eager forward.

    Returns whether the eager forward ran code under torch.utils.checkpoint.
    """
    private = graph.private_attributes(module)
    traced_at = None if graph.state is None else graph.state.index
    index = layer_index(module)
    if traced_at is not None and index is not None and index != traced_at:
        # Another repeat: its own cache entry is what the traced repeat's entry was.
        args, kwargs = moved_state_args(args, kwargs, traced_at, index)
    # The eager run starts its own autograd graph (inputs cut from their history, still asking
    # for grad), so what it records is this block's own backward.
    eager_args, eager_kwargs = tree_map_only(
        torch.Tensor, _fresh_leaf, copy_state_args(args, kwargs)
    )
    graph_args, graph_kwargs = copy_state_args(args, kwargs)
    watch = CheckpointWatch()
    # Both runs in the caller's grad mode: some eager kernels (matmul's batch folding) pick
    # another, not bit-identical, path without grad, and grad mode is part of the signature.
    with preserved_state(module):
        with preserved_state(module), watch:
            outputs = module.forward(*eager_args, **eager_kwargs)
        custom = custom_backwards(outputs)
        frontend = graph.gm.meta.get("frontend")
        if custom and frontend in GRAPHS_WITHOUT_CUSTOM_BACKWARD:
            raise CaptureMismatch(
                f"the block calls autograd.Function {custom[0]}, whose own backward a {frontend} "
                "graph does not keep (it differentiates the forward's ops instead)"
            )
        expected = _detached(outputs)
        got = _detached(graph.run(module, graph_args, graph_kwargs, private))
    mismatch = first_difference(expected, got)
    if mismatch:
        raise CaptureMismatch(f"graph output differs from eager: {mismatch}")
    expected_state = layout(state_objects(eager_args, eager_kwargs))
    got_state = layout(state_objects(graph_args, graph_kwargs))
    if expected_state[0] != got_state[0]:
        raise CaptureMismatch("the graph leaves a stateful argument (a cache) in another shape")
    mismatch = first_difference(expected_state[1], got_state[1])
    if mismatch:
        raise CaptureMismatch(f"the graph updates a stateful argument differently: {mismatch}")
    return watch.seen


def _detached(tree: Any) -> Any:
    return tree_map_only(torch.Tensor, torch.Tensor.detach, tree)


#: Frontends whose graphs inline an autograd.Function's forward and so lose its backward
#: (measured: Bloom's GeLUFunction under export gives gradients 1e-8 off); dynamo keeps the
#: Function (its graph calls it through autograd_function_apply) and gives eager's bit for bit.
GRAPHS_WITHOUT_CUSTOM_BACKWARD = ("export", "fx")


def _fresh_leaf(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.requires_grad:
        return tensor
    return tensor.detach().requires_grad_()


def custom_backwards(outputs: Any) -> list[str]:
    """Names of the user-defined autograd.Functions (torch's own aside) in the autograd graph
    behind `outputs`, in the order met walking back from them."""
    pending = [t.grad_fn for t in tree_flatten(outputs)[0] if torch.is_tensor(t) and t.grad_fn]
    seen: set[int] = set()
    found: list[str] = []
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        function = getattr(node, "_forward_cls", None)
        module = getattr(function, "__module__", "") or ""
        if function is not None and not module.startswith("torch."):
            found.append(f"{module}.{function.__qualname__}")
        pending.extend(next_node for next_node, _ in node.next_functions)
    return found


class CheckpointWatch(TorchFunctionMode):
    """Notes whether any torch call ran under torch.utils.checkpoint's saved-tensor hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.seen:
            hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
            self.seen = hooks is not None and hooks[0].__module__ == "torch.utils.checkpoint"
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def preserved_state(module: nn.Module) -> Iterator[None]:
    """Restore the RNG streams and the module's buffers on exit."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)


def first_difference(expected: Any, got: Any) -> str:
    """Describe the first difference between two output trees, or '' when they are equal."""
    flat_a, spec_a = tree_flatten(expected)
    flat_b, spec_b = tree_flatten(got)
    if spec_a != spec_b:
        return f"output structure {spec_b} instead of {spec_a}"
    for index, (a, b) in enumerate(zip(flat_a, flat_b, strict=True)):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return f"output {index}: {type(b).__name__} instead of {type(a).__name__}"
        if is_state(a) and type(a) is type(b):  # a returned cache: compare what it holds
            inner = first_difference(layout([a])[1], layout([b])[1])
            if layout([a])[0] != layout([b])[0] or inner:
                return f"output {index}: {type(a).__name__} holds other state {inner}".rstrip()
            continue
        if not isinstance(a, torch.Tensor):
            if a != b:
                return f"output {index}: {b!r} instead of {a!r}"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {index}: {b.dtype}{list(b.shape)} instead of {a.dtype}{list(a.shape)}"
        if not torch.equal(a, b) and not _equal_with_nan(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            return f"output {index}: max abs difference {diff:.3g}"
    return ""


def _equal_with_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.is_floating_point():
        return False
    both_nan = a.isnan() & b.isnan()
    return bool(((a == b) | both_nan).all())
