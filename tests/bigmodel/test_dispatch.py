"""bigmodel/dispatch.py: dispatched and offloaded models give the in-memory model's outputs.

Every comparison is exact (torch.equal): offloading moves weights, it must not change a bit.
"""

from __future__ import annotations

import pytest
import torch

from retarget.bigmodel.dispatch import (
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    undispatch,
)
from retarget.bigmodel.dispatch_checkpoint import load_checkpoint_and_dispatch
from retarget.bigmodel.empty_init import init_empty_weights
from retarget.core.disk_weights import read_disk_index
from retarget.core.placement import PlacementError
from retarget.core.slots import OFFLOAD
from tests.bigmodel_models import BUILDERS, build, inputs, logits


def empty(name):
    cls, config = BUILDERS[name]
    with init_empty_weights():
        return cls(config()).eval()


def generate(model, name, tokens=10):
    feed = inputs(name)
    mask = torch.ones_like(feed["input_ids"])
    with torch.no_grad():
        return model.generate(
            feed["input_ids"], attention_mask=mask, max_new_tokens=tokens, do_sample=False
        )


def dispatched(name, tmp_path, dtype=None, prefetch=0, budget="350KB"):
    build(name).save_pretrained(tmp_path / "ckpt")
    return load_checkpoint_and_dispatch(
        empty(name),
        tmp_path / "ckpt",
        device_map="sequential",
        max_memory={"cpu": budget},
        offload_folder=tmp_path / "offload",
        dtype=dtype,
        prefetch=prefetch,
    )


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_disk_offloaded_model_gives_the_same_logits_and_tokens(name, prefetch, tmp_path):
    model = dispatched(name, tmp_path, prefetch=prefetch)
    reference = build(name)
    assert "disk" in model.hf_device_map.values()
    runtime = OFFLOAD.get(model)
    assert runtime.units and all(t.placeholder.is_meta for u in runtime.units for t in u.tensors)
    assert torch.equal(logits(model, name), logits(reference, name))
    assert torch.equal(generate(model, name), generate(reference, name))
    if prefetch:
        assert runtime.prefetched > runtime.loads  # the learned order is followed


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_bf16_offload_equals_the_model_held_in_bf16(name, tmp_path):
    model = dispatched(name, tmp_path, dtype=torch.bfloat16, prefetch=1)
    # as Hugging Face loads it in bf16: floating weights cast, computed buffers kept float32
    reference = BUILDERS[name][0].from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16).eval()
    assert all(r.dtype == "bfloat16" for r in read_disk_index(tmp_path / "offload").values())
    assert torch.equal(logits(model, name), logits(reference, name))
    assert torch.equal(generate(model, name), generate(reference, name))


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_at_most_prefetch_plus_one_units_are_in_memory(prefetch, tmp_path):
    model = dispatched("llama", tmp_path, prefetch=prefetch)
    runtime = OFFLOAD.get(model)
    peak = []

    def count(*_):
        peak.append(sum(_installed(t) for t in _all(runtime)))

    handles = [u.module.register_forward_pre_hook(count) for u in runtime.units]
    generate(model, "llama", tokens=4)
    for handle in handles:
        handle.remove()
    per_unit = max(len(u.tensors) for u in runtime.units)
    assert peak and max(peak) >= 1
    # tensors installed while a unit runs: its own (prefetched values wait outside the model)
    assert max(peak) <= per_unit
    assert runtime.pending <= prefetch
    assert all(not _installed(t) for t in _all(runtime))  # all released after the call


def _all(runtime):
    return [t for u in runtime.units for t in u.tensors]


def _installed(tensor) -> bool:
    module, local, is_param = tensor.owners[0]
    table = module._parameters if is_param else module._buffers
    return table[local] is not tensor.placeholder


def test_tied_weights_stay_tied_on_disk(tmp_path):
    model = build("gpt2")
    reference = build("gpt2")
    disk_offload(model, tmp_path / "offload", prefetch=1)
    seen = []
    model.lm_head.register_forward_pre_hook(
        lambda m, a: seen.append(m.weight is model.transformer.wte.weight)
    )
    assert torch.equal(logits(model, "gpt2"), logits(reference, "gpt2"))
    assert seen == [True]
    assert model.lm_head.weight is model.transformer.wte.weight  # the placeholder is shared too
    records = read_disk_index(tmp_path / "offload")
    assert records["lm_head.weight"] == records["transformer.wte.weight"]  # one file, two names
    assert len({r.file for r in records.values()}) == len(records) - 1


def test_disk_offload_reuses_a_folder_it_wrote(tmp_path):
    disk_offload(build("llama"), tmp_path / "offload")
    files = sorted(p.stat().st_mtime_ns for p in (tmp_path / "offload").iterdir())
    model = empty("llama")
    disk_offload(model, tmp_path / "offload")
    assert sorted(p.stat().st_mtime_ns for p in (tmp_path / "offload").iterdir()) == files
    assert torch.equal(logits(model, "llama"), logits(build("llama"), "llama"))


def test_cpu_offload_leaves_weights_outside_the_model_between_calls():
    model, reference = build("llama"), build("llama")
    cpu_offload(model, execution_device="cpu", prefetch=1)
    assert all(p.is_meta for p in model.model.layers.parameters())
    assert torch.equal(logits(model, "llama"), logits(reference, "llama"))
    assert torch.equal(generate(model, "llama"), generate(reference, "llama"))


def test_cpu_offload_with_hook_offloads_the_previous_model_when_the_next_runs():
    first, second = build("gpt2"), build("llama", seed=1)
    first, first_hook = cpu_offload_with_hook(first, "cpu")
    second, second_hook = cpu_offload_with_hook(second, "cpu", prev_module_hook=first_hook)
    logits(first, "gpt2")
    assert first_hook.on_device and not second_hook.on_device
    out = logits(second, "llama")
    assert not first_hook.on_device and second_hook.on_device
    assert torch.equal(out, logits(build("llama", seed=1), "llama"))
    second_hook.offload()
    assert not second_hook.on_device


def test_undispatch_takes_the_hooks_off(tmp_path):
    model = dispatched("llama", tmp_path)
    undispatch(model)
    assert OFFLOAD.get(model) is None
    assert not model.model.layers[1]._forward_pre_hooks
    with pytest.raises(RuntimeError, match="meta"):  # never loaded: nothing runs silently
        logits(model, "llama")


def test_dispatch_map_with_cpu_entries_on_cpu_runs_them_in_place(tmp_path):
    model, reference = build("llama"), build("llama")
    device_map = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu"}
    device_map |= {"model.rotary_emb": "cpu", "lm_head": "disk"}
    dispatch_model(model, device_map, offload_dir=tmp_path / "offload")
    assert not model.model.layers[0].self_attn.q_proj.weight.is_meta  # resident on cpu
    assert model.lm_head.weight.is_meta  # on disk between calls
    assert torch.equal(logits(model, "llama"), logits(reference, "llama"))


# --- bad inputs ---


def test_meta_weights_kept_in_memory_are_refused_with_their_name():
    with pytest.raises(PlacementError, match=r"model\.embed_tokens\.weight is on the meta"):
        dispatch_model(empty("llama"), {"": "cpu"})


def test_real_weights_mapped_to_disk_need_a_folder():
    with pytest.raises(PlacementError, match="lm_head.weight is mapped to disk.*offload_dir"):
        dispatch_model(build("llama"), {"model": "cpu", "lm_head": "disk"})


def test_an_unknown_device_map_key_is_named():
    with pytest.raises(PlacementError, match="model.nope"):
        dispatch_model(build("llama"), {"model.nope": "cpu", "": "cpu"})


def test_a_negative_prefetch_is_refused(tmp_path):
    with pytest.raises(ValueError, match="prefetch=-1"):
        disk_offload(build("llama"), tmp_path / "offload", prefetch=-1)


# --- on a GPU: the execution device is cuda, weights come from the CPU and from disk ---

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def on_cuda(feed):
    return {k: v.to("cuda") for k, v in feed.items()}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("prefetch", [0, 1])
def test_gpu_cpu_and_disk_offload_give_the_cuda_model_logits(prefetch, tmp_path):
    reference = build("llama").to("cuda")
    model = build("llama")
    device_map = {"model.embed_tokens": "cuda:0", "model.layers.0": "cuda:0"}
    device_map |= {"model.layers.1": "cpu", "model.layers.2": "cpu", "model.layers.3": "disk"}
    device_map |= {"model.norm": "cuda:0", "model.rotary_emb": "cuda:0", "lm_head": "disk"}
    dispatch_model(model, device_map, offload_dir=tmp_path / "offload", prefetch=prefetch)
    assert model.model.layers[1].mlp.up_proj.weight.is_meta  # on the cpu between calls
    feed = on_cuda(inputs("llama"))
    with torch.no_grad():
        got, expected = model(**feed).logits, reference(**feed).logits
    assert got.device.type == "cuda" and torch.equal(got, expected)
    mask = torch.ones_like(feed["input_ids"])
    with torch.no_grad():
        tokens = model.generate(feed["input_ids"], attention_mask=mask, max_new_tokens=8)
        expected_tokens = reference.generate(
            feed["input_ids"], attention_mask=mask, max_new_tokens=8
        )
    assert torch.equal(tokens, expected_tokens)


@pytest.mark.gpu
@gpu
def test_gpu_cpu_offload_with_hook_moves_the_model_to_cuda_and_back():
    first, first_hook = cpu_offload_with_hook(build("gpt2"), "cuda")
    second, _ = cpu_offload_with_hook(build("llama"), "cuda", prev_module_hook=first_hook)
    logits(first, "gpt2")
    assert next(first.parameters()).device.type == "cuda"
    logits(second, "llama")
    assert next(first.parameters()).device.type == "cpu"
    assert next(second.parameters()).device.type == "cuda"
