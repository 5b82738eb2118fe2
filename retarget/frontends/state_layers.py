"""Per-layer narrowing of a cache: each repeat of a block sees only its own layer's entry.

A cache holds one entry per layer; a block reads and updates only the entry at its own
`layer_idx`, which its code passes to the cache as a Python int. A graph traced at layer 0 thus
indexes entry 0. Narrowing presents every repeat's entry at the traced position, so one graph
serves every layer, and `widen` puts the result back at the repeat's own position.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from retarget.frontends.state_layout import is_state


def layer_index(module: nn.Module) -> int | None:
    """The layer number a block passes to its cache (HF's `layer_idx`), or None."""
    for sub in module.modules():
        index = sub.__dict__.get("layer_idx")
        if type(index) is int:
            return index
    return None


def narrow(objects: list[Any], index: int, to: int) -> list[Any]:
    """Copies of `objects` holding only layer `index`'s entries, moved to position `to`.

    A cache holds one entry per layer in its first-level lists (`cache.layers`) and int-keyed
    dicts (`is_updated`); a block touches only its own. The copy keeps, in each such container
    reached before any other, only the entry at `index`, placed at `to` (the other places hold
    None), so every repeat of a block presents the same layout (`to` = 0 in the call signature)
    and one graph, traced at its own index, serves them all. Lists too short to hold both
    positions are copied whole. Tensors are shared, not copied.
    """
    memo: dict[int, Any] = {}
    return [_narrow(obj, index, to, memo, narrowed=False) for obj in objects]


def _per_layer(value: Any, index: int, to: int) -> bool:
    if type(value) is list:
        return len(value) > max(index, to)
    return type(value) is dict and all(type(k) is int for k in value)


def _narrow(value: Any, index: int, to: int, memo: dict[int, Any], narrowed: bool) -> Any:
    if (
        isinstance(value, torch.Tensor)
        or not isinstance(value, (list, dict))
        and not is_state(value)
    ):
        return value
    if id(value) in memo:
        return memo[id(value)]
    if not narrowed and _per_layer(value, index, to):
        if type(value) is list:
            out: Any = [None] * len(value)
            memo[id(value)] = out
            out[to] = _narrow(value[index], index, to, memo, narrowed=True)
        else:
            out = {}
            memo[id(value)] = out
            if index in value:
                out[to] = _narrow(value[index], index, to, memo, narrowed=True)
        return out
    if type(value) is list:
        out = []
        memo[id(value)] = out
        out.extend(_narrow(v, index, to, memo, narrowed) for v in value)
        return out
    if type(value) is dict:
        out = {}
        memo[id(value)] = out
        out.update((k, _narrow(v, index, to, memo, narrowed)) for k, v in value.items())
        return out
    if not is_state(value):  # tuples and other leaves are values: kept as they are
        return value
    out = type(value).__new__(type(value))
    memo[id(value)] = out
    out.__dict__.update((k, _narrow(v, index, to, memo, narrowed)) for k, v in vars(value).items())
    return out


def widen(live: list[Any], narrowed: list[Any], index: int, to: int) -> None:
    """Write what a graph left in `narrow(live, index, to)` back into `live`, in place."""
    memo: set[int] = set()
    for obj, small in zip(live, narrowed, strict=True):
        _widen(obj, small, index, to, memo, narrowed=False)


def _widen(live: Any, small: Any, index: int, to: int, memo: set[int], narrowed: bool) -> Any:
    """`live` updated from `small` (same kind, same place), or `small` itself to replace it."""
    if type(live) is not type(small) or not isinstance(live, (list, dict)) and not is_state(live):
        return small
    if id(live) in memo:
        return live
    memo.add(id(live))
    if not narrowed and _per_layer(live, index, to):
        if type(live) is list:
            live[index] = _widen(live[index], small[to], index, to, memo, narrowed=True)
        elif to in small:
            live[index] = _widen(live.get(index), small[to], index, to, memo, narrowed=True)
        else:
            live.pop(index, None)
        return live
    if type(live) is list:
        live[:] = [
            _widen(live[i] if i < len(live) else None, v, index, to, memo, narrowed)
            for i, v in enumerate(small)
        ]
        return live
    if type(live) is dict:
        merged = {k: _widen(live.get(k), v, index, to, memo, narrowed) for k, v in small.items()}
        live.clear()
        live.update(merged)
        return live
    fields = vars(live)
    merged = {
        k: _widen(fields.get(k), v, index, to, memo, narrowed) for k, v in vars(small).items()
    }
    fields.clear()
    fields.update(merged)
    return live


def moved_state_args(args: tuple, kwargs: dict, index: int, to: int) -> tuple[tuple, dict]:
    """(args, kwargs) with each stateful object narrowed to layer `index`'s entry, moved to `to`.

    What repeat `to` of a block would see if it received repeat `index`'s state: checking a
    graph on another repeat with "the same inputs" means this for a cache.
    """
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if is_state(leaf)]
    for i, moved in zip(positions, narrow([leaves[i] for i in positions], index, to), strict=True):
        leaves[i] = moved
    return tree_unflatten(leaves, spec)


__all__ = ["layer_index", "moved_state_args", "narrow", "widen"]
