"""read_hand_plan: hand tensor-parallel plans and HF's base_model_tp_plan, checked on the graph."""

from __future__ import annotations

import pytest

import retarget
from retarget.models.hf_zoo import hf_model
from retarget.passes.shard.tp_chains import HandPlanConflict
from retarget.passes.shard.tp_derive import derive_tp_plan
from retarget.passes.shard.tp_hand_plan import read_hand_plan

#: Hand plans loaded by name (plan=tests.passes.shard.test_tp_hand_plan:NAME), relative to the
#: root model.
LLAMA_MLP_ONLY = {
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}
ROWWISE_WITHOUT_CHAIN = {"model.layers.*.self_attn.o_proj": "rowwise"}
NOT_A_DICT = ["model.layers.*.mlp.up_proj"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _program(name: str):
    entry = hf_model(name)
    return retarget.compile_for(entry.factory(), "single", example_inputs=entry.inputs(2)).program


@pytest.fixture(scope="module")
def llama():
    return _program("llama")


def test_hf_plan_expands_layer_globs_relative_to_the_base_model(llama):
    plan = read_hand_plan("hf", llama, 2)
    assert plan.source == "config.base_model_tp_plan"
    q = plan.rules["model.layers.1.self_attn.q_proj"]
    assert q.style == "colwise" and "layers.*.self_attn.q_proj -> colwise" in q.reason
    assert plan.rules["model.layers.0.mlp.down_proj"].style == "rowwise"
    assert plan.rules["lm_head"].style == "replicate"
    assert "not in the hand plan" in plan.rules["lm_head"].reason
    # It agrees with the auto plan, including the per-rank count.
    auto = derive_tp_plan(llama, 2)
    assert {p: r.style for p, r in plan.rules.items()} == {
        p: r.style for p, r in auto.rules.items()
    }
    assert plan.per_rank_numel == auto.per_rank_numel


def test_named_plan_is_imported_and_leaves_the_rest_replicated(llama):
    plan = read_hand_plan("tests.passes.shard.test_tp_hand_plan:LLAMA_MLP_ONLY", llama, 2)
    assert plan.source == "tests.passes.shard.test_tp_hand_plan:LLAMA_MLP_ONLY"
    styles = {p: r.style for p, r in plan.rules.items()}
    assert styles["model.layers.0.mlp.up_proj"] == "colwise"
    assert styles["model.layers.0.self_attn.q_proj"] == "replicate"
    assert plan.per_rank_numel > derive_tp_plan(llama, 2).per_rank_numel


def test_rowwise_without_a_colwise_chain_is_refused_with_the_module(llama):
    with pytest.raises(HandPlanConflict, match=r"self_attn\.o_proj rowwise.*not the output of a"):
        read_hand_plan("tests.passes.shard.test_tp_hand_plan:ROWWISE_WITHOUT_CHAIN", llama, 2)


def test_colwise_chain_left_open_is_refused_naming_the_node(llama):
    plan = {"model.layers.*.mlp.up_proj": "colwise"}
    with pytest.raises(HandPlanConflict, match=r"mlp\.up_proj.*node mul"):
        read_hand_plan(plan, llama, 2)


def test_heads_that_do_not_divide_are_refused(llama):
    with pytest.raises(HandPlanConflict, match="heads do not divide by 8"):
        read_hand_plan("hf", llama, 8)


def test_bad_plans_are_refused_with_the_fix(llama):
    with pytest.raises(ValueError, match="names no module"):
        read_hand_plan({"model.layers.*.mlp.up": "colwise"}, llama, 2)
    with pytest.raises(ValueError, match="'moe_tp_experts', which retarget cannot apply"):
        read_hand_plan({"model.layers.*.mlp.up_proj": "moe_tp_experts"}, llama, 2)
    with pytest.raises(ValueError, match="named twice"):
        read_hand_plan({"model.layers.0.mlp.up_proj": "colwise", "*.up_proj": "rowwise"}, llama, 2)
    with pytest.raises(ValueError, match="a hand plan is a dict"):
        read_hand_plan("tests.passes.shard.test_tp_hand_plan:NOT_A_DICT", llama, 2)
    with pytest.raises(ValueError, match="cannot load it"):
        read_hand_plan("tests.passes.shard.test_tp_hand_plan:MISSING", llama, 2)


@pytest.fixture(scope="module")
def gpt2():
    return _program("gpt2")


def test_gpt2_without_an_hf_plan_is_refused_for_plan_hf(gpt2):
    with pytest.raises(ValueError, match="no base_model_tp_plan.*plan=auto"):
        read_hand_plan("hf", gpt2, 2)


def test_fused_projection_split_as_one_is_refused(gpt2):
    plain = {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise"}
    with pytest.raises(HandPlanConflict, match=r"c_attn as 1 part\(s\).*3 fused parts"):
        read_hand_plan(plain, gpt2, 2)


def test_gpt2_hand_plan_keeps_the_split_conv1d_widths(gpt2):
    """The MLP's code reads no width outside its Conv1Ds, and their own `nf` stays whole: split
    by torch's styles they run on whole-size DTensors (attention's `split_size` fix is checked
    with the derived plan in test_tp_derive.py)."""
    mlp = {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
    plan = read_hand_plan(mlp, gpt2, 2)
    assert plan.rules["transformer.h.1.mlp.c_fc"].style == "colwise"
    assert plan.attribute_fixes == {}


def test_hf_packed_colwise_is_our_colwise_with_two_fused_parts():
    phi3 = _program("phi3")
    packed = {
        "model.layers.*.mlp.gate_up_proj": "packed_colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
    }
    plan = read_hand_plan(packed, phi3, 2)
    assert plan.rules["model.layers.1.mlp.gate_up_proj"].style == "colwise"
    assert plan.fused == {
        "model.layers.0.mlp.gate_up_proj": 2,
        "model.layers.1.mlp.gate_up_proj": 2,
    }
    plain = {**packed, "model.layers.*.mlp.gate_up_proj": "colwise"}
    with pytest.raises(HandPlanConflict, match=r"gate_up_proj as 1 part\(s\).*2 fused parts"):
        read_hand_plan(plain, phi3, 2)
    # HF's own phi3 plan gathers instead: accepted as it is (activations stay whole).
    hf = read_hand_plan("hf", phi3, 2)
    assert hf.rules["model.layers.0.self_attn.qkv_proj"].style == "colwise_rep"
    assert hf.rules["model.layers.0.self_attn.o_proj"].style == "rowwise_rep"
