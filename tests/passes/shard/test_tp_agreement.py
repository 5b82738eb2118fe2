"""The auto tensor-parallel plan against HF's hand-written `config.base_model_tp_plan`.

For every transformers config class that carries one (`tp_plan_model_types()`), the model is
built from its default config with sizes shrunk (`tests/tp_agreement_models.py`); models that
cannot be built or run that way here are skipped with the reason (`pytest -rs` lists them).
Each Linear the HF plan names must get the same style from `derive_tp_plan`, except:

- HF styles retarget has no counterpart for (MoE experts, MLA's kv_a_proj, local params) are
  not compared;
- where HF keeps the activations whole (colwise_gather_output, rowwise_split_input), the auto
  plan either splits the chain end to end or replicates it with the reason: both are accepted;
- a module in no captured region (glue code, a layer type that does not repeat) has no graph to
  derive from: replicated with that reason, accepted;
- the differences in `DIFFERENCES`, each with why (and the table must stay true: a listed
  difference that no longer differs fails).
"""

from __future__ import annotations

import fnmatch
import re

import pytest
from torch import nn

import retarget
from retarget.passes.shard.tp_derive import derive_tp_plan
from retarget.passes.shard.tp_hand_plan import HF_STYLES
from retarget.passes.shard.tp_params import is_linear_like
from tests import tp_agreement_models
from tests.tp_agreement_models import NotShrunk, Unbuildable, build, tp_plan_model_types

#: Model types that must build, capture and agree completely (no accepted difference at all).
MUST_AGREE = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gpt_neox", "granite")


def _same(reason: str, *keys: str) -> dict[str, str]:
    return dict.fromkeys(keys, reason)


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_SINKS = _same(
    "attention sinks: a learned value per head, whole on every rank, meets each rank's heads "
    "(logits minus sinks, or concatenated to them); no style splits it, so the auto plan "
    "replicates the attention",
    *(f"layers.*.self_attn.{name}" for name in _ATTENTION),
)
#: model type -> {HF plan key: why the auto plan differs}.
DIFFERENCES: dict[str, dict[str, str]] = {
    "doge": _same(
        "the dynamic mask is computed over all heads (dt_proj's output, full width on the heads "
        "dim) and meets each rank's heads in attention: the auto plan replicates the attention",
        *(f"layers.*.self_attn.{name}" for name in (*_ATTENTION, "dt_proj")),
    ),
    "glm4_moe_lite": _same(
        "MLA: keys and values come from kv_a_proj_with_mqa (HF style mla_kv_a_proj, which has "
        "no counterpart here) through an unequal split, so q, k and v never meet split on the "
        "same heads: the auto plan replicates the attention",
        "layers.*.self_attn.q_b_proj",
        "layers.*.self_attn.kv_b_proj",
        "layers.*.self_attn.o_proj",
    ),
    "granite_swa": _SINKS,
    "granitemoe_swa": _SINKS,
    "mimo_v2_flash": _SINKS,
    "higgs_audio_v2": _same(
        "tokens are routed to audio/text MLPs by data-dependent indexing: the MLP's sizes are "
        "data-dependent, so no layout is derived and the MLP is replicated",
        "layers.*.mlp.gate_proj",
        "layers.*.mlp.up_proj",
        "layers.*.mlp.down_proj",
    ),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _base_prefix(model: nn.Module) -> str:
    prefix = getattr(model, "base_model_prefix", "")
    return prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""


def compare(model: nn.Module, plan, regions: list[str]) -> tuple[dict, list[str]]:
    """({HF key: (hf style, auto style, auto reason)} for unexplained mismatches, accepted)."""
    prefix = _base_prefix(model)
    mismatched, accepted = {}, []
    modules = [(p, m) for p, m in model.named_modules() if is_linear_like(m)]
    for key, hf_style in model.config.base_model_tp_plan.items():
        pattern = f"{prefix}.{key}" if prefix else key
        for path, _ in [(p, m) for p, m in modules if fnmatch.fnmatchcase(p, pattern)]:
            rule = plan.rules[path]
            if hf_style not in HF_STYLES:
                accepted.append(f"{key}: HF style {hf_style} has no counterpart here")
            elif HF_STYLES[hf_style][0] == rule.style:
                continue
            elif HF_STYLES[hf_style][0] in ("colwise_rep", "rowwise_rep"):
                accepted.append(f"{key}: HF keeps activations whole; auto {rule.style}")
            elif not any(r == "" or path.startswith(r + ".") for r in regions):
                accepted.append(f"{key}: in no captured region ({rule.reason})")
            else:
                mismatched[key] = (hf_style, rule.style, rule.reason)
    return mismatched, accepted


@pytest.mark.slow
@pytest.mark.parametrize("model_type", tp_plan_model_types())
def test_auto_plan_agrees_with_base_model_tp_plan(model_type):
    try:
        model, inputs = build(model_type)
    except Unbuildable as why:
        if model_type in MUST_AGREE:
            raise
        pytest.skip(str(why))
    compiled = retarget.compile_for(model, "single", example_inputs=inputs)
    plan = derive_tp_plan(compiled.program, 2)
    regions = [p for r in compiled.program.regions if r.representative() for p in r.paths]
    mismatched, accepted = compare(model, plan, regions)
    known = DIFFERENCES.get(model_type, {})
    assert {k: v for k, v in mismatched.items() if k not in known} == {}
    assert sorted(k for k in known if k not in mismatched) == [], "DIFFERENCES is stale"
    if model_type in MUST_AGREE:
        assert accepted == [] and mismatched == {}


def test_every_config_class_with_a_plan_is_swept():
    types = tp_plan_model_types()
    assert set(MUST_AGREE) <= set(types)
    assert all(re.fullmatch(r"[a-z0-9_]+", t) for t in types) and len(types) >= 100


def test_a_config_that_stays_large_fails_before_its_weights_exist(monkeypatch):
    """GPT-J names its width n_embd (hidden_size is an alias): without the alias it kept 4096."""
    sizes = {k: v for k, v in tp_agreement_models.SIZES.items() if k != "hidden_size"}
    monkeypatch.setattr(tp_agreement_models, "SIZES", sizes)
    with pytest.raises(NotShrunk, match=r"gptj: [\d,]+ parameters after shrinking"):
        build("gptj")
    monkeypatch.undo()
    model, _ = build("gptj")
    assert model.config.n_embd == 64
