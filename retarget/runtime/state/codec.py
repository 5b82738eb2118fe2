"""Save Python state trees without pickle: a JSON skeleton plus named tensors.

A checkpoint holds state that is mostly plain data (scheduler counters, learning rates, RNG
words, loader positions) with tensors in it. `torch.save` would pickle all of it, and loading a
pickle runs whatever code the file names. Instead a tree is split in two:

- the skeleton, JSON: `None`, bools, ints, floats (NaN and infinities included), strings and
  lists as themselves; tuples, dicts and tensors as tagged objects, so they come back as the
  same types (every dict is tagged, so a user dict can never pass for a tag);
- the tensors, by a name derived from their path (`"state/layers.0.weight/exp_avg"`), stored
  with safetensors, or handed to torch.distributed.checkpoint for model and optimizer state.

    >>> skeleton, tensors = encode({"lr": 0.1, "betas": (0.9, 0.99), "w": torch.ones(2)})
    >>> tensors
    {'w': tensor([1., 1.])}
    >>> decode(skeleton, tensors)
    {'lr': 0.1, 'betas': (0.9, 0.99), 'w': tensor([1., 1.])}

Anything else (functions, arbitrary objects, numpy arrays) is refused with its path, rather
than being pickled silently.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

_TUPLE, _DICT, _ITEMS, _TENSOR = "__tuple__", "__dict__", "__items__", "__tensor__"


class UnsupportedStateError(TypeError):
    """A value in a state tree is not plain data or a tensor, so it cannot be saved unpickled."""


def _escape(key: str) -> str:
    # "/" separates path components in tensor names; escaping keeps names unique.
    return key.replace("%", "%25").replace("/", "%2F")


def encode(tree: Any, *, where: str = "state") -> tuple[Any, dict[str, torch.Tensor]]:
    """Split `tree` into a JSON-ready skeleton and `{name: tensor}`.

    `where` names the tree in errors ("scheduler 0 state"). Tensors keep their identity (a
    DTensor stays a DTensor) so torch.distributed.checkpoint can save shards.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            name = path or "tensor"
            assert name not in tensors, f"two tensors named {name!r}"
            tensors[name] = value
            return {_TENSOR: name}
        if isinstance(value, tuple):
            return {_TUPLE: [walk(v, _join(path, str(i))) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, _join(path, str(i))) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            if all(isinstance(k, str) for k in value):
                return {_DICT: {k: walk(v, _join(path, _escape(k))) for k, v in value.items()}}
            items = []
            for i, (k, v) in enumerate(value.items()):
                if isinstance(k, torch.Tensor):
                    raise UnsupportedStateError(
                        f"{where}: a tensor is used as a dict key at {path!r}"
                    )
                items.append([walk(k, _join(path, f"[{i}]key")), walk(v, _join(path, f"[{i}]"))])
            return {_ITEMS: items}
        raise UnsupportedStateError(
            f"{where}: the value at {path or '<root>'!r} is a {type(value).__module__}."
            f"{type(value).__qualname__}; a checkpoint holds only tensors, None, bool, int, "
            "float, str, list, tuple and dict (it is never pickled). Return plain data from "
            "state_dict() instead"
        )

    return walk(tree, ""), tensors


def _join(path: str, part: str) -> str:
    return f"{path}/{part}" if path else part


def tensor_names(skeleton: Any) -> set[str]:
    """The names of the tensors a skeleton refers to."""
    names: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            if _TENSOR in node:
                names.add(node[_TENSOR])
            for child in node.values():
                walk(child)

    walk(skeleton)
    return names


def decode(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The tree `encode` split, with tensors taken from `tensors` by name."""
    if isinstance(skeleton, list):
        return [decode(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    ((tag, body),) = skeleton.items()
    if tag == _TENSOR:
        if body not in tensors:
            raise KeyError(f"tensor {body!r} is referred to by the saved state but was not loaded")
        return tensors[body]
    if tag == _TUPLE:
        return tuple(decode(v, tensors) for v in body)
    if tag == _DICT:
        return {k: decode(v, tensors) for k, v in body.items()}
    if tag == _ITEMS:
        return {decode(k, tensors): decode(v, tensors) for k, v in body}
    raise ValueError(f"unknown tag {tag!r} in a saved state skeleton")


def write_tree(stem: Path, tree: Any, *, where: str = "state") -> list[Path]:
    """Write `tree` as `<stem>.json` and `<stem>.safetensors`, each fsynced; the paths written."""
    skeleton, tensors = encode(tree, where=where)
    for name, t in tensors.items():
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            raise UnsupportedStateError(
                f"{where}: {name!r} is a {type(t).__name__}; only plain tensors are saved here "
                "(sharded tensors belong to the model or optimizer)"
            )
    json_path, tensor_path = stem.with_suffix(".json"), stem.with_suffix(".safetensors")
    with open(json_path, "w") as f:
        json.dump(skeleton, f)
        f.flush()
        os.fsync(f.fileno())
    # safetensors wants contiguous, unshared CPU tensors; these are small, so copy them.
    save_file(
        {k: t.detach().to("cpu").contiguous().clone() for k, t in tensors.items()}, tensor_path
    )
    fsync_file(tensor_path)
    return [json_path, tensor_path]


def read_tree(stem: Path) -> Any:
    """The tree `write_tree` wrote at `stem` (JSON and safetensors only: nothing is unpickled)."""
    with open(stem.with_suffix(".json")) as f:
        skeleton = json.load(f)
    return decode(skeleton, load_file(stem.with_suffix(".safetensors")))


def fsync_file(path: Path) -> None:
    """Flush a written file's data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
