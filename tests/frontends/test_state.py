"""Stateful arguments (KV caches): laid out, lifted out of the graph, written back in place."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from retarget.driver.compile import compile_for
from retarget.frontends import capture_call
from retarget.frontends.state import copy_state_args, describe_state
from retarget.frontends.state_layers import layer_index, narrow, widen
from retarget.frontends.state_layout import is_state, layout, rebuild, write_back
from retarget.ir.region import call_key
from retarget.passes.capture.capture_regions import record_inputs


def small_llama(layers: int = 2) -> LlamaForCausalLM:
    """A Llama at its default config but for the sizes (use_cache on), weights from seed 0."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def _ids(batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(0))


def _filled_cache(model: LlamaForCausalLM) -> DynamicCache:
    with torch.no_grad():
        return model(input_ids=_ids()).past_key_values


def _layer_inputs(model: nn.Module, path: str, ids: torch.Tensor, cache=None):
    class Example:
        args = ()
        kwargs = {"input_ids": ids, "past_key_values": cache}

    return record_inputs(model, [[path]], Example)[path]


def _cache_in(kwargs: dict):
    """The cache a decoder layer was called with: `cache` from transformers 5.24 on, earlier
    `past_key_values`."""
    return kwargs["cache"] if "cache" in kwargs else kwargs["past_key_values"]


def _same_state(a, b) -> bool:
    (sa, ta), (sb, tb) = layout([a]), layout([b])
    return sa == sb and len(ta) == len(tb) and all(map(torch.equal, ta, tb))


def test_what_counts_as_state() -> None:
    assert is_state(DynamicCache())
    for plain in (torch.ones(1), 3, None, "x", torch.float32, nn.Linear(1, 1), len):
        assert not is_state(plain)


def test_layout_and_rebuild_round_trip_keeping_aliases() -> None:
    cache = _filled_cache(small_llama())
    cache.alias = cache.layers[0]  # an object reached twice stays one object
    skeletons, tensors = layout([cache])
    assert len(tensors) == 4  # keys and values of two layers
    copy = rebuild(skeletons, tensors)[0]
    assert type(copy) is DynamicCache and copy is not cache
    assert copy.alias is copy.layers[0]
    assert _same_state(copy, cache)
    assert layout([copy])[0] == skeletons


def test_write_back_updates_in_place_and_keeps_identity() -> None:
    cache = _filled_cache(small_llama())
    layer0, layers = cache.layers[0], cache.layers
    other = _filled_cache(small_llama())
    other.layers[0].keys = other.layers[0].keys + 1
    skeletons, tensors = layout([other])
    write_back([cache], skeletons, tensors)
    assert cache.layers is layers and cache.layers[0] is layer0
    assert torch.equal(cache.layers[0].keys, other.layers[0].keys)
    assert _same_state(cache, other)


def test_narrow_keeps_one_layer_and_widen_writes_only_it_back() -> None:
    cache = _filled_cache(small_llama(layers=3))
    small = narrow([cache], 2, 0)[0]
    assert small.layers[0] is not cache.layers[2]  # a copy ...
    assert small.layers[0].keys is cache.layers[2].keys  # ... sharing the tensors
    assert small.layers[1:] == [None, None]
    before = [(layer.keys, layer.values) for layer in cache.layers]
    small.layers[0].keys = torch.zeros(1)
    widen([cache], [small], 2, 0)
    assert torch.equal(cache.layers[2].keys, torch.zeros(1))
    assert cache.layers[0].keys is before[0][0] and cache.layers[1].keys is before[1][0]
    assert cache.layers[2].values is before[2][1]


def test_signature_is_structural_and_narrowed_per_layer() -> None:
    model = small_llama()
    cache, twin = _filled_cache(model), _filled_cache(model)
    assert describe_state(cache, 0) == describe_state(twin, 0)  # identity is not part of it
    assert describe_state(cache, 0) == describe_state(cache, 1)  # equal layers: one signature
    cache.layers[1].keys = cache.layers[1].keys[:, :, :3]
    assert describe_state(cache, 0) != describe_state(cache, 1)
    assert describe_state(DynamicCache(), None) != describe_state(twin, None)


def test_copy_state_args_is_independent() -> None:
    cache = _filled_cache(small_llama())
    (copied,), _ = copy_state_args((cache,), {})
    assert copied is not cache and _same_state(copied, cache)
    copied.layers[0].keys.add_(1)
    assert not torch.equal(copied.layers[0].keys, cache.layers[0].keys)


@pytest.mark.parametrize("prefilled", [False, True], ids=["prefill", "decode"])
def test_decoder_layer_with_cache_is_captured_and_updates_the_live_cache(prefilled) -> None:
    model = small_llama().eval()
    layer = model.model.layers[0]
    cache = _filled_cache(model) if prefilled else None
    ids = _ids(seq=1 if prefilled else 8)
    args, kwargs = _layer_inputs(model, "model.layers.0", ids, cache)
    assert layer_index(layer) == 0
    result = capture_call(layer, args, kwargs, check_modules=(model.model.layers[1],))
    assert result.frontend == "export", result.reason
    graph = result.graph
    assert graph.state is not None and graph.state.index == 0
    eager_args, eager_kwargs = copy_state_args(args, kwargs)
    live = _cache_in(kwargs)
    live_layers = live.layers
    with torch.no_grad():
        expected = layer(*eager_args, **eager_kwargs)
        got = graph.run(layer, args, kwargs, graph.private_attributes(layer))
    assert torch.equal(expected, got)
    assert live.layers is live_layers  # updated in place
    assert _same_state(live, _cache_in(eager_kwargs))


def test_one_graph_serves_every_layer_index() -> None:
    model = small_llama(layers=3).eval()
    args, kwargs = _layer_inputs(model, "model.layers.0", _ids(seq=1), _filled_cache(model))
    graph = capture_call(model.model.layers[0], args, kwargs).graph
    layer2 = model.model.layers[2]
    assert call_key(model.model.layers[0], args, kwargs) == call_key(layer2, args, kwargs)
    eager_args, eager_kwargs = copy_state_args(args, kwargs)
    with torch.no_grad():
        expected = layer2(*eager_args, **eager_kwargs)
        got = graph.run(layer2, args, kwargs, graph.private_attributes(layer2))
    assert torch.equal(expected, got)
    live, want = _cache_in(kwargs), _cache_in(eager_kwargs)
    assert _same_state(live, want)  # layer 2's entry grew, layers 0 and 1 untouched
    assert live.layers[2].keys.shape[-2] == live.layers[0].keys.shape[-2] + 1


class CountingCache:
    """A user's own stateful object: not a Hugging Face class."""

    def __init__(self) -> None:
        self.seen = torch.zeros(0, 4)
        self.calls = 0


class Appender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, memory: CountingCache) -> torch.Tensor:
        memory.seen = torch.cat([memory.seen, x])
        memory.calls += 1
        return self.proj(memory.seen).sum(0)


def test_a_users_own_state_object_is_lifted() -> None:
    torch.manual_seed(0)
    block = Appender()
    memory = CountingCache()
    x = torch.randn(2, 4)
    result = capture_call(block, (x, memory), {})
    assert result.frontend == "export", result.reason
    reference = CountingCache()
    expected = block(x, reference)
    got = result.graph.run(block, (x, memory), {}, result.graph.private_attributes(block))
    assert torch.equal(expected, got)
    assert memory.calls == 1 and torch.equal(memory.seen, x)


def test_default_config_models_are_captured_and_match_eager() -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    model, reference = GPT2LMHeadModel(config), GPT2LMHeadModel(config)
    reference.load_state_dict(model.state_dict())
    ids = _ids()
    compiled = compile_for(model, "single", example_inputs={"input_ids": ids, "labels": ids})
    (region,) = compiled.program.regions
    assert region.frontend == "export" and region.shared and not region.eager_only
    for train in (True, False):
        compiled.train(train)
        reference.train(train)
        torch.manual_seed(1)
        want = reference(input_ids=ids, labels=ids)
        torch.manual_seed(1)
        got = compiled(input_ids=ids, labels=ids)
        assert torch.equal(want.logits, got.logits) and torch.equal(want.loss, got.loss)
        assert _same_state(want.past_key_values, got.past_key_values)
    tokens = reference.generate(ids[:1, :4], max_new_tokens=4, do_sample=False)
    assert torch.equal(compiled.generate(ids[:1, :4], max_new_tokens=4, do_sample=False), tokens)
    assert not region.eager_keys


def test_decode_steps_reuse_one_graph_with_symbolic_lengths() -> None:
    model, reference = small_llama().eval(), small_llama().eval()
    ids = _ids(batch=1, seq=5)
    compiled = compile_for(model, "single", example_inputs={"input_ids": ids})
    (region,) = compiled.program.regions
    before = region.captures
    tokens = compiled.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(tokens, reference.generate(ids, max_new_tokens=12, do_sample=False))
    # The first decode step is captured with the cache length symbolic; every later length is
    # served by that graph after one check against eager, not by a new capture.
    assert region.captures - before <= 2
    assert region.reuses >= 10
    assert any(graph.dynamic for graph in region.distinct_graphs())


def test_static_cache_decodes_with_one_graph() -> None:
    model, reference = small_llama().eval(), small_llama().eval()
    ids = _ids(batch=1, seq=5)
    compiled = compile_for(model, "single", example_inputs={"input_ids": ids})
    (region,) = compiled.program.regions
    options = {"max_new_tokens": 10, "do_sample": False, "cache_implementation": "static"}
    assert torch.equal(compiled.generate(ids, **options), reference.generate(ids, **options))
    assert not region.eager_keys and not region.eager_signatures
    assert len(region.distinct_graphs()) <= 3  # training, prefill, one for every decode step


def test_verify_compares_a_returned_cache_by_what_it_holds() -> None:
    ids = _ids()
    compiled = compile_for(small_llama(), "single", example_inputs={"input_ids": ids}, verify=True)
    assert all(not r.eager_only for r in compiled.program.regions)
