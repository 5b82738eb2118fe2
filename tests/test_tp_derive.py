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


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: a second thread only adds contention on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
