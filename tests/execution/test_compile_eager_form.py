"""compile of a region's eager form (execution/compiled_calls.py) when no frontend captured it.

A decoder layer's call carries HF's KV cache (use_cache is on by default), and its own code reads
per-layer state (`layer_idx`, the cache's layer): one compiled callable shared by the repeats
would recompile at every layer and, past dynamo's recompile limit of 8, leave the remaining
layers uncompiled. Each repeat gets its own callable instead; calls without such state share one.
"""

from __future__ import annotations

import warnings

import torch

import retarget
from retarget.core.errors import EagerRegionWarning
from tests.frontends.test_state import small_llama
from tests.zoo import ZOO, vector_inputs

AOT = "compile[backend=aot_eager]"
LAYERS = 10  # more than dynamo's recompile limit (8)


def _eager_form(target: str, layers: int = LAYERS):
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerRegionWarning)
        # fx alone cannot trace a Llama layer (the cache's control flow): the region runs its
        # eager form, which compile then compiles.
        example = {"input_ids": ids, "labels": ids}
        compiled = retarget.compile_for(
            small_llama(layers), target, example_inputs=example, frontends=("fx",)
        )
    (region,) = compiled.program.regions
    assert region.eager_only and "fx:" in region.reason
    return compiled, ids


def _summary(compiled) -> dict:
    (region,) = compiled.program.regions
    return region.runner.summary()


def test_each_layer_compiles_once_and_none_runs_uncompiled():
    compiled, ids = _eager_form(AOT)
    reference = small_llama(LAYERS)
    assert reference.config.use_cache
    for _ in range(2):
        out = compiled(input_ids=ids, labels=ids)
        out.loss.backward()
        expected = reference(input_ids=ids, labels=ids)
        expected.loss.backward()
        assert torch.allclose(out.loss, expected.loss, rtol=1e-5)
        theirs = dict(reference.named_parameters())
        for name, mine in compiled.named_parameters():
            assert torch.allclose(mine.grad, theirs[name].grad, rtol=1e-4, atol=1e-7), name
    summary = _summary(compiled)
    assert summary["form"] == "eager form" and summary["fallback"] == ""
    # One callable and one compile per layer (before: 8 compiles, the last 2 layers uncompiled).
    assert summary["compiled_callables"] == LAYERS
    assert (summary["compiles"], summary["recompiles"]) == (LAYERS, 0)


def test_generate_under_the_compiled_eager_form_gives_the_original_tokens():
    compiled, ids = _eager_form(AOT, layers=3)
    prompt = ids[:1, :4]
    with torch.no_grad():
        mine = compiled.generate(prompt, max_new_tokens=3, do_sample=False)
        theirs = small_llama(3).generate(prompt, max_new_tokens=3, do_sample=False)
    assert torch.equal(mine, theirs)
    summary = _summary(compiled)
    assert summary["compiled_callables"] == 3 and summary["fallback"] == ""


def test_calls_without_state_share_one_callable():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = retarget.compile_for(
            ZOO["uncapturable_block_model"].factory(), AOT, example_inputs=vector_inputs(2)
        )
        compiled(vector_inputs(2)).sum().backward()
    summary = _summary(compiled)
    assert summary["form"] == "eager form" and summary["compiled_callables"] == 1
