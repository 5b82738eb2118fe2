"""bigmodel/empty_init.py: models built with their parameters on meta (or a device)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import retarget
from retarget.bigmodel.empty_init import init_empty_weights, init_on_device
from tests.bigmodel_models import BUILDERS, build


@pytest.mark.parametrize("name", list(BUILDERS))
def test_parameters_are_meta_and_buffers_real(name):
    cls, config = BUILDERS[name]
    with init_empty_weights():
        model = cls(config())
    plain = build(name)
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    shapes = {n: (p.shape, p.dtype, p.requires_grad) for n, p in model.named_parameters()}
    assert shapes == {n: (p.shape, p.dtype, p.requires_grad) for n, p in plain.named_parameters()}
    assert model.state_dict().keys() == plain.state_dict().keys()


@pytest.mark.parametrize("name", list(BUILDERS))
def test_include_buffers_puts_buffers_on_meta_too(name):
    cls, config = BUILDERS[name]
    with init_empty_weights(include_buffers=True):
        model = cls(config())
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_tied_weights_stay_tied():
    cls, config = BUILDERS["gpt2"]
    with init_empty_weights():
        model = cls(config())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert isinstance(model.lm_head.weight, nn.Parameter)


def test_init_on_device_cpu_builds_real_parameters():
    with init_on_device("cpu"):
        layer = nn.Linear(4, 3)
    assert layer.weight.device.type == "cpu" and not layer.weight.is_meta
    with init_on_device(torch.device("meta"), include_buffers=True):
        norm = nn.BatchNorm1d(4)
    assert norm.weight.is_meta and norm.running_mean.is_meta


def test_register_parameter_is_restored_even_after_an_error():
    original = nn.Module.register_parameter
    with pytest.raises(RuntimeError, match="inside"):
        with init_empty_weights():
            raise RuntimeError("inside")
    assert nn.Module.register_parameter is original
    assert not nn.Linear(2, 2).weight.is_meta


def _resident_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as stream:
        return int(stream.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_1b_llama_builds_without_holding_its_weights():
    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
    )
    with init_empty_weights():
        LlamaForCausalLM(config)  # warm: imports, first-call costs
    before = _resident_bytes()
    with init_empty_weights():
        model = LlamaForCausalLM(config)
    grown = _resident_bytes() - before
    assert sum(p.numel() for p in model.parameters()) > 1e9
    assert all(p.is_meta for p in model.parameters())
    # Built for real, its fp32 weights would hold over 4 GB resident here.
    assert grown < 256 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB"


def test_exported_from_retarget():
    assert retarget.init_empty_weights is init_empty_weights
    assert retarget.init_on_device is init_on_device
