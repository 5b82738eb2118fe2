"""state_codec: state trees round-trip through JSON + safetensors, and nothing is pickled."""

from __future__ import annotations

import json
import math

import pytest
import torch

from retarget.runtime.state.codec import (
    UnsupportedStateError,
    decode,
    encode,
    read_tree,
    tensor_names,
    write_tree,
)


def _tree():
    return {
        "lr": 0.1,
        "betas": (0.9, 0.999),
        "flags": [True, None, "x"],
        "by_step": {0: 1.5, 7: -2.0, (1, 2): "pair"},
        "limits": {"best": math.inf, "worst": -math.inf},
        "w": torch.arange(6.0).reshape(2, 3),
        "nested": {"a/b": torch.ones(2, dtype=torch.bool), "a": {"b": torch.zeros(1)}},
        "gen": torch.Generator().manual_seed(3).get_state(),
    }


def _assert_same(a, b) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_round_trip_keeps_types_keys_and_tensors():
    skeleton, tensors = encode(_tree())
    json.dumps(skeleton)  # the skeleton is plain JSON
    # A key with "/" does not collide with the nested path a -> b.
    assert set(tensors) == {"w", "nested/a%2Fb", "nested/a/b", "gen"}
    assert tensor_names(skeleton) == set(tensors)
    _assert_same(decode(json.loads(json.dumps(skeleton)), tensors), _tree())


def test_nan_survives_json():
    skeleton, _ = encode({"x": math.nan})
    assert math.isnan(decode(json.loads(json.dumps(skeleton)), {})["x"])


def test_write_and_read_files(tmp_path):
    paths = write_tree(tmp_path / "rank_0", _tree())
    assert sorted(p.name for p in paths) == ["rank_0.json", "rank_0.safetensors"]
    _assert_same(read_tree(tmp_path / "rank_0"), _tree())


def test_refuses_objects_that_would_need_pickle_and_names_the_path():
    with pytest.raises(UnsupportedStateError, match=r"scheduler 0: .*'lr_lambdas/0'.*function"):
        encode({"lr_lambdas": [lambda step: 1.0]}, where="scheduler 0")
    with pytest.raises(UnsupportedStateError, match="tensor is used as a dict key"):
        encode({torch.ones(1): 1})


def test_missing_tensor_is_named():
    skeleton, _ = encode({"w": torch.ones(1)})
    with pytest.raises(KeyError, match="'w'"):
        decode(skeleton, {})
