"""save_model: full weights as safetensors shards + index, loadable by the plain model and HF."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import retarget
from retarget.execution.process import ProcessState
from retarget.runtime.state.save_model import (
    get_state_dict,
    load_model,
    parse_size,
    read_model_weights,
    save_model,
    tied_weights,
    unwrap_model,
)
from tests.distributed import run_ranks
from tests.zoo import lm_inputs, tiny_gpt2, tiny_llama

INDEX = "model.safetensors.index.json"


def _perturbed_llama():
    """tiny_llama with weights moved off their initial values, the same in every process."""
    model = tiny_llama()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.linspace(-0.01, 0.01, p.numel()).reshape(p.shape) * (i + 1))
    return model


def _logits(model, inputs):
    model.eval()
    with torch.no_grad():
        return model(input_ids=inputs["input_ids"]).logits


def _shard_bytes(path) -> int:
    with safe_open(path, "pt") as f:
        return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10GB", 10 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("1.5KB", 1500),
        (" 40 kb ".upper(), 40_000),
        ("123", 123),
        (4096, 4096),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["10 parsecs", "5Gb", "", "-1MB", 0, "GB"])
def test_parse_size_refuses_what_is_not_a_size(bad):
    with pytest.raises(ValueError, match="max_shard_size="):
        parse_size(bad)


def test_shards_respect_max_size_and_load_everywhere_with_identical_outputs(tmp_path):
    model = _perturbed_llama()
    save_model(model, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert all(_shard_bytes(tmp_path / s) <= 40_000 for s in shards)
    expected = model.state_dict()
    assert list(index["weight_map"]) == sorted(expected)  # every key, sorted as Accelerate
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in expected.values())
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"

    plain = load_model(tiny_llama(), tmp_path)
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in expected.items())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)
    inputs = lm_inputs(2)
    reference = _logits(model, inputs)
    assert torch.equal(_logits(plain, inputs), reference)
    assert torch.equal(_logits(hf, inputs), reference)


def test_tied_weights_are_saved_once_and_come_back_tied(tmp_path):
    model = tiny_gpt2()
    compiled = retarget.compile_for(model, "single")
    assert tied_weights(compiled) == {"lm_head.weight": "transformer.wte.weight"}
    save_model(compiled, tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / INDEX).read_text())
    assert "lm_head.weight" not in index["weight_map"]
    assert set(index["weight_map"]) == set(model.state_dict()) - {"lm_head.weight"}
    assert index["metadata"]["tied_weights"] == {"lm_head.weight": "transformer.wte.weight"}

    hf = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert hf.lm_head.weight is hf.transformer.wte.weight
    plain = load_model(tiny_gpt2(), tmp_path)  # strict: the tied key is filled back in
    inputs = lm_inputs(2)
    reference = _logits(model, inputs)
    assert torch.equal(_logits(hf, inputs), reference)
    assert torch.equal(_logits(plain, inputs), reference)


def test_pickle_free_torch_format_and_stale_shards(tmp_path):
    model = _perturbed_llama()
    save_model(model, tmp_path, max_shard_size="40KB", safe_serialization=False)
    assert (tmp_path / "pytorch_model.bin.index.json").is_file()
    weights = read_model_weights(tmp_path)  # torch.load(weights_only=True)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    save_model(model, tmp_path, safe_serialization=False)  # one file now, and no index
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "pytorch_model.bin"]
    weights = read_model_weights(tmp_path)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_unwrap_model_returns_the_users_model():
    model = tiny_gpt2()
    assert unwrap_model(retarget.compile_for(model, "single")) is model
    assert unwrap_model(torch.compile(model)) is model


def test_reading_a_folder_without_index_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no model.safetensors, pytorch_model.bin"):
        read_model_weights(tmp_path)
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        save_model(torch.nn.Linear(1, 1), tmp_path / "f")


def _save_wrapped(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    ProcessState.current()
    ddp = DistributedDataParallel(_perturbed_llama())
    save_model(ddp, f"{root}/ddp", max_shard_size="40KB")
    fsdp = _perturbed_llama()
    mesh = init_device_mesh("cpu", (world,))
    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    sharded = type(fsdp.lm_head.weight).__name__
    save_model(fsdp, f"{root}/fsdp", max_shard_size="40KB")
    return {"sharded": sharded, "gathered": len(get_state_dict(fsdp))}


@pytest.mark.distributed
def test_ddp_and_fsdp_save_full_weights_with_the_original_keys(tmp_path):
    results = run_ranks(_save_wrapped, 2, str(tmp_path))
    assert [r["sharded"] for r in results] == ["DTensor", "DTensor"]
    # The full state dict exists on rank 0 only.
    assert results[0]["gathered"] > 0 and results[1]["gathered"] == 0
    expected = _perturbed_llama().state_dict()
    for kind in ("ddp", "fsdp"):
        index = json.loads((tmp_path / kind / INDEX).read_text())
        assert list(index["weight_map"]) == sorted(expected)  # no "module." prefix
        weights = read_model_weights(tmp_path / kind)
        assert all(torch.equal(v, weights[k]) for k, v in expected.items()), kind
