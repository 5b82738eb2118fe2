"""Example inputs from a loader batch: used when the batch says how the model is called."""

from __future__ import annotations

import random

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from retarget.compat.accelerate.example_inputs import example_inputs_for, first_batch


class OneInput(nn.Module):
    def forward(self, x):
        return x


class TwoInputs(nn.Module):
    def forward(self, x, mask=None):
        return x


class Keywords(nn.Module):
    def forward(self, input_ids=None, labels=None):
        return input_ids


class DictSamples(Dataset):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return {"input_ids": torch.full((3,), i), "labels": torch.tensor(i)}


def test_first_batch_is_the_first_samples_per_process_without_drawing_randomness():
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4, shuffle=True)
    torch_state, python_state = torch.random.get_rng_state(), random.getstate()
    (values,) = first_batch(loader, split=2)
    assert torch.equal(values, torch.tensor([0.0, 1.0]))
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    assert random.getstate() == python_state


def test_batch_shapes_that_match_the_forward():
    pairs = DataLoader(TensorDataset(torch.randn(6, 2), torch.arange(6)), batch_size=3)
    assert example_inputs_for(OneInput(), pairs, 1, torch.device("cpu")) is None  # (x, y)
    assert len(example_inputs_for(TwoInputs(), pairs, 1, torch.device("cpu"))) == 2
    single = DataLoader(torch.randn(6, 2), batch_size=3)
    assert example_inputs_for(OneInput(), single, 1, torch.device("cpu")).shape == (3, 2)
    dicts = DataLoader(DictSamples(), batch_size=2)
    inputs = example_inputs_for(Keywords(), dicts, 1, torch.device("cpu"))
    assert set(inputs) == {"input_ids", "labels"} and inputs["input_ids"].shape == (2, 3)
    assert example_inputs_for(OneInput(), dicts, 1, torch.device("cpu")) is None


def test_loaders_without_a_batch_size_or_length_wait_for_the_first_call():
    sampler_loader = DataLoader(torch.randn(6, 2), batch_sampler=[[0, 1], [2, 3, 4]])
    assert first_batch(sampler_loader, 1) is None
    empty = DataLoader(TensorDataset(torch.randn(0, 2)), batch_size=2)
    assert first_batch(empty, 1) is None
