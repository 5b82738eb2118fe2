"""annotate_shapes: counted FLOPs, shapes and parameter counts."""

from __future__ import annotations

import torch

import retarget
from tests.zoo import ZOO


def test_linear_flops_and_shapes_are_exact():
    entry = ZOO["mnist_cnn"]
    compiled = retarget.compile_for(entry.factory(), example_inputs=entry.inputs(4))
    fc1 = compiled.program.analysis.modules["fc1"]
    assert fc1["flops"] == 2 * 4 * 9216 * 128
    assert fc1["inputs"] == ["float32[4, 9216]"] and fc1["outputs"] == ["float32[4, 128]"]
    assert fc1["weight"] == "float32[128, 9216]"
    conv2 = compiled.program.analysis.modules["conv2"]
    assert conv2["flops"] == 2 * 4 * 24 * 24 * 64 * 32 * 9


def test_region_entries_sum_their_repeats():
    entry = ZOO["tiny_llama"]
    compiled = retarget.compile_for(entry.factory(), example_inputs=entry.inputs(2))
    region = compiled.program.analysis.regions["model.layers.*"]
    assert region["repeats"] == 2
    assert region["flops"] == 2 * region["flops_per_repeat"] > 0
    assert region["inputs"][0] == "float32[2, 16, 64]"
    assert region["graph_nodes_annotated"] > 10
    graph = compiled.program.regions[0].representative().gm
    linear = next(
        iter(graph.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default))
    )
    assert linear.meta["shape"] == (2, 16, 64) and linear.meta["dtype"] == torch.float32


def test_without_example_inputs_only_parameters_are_known():
    compiled = retarget.compile_for(ZOO["mnist_cnn"].factory())
    record = compiled.history[-1]
    assert record.notes == ("no example_inputs: shapes and FLOPs unknown",)
    assert compiled.program.analysis.modules["fc2"]["flops"] == 0
    assert record.stats["params"] == sum(p.numel() for p in compiled.parameters())


def _counted(model, inputs):
    from torch.utils.flop_counter import FlopCounterMode

    from retarget.passes.analysis.annotate_shapes import EXTRA_FLOP_FORMULAS
    from tests.zoo import call

    counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)
    with torch.no_grad(), counter:
        call(model, inputs)
    return {
        name.partition(".")[2]: sum(ops.values()) for name, ops in counter.get_flop_counts().items()
    }


def test_cpu_attention_is_counted():
    """scaled_dot_product_attention's CPU kernel, which torch's counter has no formula for."""
    from tests.passes.shard.test_pipeline_parallel import batch, llama

    compiled = retarget.compile_for(llama(2), "single", example_inputs=batch())
    calls = dict(map(tuple, compiled.program.analysis.regions["model.layers.*"]["calls"]))
    # v_proj (4 rows x 16 positions, 32 -> 16) is 2 x 64 x 32 x 16; then attention: 4 rows x
    # 4 heads x 16 x 16 positions x 8 dims x 2 matmuls x 2
    attention = calls["self_attn.o_proj"] - calls["self_attn.v_proj"] - 2 * 64 * 32 * 16
    assert attention == 4 * 4 * 16 * 16 * 8 * 2 * 2


def test_replayed_repeats_report_what_a_full_forward_counts():
    # Later repeats are not run (their cost would grow with depth); their figures must still be
    # exactly what running them gives.
    for name in ("tiny_llama", "tiny_bert", "small_cnn", "transformer_encoder"):
        entry = ZOO[name]
        model = entry.factory()
        compiled = retarget.compile_for(model, example_inputs=entry.inputs(2))
        record = next(r for r in compiled.history if r.name == "annotate_shapes")
        region = compiled.program.regions[0]
        assert record.stats["repeats_replayed"] == region.repeats - 1, name
        full = _counted(model, entry.inputs(2))
        assert record.stats["forward_flops"] == full[""], name
        modules = compiled.program.analysis.modules
        assert {p: m["flops"] for p, m in modules.items()} == {p: full.get(p, 0) for p in modules}
        later = region.paths[-1]
        assert compiled.program.analysis.regions[region.name]["flops"] == sum(
            full[p] for p in region.paths
        ), (name, later)
