"""Small models and their tensor-parallel plans, for the tp tests.

Plans are TpPlan records built here, from the model config's `base_model_tp_plan` where
transformers ships one (Llama, Qwen2, Qwen3, GPT-NeoX, CodeGen) and written by hand for the
others (GPT-2, BERT, an MLP), with the globs expanded over the model's own module names. A
target names them as `tp[plan=tests.tp_models:NAME]` (a TpPlan instance is used as given,
after checks).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping

import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    CodeGenConfig,
    CodeGenForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from retarget.core.plans import TpPlan, TpRule
from retarget.passes.shard import tp_hand_plan
from tests import zoo

HIDDEN, HEADS, LAYERS, INTER, VOCAB = 32, 4, 2, 64, zoo.VOCAB


def _dropout_off(model: nn.Module) -> nn.Module:
    """Dropout off: N ranks and one process would draw different masks."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model.train()


def _decoder(config_class: type, model_class: type, **extra: object) -> nn.Module:
    """A Llama-style causal LM at the shared sizes, with GQA (2 key/value heads for 4 query
    heads)."""
    torch.manual_seed(0)
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **extra,
    )
    return _dropout_off(model_class(config))


def llama() -> nn.Module:
    return _decoder(LlamaConfig, LlamaForCausalLM)


def qwen2() -> nn.Module:
    return _decoder(Qwen2Config, Qwen2ForCausalLM)


def qwen3() -> nn.Module:
    """Qwen3: per-head q/k norms, read whole on each rank's heads (partial gradients)."""
    return _decoder(Qwen3Config, Qwen3ForCausalLM, head_dim=HIDDEN // HEADS)


def neox() -> nn.Module:
    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=64,
    )
    return _dropout_off(GPTNeoXForCausalLM(config))


def codegen() -> nn.Module:
    """CodeGen: q|v|k fused in 4 groups (`mp_num`), each group's heads reshaped out of its
    width ([.., 4, 3 * 16] -> q [.., 4, 16] -> [.., 8 heads, 8]), partial rotary (4 of 8)."""
    torch.manual_seed(0)
    config = CodeGenConfig(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=2 * HIDDEN,
        n_layer=LAYERS,
        n_head=2 * HEADS,
        rotary_dim=4,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    return _dropout_off(CodeGenForCausalLM(config))


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_inner=INTER,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return _dropout_off(model)


def _bert_config(**extra: object) -> BertConfig:
    torch.manual_seed(0)
    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=INTER,
        max_position_embeddings=64,
        **extra,
    )


def bert() -> nn.Module:
    return _dropout_off(BertForSequenceClassification(_bert_config(num_labels=3)))


def bert_mlm() -> nn.Module:
    """BERT with its masked-LM head (tied to the word embeddings): the head sits behind a
    prediction transform (dense, GELU, LayerNorm) that runs on the whole stream."""
    return _dropout_off(BertForMaskedLM(_bert_config()))


class Mlp(nn.Module):
    """Two residual MLP blocks and a head: a model with nothing but Linears to split."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, INTER), nn.GELU(), nn.Linear(INTER, HIDDEN))
            for _ in range(LAYERS)
        )
        self.head = nn.Linear(HIDDEN, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return Mlp().train()


def expand(model: nn.Module, globs: Mapping[str, str], prefix: str = "") -> dict[str, str]:
    """module path -> style for every module whose path (under `prefix`) matches a glob."""
    rules = {}
    for path, _ in model.named_modules():
        for glob, style in globs.items():
            if fnmatch.fnmatchcase(path, prefix + glob):
                rules[path] = style
    return rules


def plan_of(
    model: nn.Module,
    size: int,
    styles: Mapping[str, str],
    *,
    fused: Mapping[str, int] | None = None,
    fixes: Mapping[str, Mapping[str, int]] | None = None,
) -> TpPlan:
    return TpPlan(
        size=size,
        source="tests.tp_models",
        rules={p: TpRule(style=s, reason="test plan") for p, s in styles.items()},
        fused=dict(fused or {}),
        attribute_fixes={k: dict(v) for k, v in (fixes or {}).items()},
    )


def hf_plan(model: nn.Module, size: int) -> TpPlan:
    """The config's base_model_tp_plan under the base model's attribute name, its styles mapped
    to ours as `tp[plan=hf]` maps them (HF's embedding_rowwise, packed_colwise, ...)."""
    styles, fused = tp_hand_plan.expand(
        model.config.base_model_tp_plan, model, model.base_model_prefix
    )
    return plan_of(model, size, styles, fused=fused)


def gpt2_plan(model: nn.Module, size: int) -> TpPlan:
    globs = {
        "h.*.attn.c_attn": "colwise",
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    }
    styles = expand(model, globs, "transformer.")
    attn = [p for p in styles if p.endswith("c_attn")]
    parents = [p.rsplit(".", 1)[0] for p in attn]
    fixes = {p: {"split_size": HIDDEN // size, "num_heads": HEADS // size} for p in parents}
    return plan_of(model, size, styles, fused={p: 3 for p in attn}, fixes=fixes)


def bert_plan(model: nn.Module, size: int) -> TpPlan:
    globs = {
        "encoder.layer.*.attention.self.query": "colwise",
        "encoder.layer.*.attention.self.key": "colwise",
        "encoder.layer.*.attention.self.value": "colwise",
        "encoder.layer.*.attention.output.dense": "rowwise",
        "encoder.layer.*.intermediate.dense": "colwise",
        "encoder.layer.*.output.dense": "rowwise",
    }
    styles = expand(model, globs, "bert.")
    fixes = {
        p.rsplit(".", 1)[0]: {"num_attention_heads": HEADS // size, "all_head_size": HIDDEN // size}
        for p in styles
        if p.endswith(".query")
    }
    return plan_of(model, size, styles, fixes=fixes)


def mlp_plan(model: nn.Module, size: int) -> TpPlan:
    return plan_of(model, size, expand(model, {"blocks.*.0": "colwise", "blocks.*.2": "rowwise"}))


def mlp_fused_head_plan(model: nn.Module, size: int) -> TpPlan:
    """mlp_plan with the head's 4 outputs split colwise_rep as 2 fused parts: an nn.Linear
    whose weight and bias both hold fused parts on dim 0 (FSDP2 under fsdp+tp shards the
    weight on dim 1 and keeps the bias whole over dp: execution/tp_fsdp.py)."""
    styles = expand(
        model, {"blocks.*.0": "colwise", "blocks.*.2": "rowwise", "head": "colwise_rep"}
    )
    return plan_of(model, size, styles, fused={"head": 2})


#: name -> (model builder, plan builder, input kind)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module, int], TpPlan], str]] = {
    "mlp": (mlp, mlp_plan, "vector"),
    "mlp_fused_head": (mlp, mlp_fused_head_plan, "vector"),
    "llama": (llama, hf_plan, "lm"),
    "qwen2": (qwen2, hf_plan, "lm"),
    "qwen3": (qwen3, hf_plan, "lm"),
    "neox": (neox, hf_plan, "lm"),
    "codegen": (codegen, hf_plan, "lm"),
    "gpt2": (gpt2, gpt2_plan, "lm"),
    "bert": (bert, bert_plan, "cls"),
    "bert_mlm": (bert_mlm, bert_plan, "lm"),
}


def batch_for(kind: str, rows: int, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if kind == "vector":
        return {"x": torch.randn(rows, HIDDEN, generator=gen)}
    ids = torch.randint(1, VOCAB, (rows, zoo.SEQ), generator=gen)
    if kind == "cls":
        return {"input_ids": ids, "labels": torch.randint(0, 3, (rows,), generator=gen)}
    return {"input_ids": ids, "labels": ids.clone()}


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if "x" in batch:
        return model(batch["x"]).float().pow(2).mean()
    return model(**batch).loss


def __getattr__(name: str) -> TpPlan:
    """Plan constants a target can name: LLAMA_2 is the Llama plan at size 2, GPT2_4 ..."""
    model, _, size = name.rpartition("_")
    if model.lower() not in MODELS or not size.isdigit():
        raise AttributeError(name)
    build, make_plan, _ = MODELS[model.lower()]
    return make_plan(build(), int(size))
