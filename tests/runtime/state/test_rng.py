"""RngState: every generator a training step draws from continues exactly after a restore."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from retarget.core.errors import TargetNotSupportedError
from retarget.execution import xla_device as xla
from retarget.runtime.state.codec import read_tree, write_tree
from retarget.runtime.state.rng import RngState


def _draws():
    return (
        [random.random() for _ in range(3)],
        random.gauss(0, 1),  # leaves a cached gaussian in Python's state
        np.random.rand(3).tolist(),
        float(np.random.standard_normal()),
        torch.rand(4),
        torch.nn.functional.dropout(torch.ones(16), 0.5),
    )


def _same(a, b) -> bool:
    return all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


@pytest.fixture
def rng_restored():
    state = RngState.capture()
    yield
    state.restore()


def test_restore_repeats_python_numpy_and_torch_draws(rng_restored):
    random.gauss(0, 1)  # a cached gaussian inside the captured state
    np.random.standard_normal()
    saved = RngState.capture()
    first = _draws()
    assert not _same(first, _draws())  # the draws do move the generators
    saved.restore()
    assert _same(first, _draws())


def test_saved_to_files_and_back_without_pickle(tmp_path, rng_restored):
    saved = RngState.capture()
    first = _draws()
    write_tree(tmp_path / "rng", saved.to_tree())
    loaded = RngState.from_tree(read_tree(tmp_path / "rng"))
    _draws()
    loaded.restore()
    assert _same(first, _draws())
    assert saved.device is None  # CPU-only machine: no device generator


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks a CPU-only machine")
def test_device_state_without_a_device_is_refused(rng_restored):
    state = dataclasses.replace(
        RngState.capture(), device="cuda:0", device_state=torch.zeros(16, dtype=torch.uint8)
    )
    with pytest.raises(RuntimeError, match="generator of cuda:0.*no accelerator"):
        state.restore()


@pytest.mark.skipif(xla.available(), reason="checks the refusal where torch_xla is missing")
def test_an_xla_seed_without_torch_xla_is_refused_before_anything_is_restored(rng_restored):
    state = dataclasses.replace(RngState.capture(), xla_seed=12345)
    moved = random.random()
    with pytest.raises(TargetNotSupportedError, match="xla: torch_xla cannot be imported"):
        state.restore()
    assert random.random() != moved  # Python's generator was left where it was, not rewound
    assert RngState.capture().xla_seed is None  # a process without XLA saves no seed
