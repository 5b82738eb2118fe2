"""The layout of a stateful object: its tensors as a flat list, the rest as a skeleton.

A skeleton is a hashable value (classes, ints, flags, list and dict shapes) with each tensor
replaced by its index in the flat list; `rebuild` is the inverse of `layout`, and `write_back`
makes live objects equal to a rebuild while keeping their identity. `state.py` says why.
"""

from __future__ import annotations

import enum
import types
from typing import Any

import torch
from torch import nn

# Skeleton nodes are tuples, so a skeleton is hashable and compares by value:
#   ("t", i)  tensor i of the layout        ("v", value)  a plain, hashable value
#   ("o", cls, ((name, node), ...))         ("l", nodes) list, ("u", nodes) tuple
#   ("d", ((key, node), ...)) dict          ("r", k) the k-th object seen (an alias)
#   ("x", id) an unhashable opaque value (never equal across calls: a new signature)
Skeleton = tuple

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_OPAQUE = (nn.Module, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def is_state(value: Any) -> bool:
    """Whether a call argument (a pytree leaf) is a stateful object to lift."""
    if isinstance(value, (torch.Tensor, *_PLAIN, *_OPAQUE, enum.Enum)):
        return False
    return hasattr(value, "__dict__")


class _Layout:
    """Walks objects into skeletons, collecting tensors (deduplicated by identity)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._tensor_index: dict[int, int] = {}
        self._seen: dict[int, int] = {}
        self._keep: list[Any] = []  # keeps walked objects alive so ids stay unique

    def node(self, value: Any) -> Skeleton:
        if isinstance(value, torch.Tensor):
            index = self._tensor_index.get(id(value))
            if index is None:
                index = self._tensor_index[id(value)] = len(self.tensors)
                self.tensors.append(value)
            return ("t", index)
        if isinstance(value, (*_PLAIN, enum.Enum)):
            return ("v", value)
        if isinstance(value, (list, tuple, dict)) or is_state(value):
            if id(value) in self._seen:
                return ("r", self._seen[id(value)])
            self._seen[id(value)] = len(self._seen)
            self._keep.append(value)
        if isinstance(value, list):
            return ("l", tuple(self.node(v) for v in value))
        if isinstance(value, tuple):
            return ("u", tuple(self.node(v) for v in value))
        if isinstance(value, dict):
            return ("d", tuple((k, self.node(v)) for k, v in value.items()))
        if is_state(value):
            fields = tuple((k, self.node(v)) for k, v in vars(value).items())
            return ("o", type(value), fields)
        try:
            hash(value)
        except TypeError:
            return ("x", id(value))
        return ("v", value)


def layout(objects: list[Any]) -> tuple[tuple[Skeleton, ...], list[torch.Tensor]]:
    """The skeletons of `objects` (aliases shared across them) and the tensors they hold."""
    walker = _Layout()
    skeletons = tuple(walker.node(obj) for obj in objects)
    return skeletons, walker.tensors


def rebuild(skeletons: tuple[Skeleton, ...], tensors: list[torch.Tensor]) -> list[Any]:
    """New objects of the skeletons' classes holding `tensors`: the inverse of `layout`."""
    made: list[Any] = []
    return [_build(node, tensors, made) for node in skeletons]


def _build(node: Skeleton, tensors: list[torch.Tensor], made: list[Any]) -> Any:
    kind = node[0]
    if kind == "t":
        return tensors[node[1]]
    if kind == "v":
        return node[1]
    if kind == "r":
        return made[node[1]]
    if kind == "x":
        raise TypeError("a stateful argument holds an unhashable value that cannot be rebuilt")
    if kind == "u":
        made.append(None)  # tuples are immutable: an alias to one resolves to its rebuild below
        slot = len(made) - 1
        built = tuple(_build(n, tensors, made) for n in node[1])
        made[slot] = built
        return built
    if kind == "l":
        out: Any = []
        made.append(out)
        out.extend(_build(n, tensors, made) for n in node[1])
        return out
    if kind == "d":
        out = {}
        made.append(out)
        for key, value in node[1]:
            out[key] = _build(value, tensors, made)
        return out
    cls, fields = node[1], node[2]
    obj = cls.__new__(cls)
    made.append(obj)
    for name, value in fields:
        obj.__dict__[name] = _build(value, tensors, made)
    return obj


def write_back(live: list[Any], skeletons: tuple[Skeleton, ...], tensors: list[torch.Tensor]):
    """Make the `live` objects equal to `rebuild(skeletons, tensors)`, keeping their identity.

    Objects, lists and dicts found at the same place with the same type are updated in place
    (a caller holding `cache.layers[0]` sees the update); anything else is built new.
    """
    made: list[Any] = []
    for obj, node in zip(live, skeletons, strict=True):
        _update(obj, node, tensors, made)


def _update(current: Any, node: Skeleton, tensors: list[torch.Tensor], made: list[Any]) -> Any:
    kind = node[0]
    if kind == "l" and type(current) is list:
        made.append(current)
        items = [
            _update(current[i] if i < len(current) else None, n, tensors, made)
            for i, n in enumerate(node[1])
        ]
        current[:] = items
        return current
    if kind == "d" and type(current) is dict:
        made.append(current)
        items = {k: _update(current.get(k), n, tensors, made) for k, n in node[1]}
        current.clear()
        current.update(items)
        return current
    if kind == "o" and type(current) is node[1]:
        made.append(current)
        fields = {k: _update(current.__dict__.get(k), n, tensors, made) for k, n in node[2]}
        current.__dict__.clear()
        current.__dict__.update(fields)
        return current
    return _build(node, tensors, made)


def describe(skeleton: Skeleton, tensors: list[torch.Tensor]) -> tuple:
    """A hashable signature of a laid-out state: its skeleton and its tensors' metadata."""
    return (
        "state",
        skeleton,
        tuple((tuple(t.shape), t.dtype, t.device, t.is_contiguous()) for t in tensors),
    )


__all__ = ["Skeleton", "describe", "is_state", "layout", "rebuild", "write_back"]
