"""Walk the nested containers batches and metrics come in: dict/Mapping, list, tuple, namedtuple.

Data sharding moves every tensor of a batch to the device; collectives gather, pad or broadcast
every tensor of a structure and must put results back where they came from. Both need the same
two things, written once here: apply a function to each tensor leaf keeping the containers'
types (an HF `BatchEncoding` stays a `BatchEncoding`, a namedtuple stays that namedtuple), and
list the leaves with a readable path so an error can say which one is wrong.

    >>> batch = {"input_ids": torch.zeros(2, 3), "meta": ("a", torch.ones(2))}
    >>> [path for path, _ in tensor_leaves(batch)]
    ["['input_ids']", "['meta'][1]"]
    >>> send_to_device(batch, "meta")["meta"][1].device
    device(type='meta')
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """`data` with every tensor leaf replaced by `fn(leaf)`; containers keep their type."""
    return map_leaves(fn, data, torch.Tensor)


def map_leaves(fn: Callable[[Any], Any], data: Any, kind: type) -> Any:
    """`data` with every leaf that is an instance of `kind` replaced by `fn(leaf)`."""
    return map_structure(fn, data, lambda value: isinstance(value, kind))


def map_structure(fn: Callable[[Any], Any], data: Any, is_leaf: Callable[[Any], bool]) -> Any:
    """`data` with every value for which `is_leaf` holds (outermost first) replaced by `fn`."""
    if is_leaf(data):
        return fn(data)
    if isinstance(data, Mapping):
        return _rebuild_mapping(data, {k: map_structure(fn, v, is_leaf) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(type(data), "_fields"):
        return type(data)(*(map_structure(fn, v, is_leaf) for v in data))
    if isinstance(data, (list, tuple)) and not isinstance(data, torch.Size):
        return type(data)(map_structure(fn, v, is_leaf) for v in data)
    return data


def _rebuild_mapping(original: Mapping, values: dict) -> Mapping:
    # copy-then-assign keeps a mapping's own state (BatchEncoding's encodings, ModelOutput's
    # attributes, a defaultdict's factory) that building a new one from a dict would lose.
    if not isinstance(original, MutableMapping):
        return values
    rebuilt = copy.copy(original)
    for key, value in values.items():
        rebuilt[key] = value
    return rebuilt


def leaves(data: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every non-container value in `data` with its path, depth first, in container order."""
    if isinstance(data, Mapping):
        for key, value in data.items():
            yield from leaves(value, f"{path}[{key!r}]")
    elif isinstance(data, (list, tuple)) and not isinstance(data, torch.Size):
        for i, value in enumerate(data):
            yield from leaves(value, f"{path}[{i}]")
    else:
        yield path or "<root>", data


def tensor_leaves(data: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors in `data` with their paths, in the order `replace_tensors` expects."""
    return [(path, value) for path, value in leaves(data) if isinstance(value, torch.Tensor)]


def replace_tensors(data: Any, tensors: list[torch.Tensor]) -> Any:
    """`data` with its tensor leaves replaced, in `tensor_leaves` order, by `tensors`."""
    supply = iter(tensors)
    return map_tensors(lambda _: next(supply), data)


def send_to_device(data: Any, device: torch.device | str) -> Any:
    """Every tensor of `data` on `device` (pinned host tensors are copied asynchronously)."""
    device = torch.device(device)
    return map_tensors(
        lambda t: t.to(device, non_blocking=device.type != "cpu" and t.is_pinned()), data
    )
