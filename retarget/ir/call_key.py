"""A region call's signature (`call_key`) and the per-repeat cache that makes a repeated call cheap.

`call_key` is what a captured graph is specialised to: the inputs' pytree structure, each leaf's
description (tensor shape/dtype/device/contiguity, a plain value, a KV cache's skeleton), the
train flags of the block's modules, grad mode and autocast state. Computing and hashing it costs
a pytree flatten, a walk of the block's modules and a hash of a pytree spec at every call.

The cache keeps per repeat module (in its `__dict__`, slot-style, never as a child):

- `BlockWalk`: the block's modules in `modules()` order, with a copy of each one's `_modules`
  dict. It is re-checked at every call by comparing those dicts (C-level dict equality: a child
  swapped by a pass or by the user, through `setattr` or the dict itself, added or deleted,
  makes it stale, and it is walked anew), then gives the train flags and whether any of the
  block's submodules (or torch's global module hooks) holds a hook at all (`ir/hooks.py` then
  decides whose it is).
- the last call's `quick_signature` (structure and tensor metadata of plain calls: tensors,
  None, bool/int/float/str, and flat tuples/lists of those; anything else returns None and takes
  the full key) with the train flags, grad/autocast state and the graph that call used. A call
  whose quick token equals the last one reuses that graph without building or hashing the full
  key, as long as the region's graph table is unchanged (`Region.graph_epoch`).

Equal quick tokens imply equal `call_key`s: the token holds the same facts (structure, leaf
descriptions, flags, autocast) for the subset of calls it accepts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_globals
from torch.utils._pytree import tree_flatten

from retarget.core.slots import BLOCK_WALK, LAST_CALL
from retarget.frontends.state import describe_state
from retarget.frontends.state_layers import layer_index
from retarget.frontends.state_layout import is_state
from retarget.ir.hooks import GLOBAL_KINDS, HOOK_KINDS

_HOOK_ATTRIBUTES = tuple(attribute for attribute, _ in HOOK_KINDS)
_GLOBAL_HOOKS = tuple(getattr(module_globals, attribute) for attribute, _ in GLOBAL_KINDS)
_PLAIN = (bool, int, float, str)


def call_key(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """What a captured graph is specialised to: input structure, shapes, flags, autocast."""
    leaves, spec = tree_flatten((args, kwargs))
    index = layer_index(module)
    described = tuple(_describe(leaf, index) for leaf in leaves)
    # The walk is re-checked every call (passes may swap submodules after the first call).
    training = block_walk(module).training()
    return (spec, described, training, autocast_state())


def autocast_state() -> tuple:
    return (
        torch.is_grad_enabled(),  # eager picks some kernels by it (matmul's batch folding)
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
    )


class BlockWalk:
    """A block's modules, valid while no `_modules` dict under it changed."""

    __slots__ = ("modules", "snapshots", "sub_dicts")

    def __init__(self, root: nn.Module):
        self.modules = tuple(root.modules())
        self.snapshots = tuple((m.__dict__, m._modules, dict(m._modules)) for m in self.modules)
        self.sub_dicts = tuple(m.__dict__ for m in self.modules[1:])  # root hooks run around

    def current(self) -> bool:
        for attributes, children, snapshot in self.snapshots:
            # Edited in place (a swap, an addition, a deletion) or replaced whole.
            if attributes["_modules"] is not children or children != snapshot:
                return False
        return True

    def training(self) -> tuple[bool, ...]:
        return tuple([m.training for m in self.modules])

    def may_hold_hooks(self) -> bool:
        """Whether any submodule or the global module hooks hold a hook (anyone's)."""
        if any(_GLOBAL_HOOKS):
            return True
        for d in self.sub_dicts:
            for attribute in _HOOK_ATTRIBUTES:
                if d.get(attribute):
                    return True
        return False


def block_walk(module: nn.Module) -> BlockWalk:
    """`module`'s walk, checked against its current children (walked anew when stale)."""
    walk = BLOCK_WALK.get(module)
    # A copy of the module (compile_for's structural copy) carries the original's walk: not its.
    if walk is None or walk.modules[0] is not module or not walk.current():
        walk = BLOCK_WALK.set(module, BlockWalk(module))
    return walk


def quick_signature(args: tuple, kwargs: dict) -> tuple | None:
    """The call's structure and leaf descriptions for plain calls; None for any other call."""
    parts: list[Any] = [len(args), tuple(kwargs)]
    for value in (*args, *kwargs.values()):
        described = _quick(value)
        if described is None and value is not None:
            return None
        parts.append(described)
    return tuple(parts)


def _quick(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device, value.is_contiguous())
    kind = type(value)
    if kind in _PLAIN:
        return (kind, value)
    if kind is tuple or kind is list:
        items = []
        for item in value:
            if isinstance(item, torch.Tensor):
                items.append((tuple(item.shape), item.dtype, item.device, item.is_contiguous()))
            elif item is None:
                items.append(None)
            elif type(item) in _PLAIN:
                items.append((type(item), item))
            else:
                return None
        return (kind, tuple(items))
    return None  # None itself, or something the full key describes


def last_call(module: nn.Module) -> tuple | None:
    """(token, graph, region, epoch) of `module`'s last call that used a graph, or None."""
    return LAST_CALL.get(module)


def remember_call(module: nn.Module, token: tuple, graph: Any, region: Any, epoch: tuple) -> None:
    LAST_CALL.set(module, (token, graph, region, epoch))


def masked_key(key: tuple, dynamic: frozenset) -> tuple:
    """`call_key`'s value with the sizes at `dynamic` positions (a graph's symbolic ones) blanked.

    Positions are ("leaf", i, dim) for the i-th flat argument, or ("state", i, t, dim) for the
    t-th tensor of the stateful argument at flat position i.
    """
    spec, described, training, autocast = key
    described = list(described)
    for position in sorted(dynamic, key=repr):
        if position[0] == "leaf":
            _, i, dim = position
            if not isinstance(described[i], tuple) or len(described[i]) != 4:
                return (spec, None, training, autocast)
            shape, *rest = described[i]
            described[i] = (_blank(shape, dim), *rest)
        else:
            _, i, t, dim = position
            if not (isinstance(described[i], tuple) and described[i][:1] == ("state",)):
                return (spec, None, training, autocast)
            tag, skeleton, metas = described[i]
            if t >= len(metas):
                return (spec, None, training, autocast)
            metas = list(metas)
            shape, *rest = metas[t]
            metas[t] = (_blank(shape, dim), *rest)
            described[i] = (tag, skeleton, tuple(metas))
    return (spec, tuple(described), training, autocast)


def _blank(shape: Any, dim: int) -> tuple:
    if not isinstance(shape, tuple) or dim >= len(shape):
        return ("no such size", shape)  # another structure: never equal to the pattern
    return (*shape[:dim], None, *shape[dim + 1 :])


def _describe(leaf: Any, index: int | None) -> Any:
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device, leaf.is_contiguous())
    if is_state(leaf):  # a KV cache: its structure and its tensors' shapes, not its identity
        return describe_state(leaf, index)
    try:
        hash(leaf)
    except TypeError:
        return (type(leaf), id(leaf))
    return (type(leaf), leaf)
