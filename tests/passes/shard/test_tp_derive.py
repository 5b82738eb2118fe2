"""derive_tp_plan: the auto tensor-parallel plan from the regions' graphs, on real HF models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import retarget
from retarget.core.plans import TP_STYLES, TpPlan
from retarget.models.hf_zoo import hf_model
from retarget.passes.shard.tp_derive import derive_tp_plan
from retarget.passes.shard.tp_params import tp_per_rank_params

pytestmark = pytest.mark.usefixtures("one_thread")


def _program(name: str, **sizes):
    entry = hf_model(name)
    config = entry.config()
    for key, value in sizes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    import transformers

    model = getattr(transformers, entry.model_class)(config).train()
    return retarget.compile_for(model, "single", example_inputs=entry.inputs(2)).program


def _styles(plan: TpPlan, layer: str) -> dict[str, str]:
    """Styles of one repeat's modules, relative to it."""
    prefix = layer + "."
    return {p[len(prefix) :]: r.style for p, r in plan.rules.items() if p.startswith(prefix)}


LLAMA_STYLES = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


@pytest.fixture(scope="module")
def llama():
    return _program("llama")


def test_llama_gqa_attention_and_gated_mlp_split_into_two_chains(llama):
    plan = derive_tp_plan(llama, 2)
    assert plan.source == "auto" and plan.size == 2
    for layer in ("model.layers.0", "model.layers.1"):
        assert _styles(plan, layer) == LLAMA_STYLES
    o_proj = plan.rules["model.layers.0.self_attn.o_proj"]
    assert "q_proj" in o_proj.reason and "all-reduce" in o_proj.reason
    assert plan.rules["model.embed_tokens"].style == "replicate"
    assert plan.rules["lm_head"].style == "replicate"
    assert plan.attribute_fixes == {} and plan.fused == {}
    # Every style is one the runtime knows; rules follow the module order.
    assert {r.style for r in plan.rules.values()} <= set(TP_STYLES)
    order = [p for p, _ in llama.module.named_modules()]
    assert list(plan.rules) == [p for p in order if p in plan.rules]


def test_per_rank_counts_divide_the_split_linears(llama):
    plan = derive_tp_plan(llama, 2)
    model = llama.module
    counts = tp_per_rank_params(model, plan)
    q = model.model.layers[0].self_attn.q_proj.weight.numel()
    assert counts["model.layers.0.self_attn.q_proj"] == (q // 2, q)
    assert counts["lm_head"] == (model.lm_head.weight.numel(),) * 2
    split = sum(full - local for local, full in counts.values())
    total = sum(p.numel() for p in model.parameters())
    assert plan.total_numel == total and plan.per_rank_numel == total - split
    assert f"{plan.per_rank_numel:,} of {total:,}" in plan.describe()


def test_loss_parallel_splits_embedding_and_head_over_the_vocabulary(llama):
    plan = derive_tp_plan(llama, 2, loss_parallel=True)
    assert plan.rules["model.embed_tokens"].style == "rowwise_rep"
    assert plan.rules["lm_head"].style == "colwise"
    assert plan.loss_parallel
    with pytest.raises(ValueError, match=r"vocabulary \(128\).*3 ranks"):
        derive_tp_plan(llama, 3, loss_parallel=True)


def test_heads_that_do_not_divide_replicate_the_attention_and_name_the_node(llama):
    plan = derive_tp_plan(llama, 8)  # 4 query heads, 2 key/value heads
    q = plan.rules["model.layers.0.self_attn.q_proj"]
    assert q.style == "replicate"
    assert "heads do not divide by 8" in q.reason and "node view" in q.reason
    assert plan.rules["model.layers.0.self_attn.o_proj"].style == "replicate"
    # The MLP (128 features) still splits 8 ways.
    assert plan.rules["model.layers.0.mlp.up_proj"].style == "colwise"


def test_plan_is_a_printable_value(llama):
    plan = derive_tp_plan(llama, 2)
    text = repr(plan)
    assert "model.layers.1.mlp.down_proj" in text and "rowwise" in text
    assert plan.describe().startswith("tp[size=2] (auto): ")
    assert derive_tp_plan(llama, 2) == plan  # a value: deriving again gives an equal plan


def test_size_below_one_is_refused(llama):
    with pytest.raises(ValueError, match="at least 1"):
        derive_tp_plan(llama, 0)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.act = nn.GELU()
        self.down = nn.Linear(32, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.down(self.act(self.up(x))))


def test_mlp_only_model_splits_up_and_down_and_replicates_the_head():
    compiled = retarget.compile_for(_Mlp(), "single", example_inputs=torch.randn(4, 8))
    plan = derive_tp_plan(compiled.program, 4)
    styles = {p: r.style for p, r in plan.rules.items()}
    assert styles == {"up": "colwise", "down": "rowwise", "head": "replicate"}
    assert "leaves the region sharded" in plan.rules["head"].reason


@pytest.mark.parametrize("name", ["qwen2", "mistral"])
def test_llama_family_members_get_the_same_chains(name):
    plan = derive_tp_plan(_program(name), 2)
    assert _styles(plan, "model.layers.1") == LLAMA_STYLES


def test_qwen3_per_head_norms_stay_whole_with_their_gradient_all_reduce_named():
    plan = derive_tp_plan(_program("qwen3"), 2)
    styles = _styles(plan, "model.layers.0")
    assert {k: v for k, v in styles.items() if k in LLAMA_STYLES} == LLAMA_STYLES
    q_norm = plan.rules["model.layers.0.self_attn.q_norm"]
    assert q_norm.style == "replicate_grad_allreduce" and "all-reduced" in q_norm.reason


def test_gpt_neox_fused_qkv_split_per_head_needs_no_fused_parts():
    plan = derive_tp_plan(_program("gpt_neox"), 2)
    assert _styles(plan, "gpt_neox.layers.0") == {
        "attention.query_key_value": "colwise",
        "attention.dense": "rowwise",
        "mlp.dense_h_to_4h": "colwise",
        "mlp.dense_4h_to_h": "rowwise",
    }
    assert plan.fused == {}


def test_phi3_qkv_of_unequal_parts_is_split_part_by_part_with_its_widths_fixed():
    """Phi3 under GQA slices one qkv projection into q|k|v of unequal widths: the slices tile
    the output, so each part is split on its own. Its attention reads the query width from
    `config.num_attention_heads` and the key width from `num_key_value_heads`: both shrink
    (the config on a copy the module holds alone). A fix that only the shapes check would have
    missed the second: the value slice then runs past the local tensor and comes out empty."""
    program = _program("phi3")
    config = program.module.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    plan = derive_tp_plan(program, 2)
    assert _styles(plan, "model.layers.0") == {
        "self_attn.qkv_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    }
    width = config.hidden_size // heads
    parts = (heads * width, kv_heads * width, kv_heads * width)
    assert plan.fused_widths["model.layers.0.self_attn.qkv_proj"] == parts
    assert plan.fused == {
        "model.layers.0.mlp.gate_up_proj": 2,
        "model.layers.1.mlp.gate_up_proj": 2,
    }
    assert plan.attribute_fixes["model.layers.1.self_attn"] == {
        "num_key_value_heads": kv_heads // 2,
        "config.num_attention_heads": heads // 2,
    }
    from retarget.passes.shard.tp_params import per_rank_of

    mine, total = per_rank_of(program, plan, program.submodule("model.layers.0"))
    assert mine <= 0.51 * total
    assert (config.num_attention_heads, config.num_key_value_heads) == (heads, kv_heads)


def test_falcon_multi_query_splits_q_and_keeps_its_one_head_k_and_v_whole():
    """Falcon's default attention is multi-query: q|k|v of n heads, one and one, viewed as n+2
    heads and picked by index. k and v have one head, which no rank can take a slice of: every
    rank holds them whole beside its slice of q (under fsdp+tp the chain is replicated)."""
    from retarget.passes.shard.tp_params import per_rank_of

    program = _program("falcon")
    config = program.module.config
    assert config.multi_query and not config.new_decoder_architecture
    width = config.hidden_size // config.num_attention_heads
    plan = derive_tp_plan(program, 2)
    qkv = "transformer.h.0.self_attention.query_key_value"
    assert (
        plan.rules[qkv].style == "colwise" and "kept whole on every rank" in plan.rules[qkv].reason
    )
    assert plan.fused_widths[qkv] == (config.hidden_size, width, width)
    assert plan.fused_whole[qkv] == (1, 2)
    heads = {"num_heads": config.num_attention_heads // 2}
    assert plan.attribute_fixes["transformer.h.0.self_attention"] == heads
    mine, total = per_rank_of(program, plan, program.submodule("transformer.h.0"))
    assert mine <= 0.55 * total
    # The plan's own count holds k and v on every rank, as the pass's recount does.
    assert (plan.per_rank_numel, plan.total_numel) == per_rank_of(program, plan, program.module)
    fsdp_tp = derive_tp_plan(program, 2, whole_parts=False)
    assert fsdp_tp.rules[qkv].style == "replicate" and "tp alone" in fsdp_tp.rules[qkv].reason


@pytest.fixture(scope="module")
def gpt2():
    return _program("gpt2")


def test_gpt2_conv1d_c_attn_is_fused_three_ways_with_widths_fixed(gpt2):
    plan = derive_tp_plan(gpt2, 2)
    assert _styles(plan, "transformer.h.0") == {
        "attn.c_attn": "colwise",
        "attn.c_proj": "rowwise",
        "mlp.c_fc": "colwise",
        "mlp.c_proj": "rowwise",
    }
    assert plan.fused == {"transformer.h.0.attn.c_attn": 3, "transformer.h.1.attn.c_attn": 3}
    # GPT-2's attention splits with `split_size`. Conv1D's own `nf` stays: split by torch's
    # styles its forward runs on whole-size DTensors (only the width check's plain slices
    # needed it shrunk).
    assert plan.attribute_fixes == {
        "transformer.h.0.attn": {"split_size": 32},
        "transformer.h.1.attn": {"split_size": 32},
    }
    # Conv1D stores its weight (in, out): column-wise splits dim 1, bias with it.
    c_attn = gpt2.module.transformer.h[0].attn.c_attn
    counts = tp_per_rank_params(gpt2.module, plan)
    assert counts["transformer.h.0.attn.c_attn"] == (64 * 96 + 96, 64 * 192 + 192)
    assert c_attn.weight.shape == (64, 192)


def test_gpt2_tied_head_and_embedding_split_alike_under_loss_parallel(gpt2):
    plan = derive_tp_plan(gpt2, 2, loss_parallel=True)
    assert plan.rules["transformer.wte"].style == "rowwise_rep"
    assert plan.rules["lm_head"].style == "colwise"
    assert plan.rules["transformer.wpe"].style == "replicate"
    # The tied weight is counted once, split once.
    counts = tp_per_rank_params(gpt2.module, plan)
    wte = gpt2.module.transformer.wte.weight.numel()
    assert counts["transformer.wte"] == counts["lm_head"] == (wte // 2, wte)
    assert plan.total_numel == sum(p.numel() for p in gpt2.module.parameters())


def test_bert_attention_and_ffn_split_and_pooler_classifier_replicated():
    plan = derive_tp_plan(_program("bert"), 2)
    assert _styles(plan, "bert.encoder.layer.0") == {
        "attention.self.query": "colwise",
        "attention.self.key": "colwise",
        "attention.self.value": "colwise",
        "attention.output.dense": "rowwise",
        "intermediate.dense": "colwise",
        "output.dense": "rowwise",
    }
    assert plan.rules["bert.pooler.dense"].style == "replicate"
    assert plan.rules["classifier"].style == "replicate"


class _NormedBlock(nn.Module):
    """Linear -> LayerNorm over its output features -> Linear: the norm needs every feature."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.norm = nn.LayerNorm(32)
        self.down = nn.Linear(32, 8)

    def forward(self, x):
        return x + self.down(self.norm(self.up(x)))


def test_norm_over_the_sharded_dim_breaks_the_chain_and_is_named():
    model = nn.Sequential(_NormedBlock(), _NormedBlock())
    compiled = retarget.compile_for(model, "single", example_inputs=torch.randn(4, 8))
    plan = derive_tp_plan(compiled.program, 2)
    up = plan.rules["0.up"]
    assert up.style == "replicate" and "node layer_norm" in up.reason
    assert "normalises over the sharded dim" in up.reason
    assert plan.rules["1.down"].style == "replicate"
    assert plan.per_rank_numel == plan.total_numel


def test_sequence_parallel_marks_the_residual_norms(llama):
    plan = derive_tp_plan(llama, 2, sequence_parallel=True)
    assert plan.sequence_parallel
    norms = [p for p, r in plan.rules.items() if r.style == "sequence_parallel"]
    assert norms == [
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm",
        "model.layers.1.post_attention_layernorm",
        "model.norm",
    ]
