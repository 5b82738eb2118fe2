"""A lighter non-reentrant checkpoint for a selective repeat's scoped graph (selective_scope.py).

Contract: `graph_checkpoint(forward, args, kwargs, contexts)` returns what
`torch.utils.checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)`
returns, with the same gradients bit for bit and the same bytes kept, for a call whose region
runs a scoped graph with no random op, outside autocast, with no stateful argument
(`applies` says so; checkpoint_blocks uses torch's checkpoint otherwise).

Why: on the bench model a selective block saves ~38 tensors for backward, and torch's checkpoint
handles each in Python three times (pack in forward with its metadata, pack again in recompute,
unpack), whatever the tensor: about half are parameters, buffers, the block's input or outputs
the selective modes keep anyway, which cost nothing to hold and need no recompute. Here:

- forward, under saved-tensor hooks: a tensor whose storage is already held (a parameter or
  buffer of the block, an input, a kept output) is saved as itself, with its version; any other
  gets a holder and is recomputed;
- the first unpack of a holder runs the forward again under the recompute context and grad mode,
  filling the holders in pack order (the graph is the same, so the packs come in the same order;
  a count that differs is an error), and stops after the last holder (checkpoint's early stop);
- a tensor saved as itself and then modified in place is refused at unpack, as autograd refuses
  it without checkpointing; a second backward through the block is refused by the replay
  (selective_scope), as with torch's form.

The RNG is not restored (there is no random op: `applies`), nor autocast (none is active).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

_DROPOUT_ARGS = ("p", "dropout_p")


class _Holder:
    __slots__ = ("__weakref__", "value")

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None


class _Stop(Exception):
    """Raised by the recompute's pack hook once every holder is filled (early stop)."""


class _Frame:
    """One checkpointed call: its holders in pack order and how to recompute them."""

    def __init__(self, forward: Callable, args: tuple, kwargs: dict, recompute: Any) -> None:
        self.forward, self.args, self.kwargs, self.recompute = forward, args, kwargs, recompute
        self.held: set[int] = set()
        self.order: list[bool] = []  # per pack in forward: recomputed (True) or saved as is
        self.holders: list[weakref.ref] = []
        self.last = -1

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.untyped_storage().data_ptr() in self.held:
            self.order.append(False)
            return (tensor.detach(), tensor._version)
        holder = _Holder()
        self.order.append(True)
        self.holders.append(weakref.ref(holder))
        self.last = len(self.order) - 1
        return holder

    def unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is tuple:
            tensor, version = packed
            if tensor._version != version:
                raise RuntimeError(
                    "checkpoint: a tensor saved for backward (a parameter, buffer, input or kept "
                    f"output of shape {tuple(tensor.shape)}) was modified in place after forward"
                )
            return tensor
        if packed.value is None:
            self._recompute()
        value, packed.value = packed.value, None
        if value is None:
            raise RuntimeError("checkpoint: the recompute did not produce a saved tensor")
        return value

    def _recompute(self) -> None:
        position = iter(range(len(self.order)))
        holders = iter(self.holders)

        def pack(tensor: torch.Tensor) -> None:
            index = next(position, None)
            if index is None:
                raise RuntimeError("checkpoint: the recompute saved more tensors than forward")
            if self.order[index]:
                holder = next(holders)()
                if holder is not None:
                    holder.value = tensor.detach()
            if index == self.last:
                raise _Stop

        def unpack(_: Any) -> None:
            raise RuntimeError("checkpoint: the recompute's own graph is never run backward")

        try:
            with (
                torch.enable_grad(),
                self.recompute,
                torch.autograd.graph.saved_tensors_hooks(pack, unpack),
            ):
                self.forward(*self.args, **self.kwargs)
        except _Stop:
            return
        raise RuntimeError("checkpoint: the recompute saved fewer tensors than forward")


def graph_checkpoint(
    module: nn.Module, forward: Callable, args: tuple, kwargs: dict, contexts: Callable
) -> Any:
    """`forward(*args, **kwargs)` checkpointed; see the module docstring."""
    forward_context, recompute_context = contexts()
    frame = _Frame(forward, args, kwargs, recompute_context)
    held = frame.held = forward_context.mode.store.held  # kept outputs join as they are kept
    for tensor in (*module.parameters(), *module.buffers()):
        held.add(tensor.untyped_storage().data_ptr())
    for value in tree_leaves((args, kwargs)):
        if isinstance(value, torch.Tensor):
            held.add(value.untyped_storage().data_ptr())
    held.discard(0)  # a storage with no data (freed, resized to 0) holds nothing
    with forward_context, torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return forward(*args, **kwargs)


def applies(gm: fx.GraphModule, args: tuple, kwargs: dict) -> bool:
    """Whether a call of scoped graph `gm` may use `graph_checkpoint`: no random op, no autocast
    active (on the CPU or the arguments' device), only plain tensors with storage (no meta, fake
    or subclass tensor, whose storage says nothing) and plain values among the arguments'
    leaves (a tuple of tensors is fine; a cache object is not)."""
    random = gm.meta.get("draws_random")
    if random is None:
        random = gm.meta["draws_random"] = draws_random(gm)
    if random or torch.is_autocast_enabled("cpu"):
        return False
    for value in tree_leaves((args, kwargs)):
        if isinstance(value, torch.Tensor):
            if type(value) not in _PLAIN or value.device.type == "meta":
                return False
            device = value.device.type
            if device != "cpu" and _autocast_on(device):
                return False
        elif not isinstance(value, int | float | bool | None):
            return False
    return True


_PLAIN = (torch.Tensor, nn.Parameter)


def _autocast_on(device: str) -> bool:
    return torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)


def draws_random(gm: fx.GraphModule) -> bool:
    """Whether a graph calls an op that draws random numbers (a dropout with a literal p of 0 or
    train False does not)."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if torch.Tag.nondeterministic_seeded not in target.tags:
            continue
        named = dict(zip((a.name for a in target._schema.arguments), node.args, strict=False))
        named.update(node.kwargs)
        if named.get("train", True) is False:
            continue
        if any(name in named and named[name] == 0 for name in _DROPOUT_ARGS):
            continue
        return True
    return False
