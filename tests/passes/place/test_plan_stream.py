"""passes/place/plan_stream.py + execution/stream.py: the `stream` part of a target.

Golden: the plan record and the report lines. Numerics: logits and generate() bitwise equal to
the model held in memory, fp32 and bf16. No-op: a target without `stream` offloads nothing.
Purpose: the offloaded tensors leave both the compiled and the user's model between calls.
Bad input: training strategies, a model without its weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import retarget
from retarget.bigmodel.load_checkpoint import load_checkpoint_in_model
from retarget.core.errors import TargetNotSupportedError
from retarget.core.slots import OFFLOAD
from retarget.targets.grammar import TargetError, parse_target
from tests.bigmodel.test_dispatch import empty, generate
from tests.bigmodel_models import build, inputs, logits


def mapped(name, tmp_path, dtype=None):
    """A model loaded memory-mapped from a checkpoint, as the stream part expects it."""
    build(name).save_pretrained(tmp_path / "ckpt")
    model = empty(name)
    load_checkpoint_in_model(model, tmp_path / "ckpt", dtype=dtype, mmap=True)
    return model


def compiled(model, target, name="llama"):
    feed = inputs(name)
    return retarget.compile_for(model, target, example_inputs=feed)


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_streamed_model_gives_the_in_memory_outputs(name, tmp_path):
    model = compiled(mapped(name, tmp_path), "stream[max_memory=0.3,prefetch=1]", name)
    reference = build(name)
    plan = model.program.plan.stream
    assert plan.units >= 3 and "disk" in plan.device_map.values()
    assert plan.folder == ""  # every weight is read from the checkpoint it was mapped from
    assert torch.equal(logits(model, name), logits(reference, name))
    assert torch.equal(generate(model, name), generate(reference, name))
    assert OFFLOAD.get(model).prefetched > 0


def test_bf16_stream_equals_plain_autocast(tmp_path):
    model = compiled(mapped("llama", tmp_path), "bf16+stream[max_memory=0.3]")
    reference = build("llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = logits(reference, "llama")
    assert torch.equal(logits(model, "llama"), expected)


def test_offloaded_tensors_leave_both_models_between_calls(tmp_path):
    user = mapped("llama", tmp_path)
    model = compiled(user, "stream[max_memory=0.3]")
    for tree in (model, user):
        assert all(p.is_meta for p in tree.model.layers.parameters())
        assert not tree.model.embed_tokens.weight.is_meta  # within the budget: resident
    logits(model, "llama")
    assert all(p.is_meta for p in user.model.layers.parameters())


def test_weights_not_on_disk_are_written_to_a_folder_removed_with_the_model(tmp_path):
    model = compiled(build("llama"), "stream[max_memory=0.3]")
    folder = model.program.plan.stream.folder
    assert folder and any(p.suffix == ".safetensors" for p in Path(folder).iterdir())
    assert torch.equal(logits(model, "llama"), logits(build("llama"), "llama"))


def test_a_budget_that_holds_the_model_offloads_nothing(tmp_path):
    model = compiled(mapped("llama", tmp_path), "stream[max_memory=1.0]")
    plan = model.program.plan.stream
    assert plan.units == 0 and set(plan.device_map.values()) == {"cpu"}
    assert "nothing offloaded" in str(model.report)


def test_report_shows_the_device_map(tmp_path):
    model = compiled(mapped("llama", tmp_path), "stream[max_memory=0.3,prefetch=2]")
    text = str(model.report)
    assert "stream: 6 blocks from disk, prefetch 2" in text
    assert "model.layers.0      disk" in text
    assert model.report.to_dict()["plan"]["stream"]["device_map"]["model.layers.3"] == "disk"


def test_without_stream_nothing_is_offloaded():
    model = compiled(build("llama"), "single")
    assert model.program.plan.stream is None and OFFLOAD.get(model) is None


def test_stream_from_cpu_on_a_cpu_warns_and_offloads_nothing(tmp_path):
    with pytest.warns(UserWarning, match=r"stream\[from=cpu\].*nothing is offloaded"):
        model = compiled(build("llama"), "stream[from=cpu]")
    assert model.program.plan.stream.device_map == {"": "cpu"}


@pytest.mark.parametrize("other", ["ddp", "fsdp", "ac", "fp8"])
def test_stream_is_refused_next_to_training_parts(other):
    with pytest.raises(TargetError, match=f"'stream' and '{other}' do not combine"):
        parse_target(f"stream+{other}")


def test_a_model_without_its_weights_is_refused_with_the_way_out(tmp_path):
    with pytest.raises(TargetNotSupportedError, match=r"meta device.*mmap=True.*stream"):
        compiled(empty("llama"), "stream")


def test_a_dispatched_model_is_refused(tmp_path):
    model = build("llama")
    retarget.disk_offload(model, tmp_path / "offload")
    with pytest.raises(TargetNotSupportedError, match="is dispatched"):
        compiled(model, "single")
