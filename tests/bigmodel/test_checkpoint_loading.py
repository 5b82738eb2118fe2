"""bigmodel/load_checkpoint.py and checkpoint_files.py: every layout, dtypes, disk, bad inputs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from retarget.bigmodel.checkpoint_files import CheckpointError
from retarget.bigmodel.dispatch_checkpoint import load_checkpoint_and_dispatch
from retarget.bigmodel.empty_init import init_empty_weights
from retarget.bigmodel.load_checkpoint import load_checkpoint_in_model
from retarget.core.disk_weights import read_disk_index
from retarget.core.placement import PlacementError
from retarget.core.slots import DISK_WEIGHTS
from retarget.runtime.state.save_model import save_model, tied_weights
from tests.bigmodel_models import BUILDERS, build, logits
from tests.zoo import ZOO, call


def empty(name):
    cls, config = BUILDERS[name]
    with init_empty_weights():
        return cls(config()).eval()


def write(layout: str, model, folder):
    """Write `model` in one of the layouts; returns the path to give the loader."""
    if layout == "single_file":
        tied = tied_weights(model)  # each tied tensor once, as save_pretrained does
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in tied}
        save_file(state, folder / "weights.safetensors")
        return folder / "weights.safetensors"
    if layout == "save_model_sharded":
        save_model(model, folder, max_shard_size="40KB")
    elif layout == "save_model_bin":
        save_model(model, folder, max_shard_size="40KB", safe_serialization=False)
    elif layout == "hf_single":
        model.save_pretrained(folder)
    elif layout == "hf_sharded":
        model.save_pretrained(folder, max_shard_size="40KB")
    return folder


LAYOUTS = ["single_file", "save_model_sharded", "save_model_bin", "hf_single", "hf_sharded"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_layout_loads_into_a_meta_model_exactly(name, layout, tmp_path):
    reference = build(name)
    path = write(layout, reference, tmp_path)
    if layout.endswith("sharded") or layout == "save_model_bin":
        assert len(list(tmp_path.glob("*-of-*"))) > 1
    model = empty(name)
    result = load_checkpoint_in_model(model, path)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert result.disk == {} and result.loaded > 0
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert torch.equal(logits(model, name), logits(reference, name))


def test_tied_weights_stay_one_parameter(tmp_path):
    reference = build("gpt2")
    save_model(reference, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # saved once
    model = empty("gpt2")
    load_checkpoint_in_model(model, tmp_path)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not model.lm_head.weight.is_meta


def test_real_parameters_are_overwritten_in_place(tmp_path):
    reference = build("llama", seed=0)
    write("hf_single", reference, tmp_path)
    model = build("llama", seed=1)
    weight = model.lm_head.weight
    load_checkpoint_in_model(model, tmp_path)
    assert model.lm_head.weight is weight
    assert torch.equal(weight, reference.lm_head.weight)


def test_dtype_casts_floating_tensors_only(tmp_path):
    reference = build("llama")
    write("hf_sharded", reference, tmp_path)
    model = empty("llama")
    load_checkpoint_in_model(model, tmp_path, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value.to(torch.bfloat16)), key
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # not in the checkpoint
    # As Hugging Face loads it in bf16 (its rotary frequencies stay float32 there too).
    hf = type(reference).from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert hf.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(logits(model, "llama"), logits(hf, "llama"))


def _disk_map(prefix="model.layers"):
    return {
        "model.embed_tokens": "cpu",
        prefix: "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }


def test_disk_tensors_point_into_the_checkpoint_without_a_copy(tmp_path):
    reference = build("llama")
    write("save_model_sharded", reference, tmp_path / "ckpt")
    model = empty("llama")
    result = load_checkpoint_in_model(model, tmp_path / "ckpt", device_map=_disk_map())
    layer_keys = [k for k in reference.state_dict() if k.startswith("model.layers")]
    assert sorted(result.disk) == sorted(layer_keys)
    assert DISK_WEIGHTS.get(model) == result.disk
    for key in layer_keys:
        record = result.disk[key]
        assert record.file.startswith(str((tmp_path / "ckpt").resolve()))
        assert model.get_parameter(key).is_meta
        with safe_open(record.file, framework="pt") as handle:
            assert torch.equal(handle.get_tensor(record.key), reference.state_dict()[key])
    assert not model.lm_head.weight.is_meta


def test_disk_tensors_cast_are_written_to_the_offload_folder(tmp_path):
    reference = build("llama")
    write("save_model_bin", reference, tmp_path / "ckpt")
    model = empty("llama")
    result = load_checkpoint_in_model(
        model,
        tmp_path / "ckpt",
        device_map=_disk_map(),
        dtype=torch.bfloat16,
        offload_folder=tmp_path / "offload",
    )
    assert read_disk_index(tmp_path / "offload") == result.disk
    for key, record in result.disk.items():
        assert record.file.startswith(str((tmp_path / "offload").resolve()))
        assert record.dtype == "bfloat16" and model.get_parameter(key).dtype == torch.bfloat16
        with safe_open(record.file, framework="pt") as handle:
            expected = reference.state_dict()[key].to(torch.bfloat16)
            assert torch.equal(handle.get_tensor(record.key), expected)


def test_a_cast_disk_tensor_without_offload_folder_is_refused(tmp_path):
    write("hf_single", build("llama"), tmp_path)
    model = empty("llama")
    with pytest.raises(CheckpointError, match="offload_folder"):
        load_checkpoint_in_model(model, tmp_path, device_map=_disk_map(), dtype=torch.float16)
    assert all(p.is_meta for p in model.parameters())


def test_a_tie_between_memory_and_disk_is_loaded_in_memory(tmp_path):
    write("save_model_sharded", build("gpt2"), tmp_path)
    model = empty("gpt2")
    device_map = {"transformer": "cpu", "lm_head": "disk"}
    result = load_checkpoint_in_model(model, tmp_path, device_map=device_map)
    assert result.disk == {}
    assert model.lm_head.weight is model.transformer.wte.weight and not model.lm_head.weight.is_meta


def test_load_checkpoint_and_dispatch_plans_the_map(tmp_path):
    reference = build("llama")
    write("hf_single", reference, tmp_path / "ckpt")
    model = empty("llama")
    out = load_checkpoint_and_dispatch(
        model,
        tmp_path / "ckpt",
        device_map="sequential",
        max_memory={"cpu": "350KB"},
        offload_folder=tmp_path / "offload",
    )
    assert out is model
    disk = DISK_WEIGHTS.get(model)
    assert disk and all(k.startswith(("model.layers.", "lm_head", "model.norm")) for k in disk)
    assert not model.model.embed_tokens.weight.is_meta
    assert all(model.get_parameter(k).is_meta for k in disk)  # between calls: on disk only
    assert torch.equal(logits(model, "llama"), logits(reference, "llama"))


# --- bad inputs: every error names the file / key / module, and the model is left unused ---


def test_a_missing_shard_is_named(tmp_path):
    save_model(build("llama"), tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    model = empty("llama")
    with pytest.raises(CheckpointError, match=f"names shard {shard.name}"):
        load_checkpoint_in_model(model, tmp_path)
    assert all(p.is_meta for p in model.parameters())


def test_a_key_the_model_lacks_is_named(tmp_path):
    state = dict(build("llama").state_dict())
    state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"'model.layers.9.mlp.up_proj.weight' in model\.safetensors"
    ):
        load_checkpoint_in_model(empty("llama"), tmp_path)


def test_a_missing_key_is_named_with_its_module(tmp_path):
    state = dict(build("llama").state_dict())
    del state["model.layers.1.self_attn.o_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"o_proj.weight' \(Linear model.layers.1.self_attn"):
        load_checkpoint_in_model(empty("llama"), tmp_path)
    model = empty("llama")
    with pytest.warns(UserWarning, match="o_proj.weight"):
        load_checkpoint_in_model(model, tmp_path, strict=False)
    assert model.model.layers[1].self_attn.o_proj.weight.is_meta
    assert not model.model.layers[0].self_attn.o_proj.weight.is_meta


def test_dtypes_that_cannot_be_cast_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="floating dtype"):
        load_checkpoint_in_model(empty("llama"), tmp_path, dtype=torch.int8)
    state = dict(build("llama").state_dict())
    state["model.norm.weight"] = torch.ones(64, dtype=torch.int64)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' \(LlamaRMSNorm.*int64"):
        load_checkpoint_in_model(empty("llama"), tmp_path)


def test_a_wrong_shape_is_named(tmp_path):
    state = dict(build("llama").state_dict())
    state["lm_head.weight"] = torch.zeros(3, 64)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'lm_head.weight'.*\[3, 64\].*\[256, 64\]"):
        load_checkpoint_in_model(empty("llama"), tmp_path)


def test_a_budget_too_small_for_one_block_is_named(tmp_path):
    write("hf_single", build("llama"), tmp_path)
    with pytest.raises(PlacementError, match=r"model.layers.0 \(LlamaDecoderLayer\)"):
        load_checkpoint_and_dispatch(
            empty("llama"), tmp_path, device_map="auto", max_memory={"cpu": "100KB"}
        )


def test_a_failure_half_way_puts_everything_back_and_marks_the_model(tmp_path):
    reference = build("llama")
    write("hf_single", reference, tmp_path / "ckpt")
    (tmp_path / "not_a_folder").write_text("")
    model = empty("llama")
    # Memory tensors load first; writing the first cast disk tensor then fails.
    device_map = {"": "cpu", "lm_head": "disk"}
    with pytest.raises(CheckpointError, match=r"the [1-9]\d* tensors loaded before were put back"):
        load_checkpoint_in_model(
            model,
            tmp_path / "ckpt",
            device_map=device_map,
            dtype=torch.float16,
            offload_folder=tmp_path / "not_a_folder",
        )
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(RuntimeError, match="refuses to run"):
        model(torch.zeros(1, 4, dtype=torch.long))
    load_checkpoint_in_model(model, tmp_path / "ckpt")
    assert torch.equal(logits(model, "llama"), logits(reference, "llama"))


def test_a_map_that_leaves_a_tensor_out_or_names_a_missing_device_is_refused(tmp_path):
    write("hf_single", build("llama"), tmp_path)
    model = empty("llama")
    with pytest.raises(PlacementError, match="no prefix of 'lm_head.weight'"):
        load_checkpoint_in_model(model, tmp_path, device_map={"model": "cpu"})
    beyond = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(
        CheckpointError, match=rf"'model.embed_tokens.weight' on cuda:{beyond}, but"
    ):
        load_checkpoint_in_model(model, tmp_path, device_map={"": beyond})
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("entry", list(ZOO.values()), ids=list(ZOO))
def test_the_zoo_round_trips_through_save_model_into_empty_models(entry, tmp_path):
    reference = entry.factory().eval()
    save_model(reference, tmp_path, max_shard_size="20KB")
    with init_empty_weights():
        model = entry.factory()
    assert all(p.is_meta for p in model.parameters())
    load_checkpoint_in_model(model, tmp_path)
    model.eval()
    inputs = entry.inputs(2)
    with torch.no_grad():
        expected, got = call(reference, inputs), call(model, inputs)
    expected = expected.logits if hasattr(expected, "logits") else expected
    got = got.logits if hasattr(got, "logits") else got
    assert torch.equal(got, expected)


def test_mmap_loads_without_copying_and_never_writes_the_file(tmp_path):
    reference = build("llama")
    write("hf_sharded", reference, tmp_path)
    model = empty("llama")
    load_checkpoint_in_model(model, tmp_path, mmap=True)
    assert torch.equal(logits(model, "llama"), logits(reference, "llama"))
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # copy-on-write: the file keeps its bytes
    again = empty("llama")
    load_checkpoint_in_model(again, tmp_path)
    assert torch.equal(again.lm_head.weight, reference.lm_head.weight)
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight + 1.0)


def test_a_tie_all_on_disk_gives_every_name_the_same_record(tmp_path):
    write("save_model_sharded", build("gpt2"), tmp_path)
    model = empty("gpt2")
    result = load_checkpoint_in_model(model, tmp_path, device_map={"": "disk"})
    assert result.disk["lm_head.weight"] == result.disk["transformer.wte.weight"]
    assert result.disk["lm_head.weight"].key == "transformer.wte.weight"
    assert model.lm_head.weight is model.transformer.wte.weight and model.lm_head.weight.is_meta


def test_one_checkpoint_error_for_weight_files_and_save_state_folders(tmp_path):
    """`except retarget.CheckpointError` catches a weight file that does not fit as well as a
    save_state folder that is missing: one class, not one per layer."""
    import retarget
    from retarget.runtime.state.checkpoint import load_state

    model = torch.nn.Linear(4, 4)
    save_file({"weight": torch.zeros(3, 3), "bias": torch.zeros(4)}, tmp_path / "w.safetensors")
    with pytest.raises(retarget.CheckpointError, match="weight"):
        load_checkpoint_in_model(model, tmp_path / "w.safetensors")
    with pytest.raises(retarget.CheckpointError, match="no checkpoint at"):
        load_state(tmp_path / "missing", model=model)
