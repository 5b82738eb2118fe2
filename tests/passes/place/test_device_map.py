"""core/placement.py and passes/place/device_map.py: device maps planned from sizes and blocks."""

from __future__ import annotations

import pytest
import torch

import retarget
from retarget.bigmodel.empty_init import init_empty_weights
from retarget.core.placement import (
    DeviceMap,
    PlacementError,
    device_for,
)
from retarget.passes.place.device_map import infer_auto_device_map, resolve_device_map, tensor_sizes
from tests.bigmodel_models import BUILDERS
from tests.zoo import ZOO

KB = 1000


def empty(name):
    cls, config = BUILDERS[name]
    with init_empty_weights():
        return cls(config()).eval()


def layer_bytes(model, dtype=torch.float32):
    return sum(tensor_sizes(model.model.layers[0], dtype).values())


def test_whole_model_in_budget_is_one_entry():
    plan = infer_auto_device_map(empty("llama"), max_memory={"cpu": "1GB"})
    assert dict(plan) == {"": "cpu"}


def test_sequential_fills_cpu_then_disk_and_keeps_room_for_one_block():
    model = empty("llama")
    block = layer_bytes(model)  # 147,968 bytes
    plan = infer_auto_device_map(model, max_memory={"cpu": 2 * block + 70 * KB})
    assert plan["model.embed_tokens"] == "cpu" and plan["model.layers.0"] == "cpu"
    assert [plan[f"model.layers.{i}"] for i in (1, 2, 3)] == ["disk"] * 3
    assert plan["lm_head"] == "disk"
    assert plan.reserve == block
    assert plan.totals()["cpu"] + plan.reserve <= plan.budgets["cpu"]
    # Every parameter has a device, and no block is split.
    for name, _ in model.named_parameters():
        device_for(plan, name)
    assert not any(key.startswith("model.layers.0.") for key in plan)


def test_cuda_devices_fill_first_then_cpu_then_disk():
    model = empty("llama")
    block = layer_bytes(model)
    budgets = {0: 2 * block, 1: 2 * block, "cpu": 2 * block}
    plan = infer_auto_device_map(model, max_memory=budgets)
    devices = list(dict.fromkeys(plan.values()))
    assert devices == ["cuda:0", "cuda:1", "cpu", "disk"]
    # cuda:0 runs the offloaded blocks, so it keeps one block free.
    assert plan.totals()["cuda:0"] <= 2 * block - block


def test_balanced_spreads_blocks_over_cuda_devices_and_auto_is_balanced():
    model = empty("llama")
    budgets = {"cuda:0": "10MB", "cuda:1": "10MB"}
    sequential = infer_auto_device_map(model, max_memory=budgets)
    assert dict(sequential) == {"": "cuda:0"}
    balanced = infer_auto_device_map(model, max_memory=budgets, mode="balanced")
    layers = [balanced[f"model.layers.{i}"] for i in range(4)]
    assert layers.count("cuda:0") >= 1 and layers.count("cuda:1") >= 1
    assert dict(infer_auto_device_map(model, max_memory=budgets, mode="auto")) == dict(balanced)


def test_dtype_halves_sizes_and_changes_the_plan():
    model = empty("llama")
    block = layer_bytes(model)
    budget = {"cpu": block + 70 * KB}
    fp32 = infer_auto_device_map(model, max_memory=budget)
    bf16 = infer_auto_device_map(model, max_memory=budget, dtype=torch.bfloat16)
    assert bf16.sizes["model.layers.0"] * 2 == fp32.sizes["model.layers.0"]
    assert list(bf16.values()).count("disk") < list(fp32.values()).count("disk")


def test_tied_tensor_is_counted_once():
    model = empty("gpt2")
    sizes = tensor_sizes(model, None)
    assert "lm_head.weight" not in sizes and "transformer.wte.weight" in sizes
    unique = {id(p): p.numel() * 4 for p in model.parameters()}
    plan = infer_auto_device_map(model, max_memory={"cpu": 500 * KB})
    assert plan["transformer.h.1"] == "disk"
    assert plan["lm_head"] == "cpu"  # its weight is wte's: it goes where wte went
    assert sum(plan.sizes.values()) >= sum(unique.values())
    assert plan.sizes.get("lm_head", 0) == 0


def test_blocks_default_to_find_blocks_repeats_t5():
    model = empty("t5")
    plan = infer_auto_device_map(model, max_memory={"cpu": 450 * KB})
    # Blocks 1..2 repeat (block 0 holds the position bias): they are never split.
    for stack in ("encoder", "decoder"):
        for i in (1, 2):
            path = f"{stack}.block.{i}"
            assert any(device_for(plan, path) == d for d in ("cpu", "disk"))
            assert not any(k.startswith(path + ".") for k in plan), plan


def test_no_split_module_classes_adds_units():
    # T5's first block (with the position bias) is no repeat: split unless named.
    model = empty("t5")
    plan = infer_auto_device_map(model, max_memory={"cpu": 370 * KB})
    assert plan["encoder.block.0.layer.0"] == "cpu" and plan["encoder.block.0.layer.1"] == "disk"
    plan = infer_auto_device_map(
        model, max_memory={"cpu": 370 * KB}, no_split_module_classes=["T5Block"]
    )
    assert plan["encoder.block.0"] == "disk"
    assert not any(key.startswith("encoder.block.0.") for key in plan)


def test_a_budget_too_small_for_one_block_names_it():
    with pytest.raises(PlacementError, match=r"too small for one block: model.layers.0"):
        infer_auto_device_map(empty("llama"), max_memory={"cpu": "100KB"})


def test_describe_lists_module_device_size_and_totals():
    model = empty("llama")
    plan = infer_auto_device_map(model, max_memory={"cpu": 2 * layer_bytes(model) + 70 * KB})
    lines = plan.describe()
    assert any(
        line.startswith("model.layers.0") and "-> cpu" in line and "LlamaDecoderLayer" in line
        for line in lines
    )
    assert any(line.startswith("disk: ") for line in lines)
    assert any(line.startswith("cpu: ") and " of " in line for line in lines)
    assert str(plan) == "\n".join(lines)
    assert isinstance(plan, DeviceMap) and retarget.DeviceMap is DeviceMap


def test_dict_maps_are_normalized_and_checked():
    model = empty("llama")
    assert resolve_device_map(model, {"model": 0, "lm_head": "cpu"}) == {
        "model": "cuda:0",
        "lm_head": "cpu",
    }
    with pytest.raises(PlacementError, match="'model.nope'"):
        resolve_device_map(model, {"model.nope": "cpu"})
    with pytest.raises(PlacementError, match="device_map='fast'"):
        resolve_device_map(model, "fast")


def test_cli_prints_the_plan(capsys):
    from retarget.cli.main import main

    factory = "tests.bigmodel_models:llama_model"
    assert main(["device-map", factory, "--max-memory", "cpu=300KB", "--mode", "sequential"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0" in out and "-> disk" in out and "cpu: " in out
    assert main(["device-map", factory, "--max-memory", "cpu=300KB", "--format", "json"]) == 0
    assert '"model.layers.3": "disk"' in capsys.readouterr().out
    args = ["device-map", factory, "--max-memory", "cpu=100KB"]
    assert main(args) == 2
    assert "too small for one block: model.layers.0" in capsys.readouterr().err


@pytest.mark.parametrize("entry", list(ZOO.values()), ids=list(ZOO))
def test_zoo_blocks_are_never_split(entry):
    with init_empty_weights():
        model = entry.factory()
    total = sum(tensor_sizes(model, None).values())
    blocks = [p for p, m in model.named_modules() if type(m).__name__ == entry.repeated_block_type]
    units = blocks + [p for p, m in model.named_modules() if not list(m.children())]
    largest = max(sum(tensor_sizes(model.get_submodule(p), None).values()) for p in units)
    budget = max(total // 2, largest + 1)
    plan = infer_auto_device_map(model, max_memory={"cpu": budget})
    for name, _ in [*model.named_parameters(), *model.named_buffers()]:
        device_for(plan, name)
    for block in blocks:
        assert not any(key.startswith(block + ".") for key in plan), (block, dict(plan))
    assert plan.totals().get("cpu", 0) + plan.reserve <= budget


def test_without_max_memory_the_free_memory_is_the_budget():
    plan = infer_auto_device_map(empty("llama"))
    assert dict(plan) == {"": "cuda:0" if torch.cuda.is_available() else "cpu"}
    assert 0 < plan.budgets["cpu"]
