"""Big-model inference across the HF zoo: meta init of every architecture, and generate() from
disk offload (prefetch on) giving exactly the tokens of the model held in memory."""

from __future__ import annotations

import importlib

import pytest
import torch

from retarget.bigmodel.dispatch import disk_offload
from retarget.bigmodel.empty_init import init_empty_weights
from retarget.core.slots import OFFLOAD
from retarget.models.hf_zoo import GENERATING, HF_ZOO


@pytest.mark.parametrize("name", list(HF_ZOO))
def test_every_zoo_model_builds_on_meta_with_its_real_layout(name):
    entry = HF_ZOO[name]
    cls = getattr(importlib.import_module("transformers"), entry.model_class)
    with init_empty_weights():
        empty = cls(entry.config())
    real = entry.factory()
    assert all(p.is_meta for p in empty.parameters())
    assert {n: p.shape for n, p in empty.named_parameters()} == {
        n: p.shape for n, p in real.named_parameters()
    }
    assert empty.state_dict().keys() == real.state_dict().keys()


@pytest.mark.parametrize("name", GENERATING)
def test_generate_from_disk_offload_gives_the_in_memory_tokens(name, tmp_path):
    entry = HF_ZOO[name]
    reference, model = entry.factory().eval(), entry.factory().eval()
    disk_offload(model, tmp_path / "offload", prefetch=1)
    runtime = OFFLOAD.get(model)
    assert len(runtime.units) >= 3
    prompt = entry.prompt(batch=1, length=5)
    options = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        expected = reference.generate(prompt, **options)
        got = model.generate(prompt, **options)
    assert torch.equal(got, expected)
    assert all(p.is_meta for p in model.parameters())  # nothing left in memory between calls
