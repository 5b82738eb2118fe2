"""passes/place/activation_headroom.py: per-block activation peaks from a forward on meta."""

from __future__ import annotations

import torch

from retarget.bigmodel.empty_init import init_empty_weights
from retarget.passes.place.activation_headroom import activation_headroom
from retarget.passes.place.device_map import infer_auto_device_map, no_split_paths, tensor_sizes
from tests.bigmodel_models import BUILDERS

KB = 1000


def empty(name):
    cls, config = BUILDERS[name]
    with init_empty_weights():
        return cls(config()).eval()


def layer_bytes(model, dtype=torch.float32):
    return sum(tensor_sizes(model.model.layers[0], dtype).values())


def test_headroom_grows_with_the_tokens():
    model = empty("llama")
    blocks = sorted(no_split_paths(model, None))
    small = activation_headroom(model, blocks, {"input_ids": torch.zeros(1, 8, dtype=torch.long)})
    large = activation_headroom(model, blocks, {"input_ids": torch.zeros(2, 64, dtype=torch.long)})
    assert 0 < small < large
    # The MLP alone holds gate and up outputs, (2, 64, 128) floats each, at once.
    assert large >= 2 * 2 * 64 * 128 * 4


def test_example_inputs_keep_activation_headroom_free():
    model = empty("llama")
    block = layer_bytes(model)
    budget = {"cpu": 3 * block + 70 * KB}
    short = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    long = {"input_ids": torch.zeros(2, 32, dtype=torch.long)}
    plain = infer_auto_device_map(model, max_memory=budget)
    small = infer_auto_device_map(model, max_memory=budget, example_inputs=short)
    large = infer_auto_device_map(model, max_memory=budget, example_inputs=long)
    assert plain.headroom == 0 < small.headroom < large.headroom
    # (2, 32) tokens: the MLP's up/gate outputs alone are 2 x 2*32*128 floats.
    assert large.headroom >= 2 * 2 * 32 * 128 * 4
    assert large.budgets["cpu"] == budget["cpu"] - large.headroom
    on_cpu = [k for k, d in large.items() if d == "cpu"]
    assert len(on_cpu) < len([k for k, d in plain.items() if d == "cpu"])
    assert any("activations" in line for line in large.describe())
    # The model is left as it was: parameters meta, buffers real.
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())


def test_headroom_of_a_real_model_puts_its_weights_back():
    model = BUILDERS["gpt2"][0](BUILDERS["gpt2"][1]())
    weights = {n: p for n, p in model.named_parameters()}
    plan = infer_auto_device_map(
        model, max_memory={"cpu": "1GB"}, example_inputs=torch.zeros(2, 16, dtype=torch.long)
    )
    assert plan.headroom > 0
    assert all(p is weights[n] and not p.is_meta for n, p in model.named_parameters())
    assert model.lm_head.weight is model.transformer.wte.weight
