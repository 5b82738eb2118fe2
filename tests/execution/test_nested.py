"""Nested structures: tensors mapped with the containers' own types kept, leaves with paths."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple

import torch
from transformers import BatchEncoding

from retarget.execution.nested import (
    leaves,
    map_structure,
    replace_tensors,
    send_to_device,
    tensor_leaves,
)

Pair = namedtuple("Pair", "a b")


def test_containers_keep_their_types_and_state():
    encoding = BatchEncoding({"input_ids": torch.zeros(2, 3)}, n_sequences=1)
    counts = defaultdict(list, {"x": torch.ones(1)})
    data = {
        "enc": encoding,
        "pair": Pair(torch.ones(2), "label"),
        "ordered": OrderedDict(z=torch.ones(1), a=torch.zeros(1)),
        "counts": counts,
        "shape": torch.Size([2, 3]),
        "list": [torch.ones(1), (torch.ones(1), 3)],
    }
    moved = send_to_device(data, "meta")
    assert isinstance(moved["enc"], BatchEncoding) and moved["enc"].n_sequences == 1
    assert moved["enc"]["input_ids"].is_meta and not encoding["input_ids"].is_meta
    assert isinstance(moved["pair"], Pair) and moved["pair"].b == "label"
    assert list(moved["ordered"]) == ["z", "a"] and isinstance(moved["ordered"], OrderedDict)
    assert moved["counts"].default_factory is list and moved["counts"]["x"].is_meta
    assert moved["shape"] == torch.Size([2, 3]) and isinstance(moved["shape"], torch.Size)
    assert moved["list"][1][0].is_meta and moved["list"][1][1] == 3


def test_leaves_paths_and_replacement_order():
    data = {"a": [torch.zeros(1), "s"], "b": Pair(torch.ones(1), torch.full((1,), 2.0))}
    assert [path for path, _ in leaves(data)] == [
        "['a'][0]",
        "['a'][1]",
        "['b'][0]",
        "['b'][1]",
    ]
    assert [path for path, _ in tensor_leaves(data)] == ["['a'][0]", "['b'][0]", "['b'][1]"]
    assert [path for path, _ in leaves(torch.zeros(1))] == ["<root>"]
    swapped = replace_tensors(data, [torch.tensor([7.0]), torch.tensor([8.0]), torch.tensor([9.0])])
    assert swapped["a"][0].item() == 7 and swapped["a"][1] == "s"
    assert (swapped["b"].a.item(), swapped["b"].b.item()) == (8, 9)


def test_map_structure_stops_at_the_outermost_leaf():
    data = {"names": ["x", "y"], "t": torch.zeros(1)}
    lifted = map_structure(len, data, lambda v: isinstance(v, list))
    assert lifted["names"] == 2 and lifted["t"] is data["t"]
