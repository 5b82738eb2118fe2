"""Small HF models from default configs (sizes shrunk only) for the big-model tests."""

from __future__ import annotations

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    )


def gpt2_config() -> GPT2Config:
    return GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=256, n_positions=128)


def t5_config() -> T5Config:
    # Three layers: block 0 holds the relative position bias, so blocks 1..2 repeat.
    return T5Config(
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=3,
        num_heads=4,
        vocab_size=256,
        decoder_start_token_id=0,
    )


BUILDERS = {
    "llama": (LlamaForCausalLM, llama_config),
    "gpt2": (GPT2LMHeadModel, gpt2_config),
    "t5": (T5ForConditionalGeneration, t5_config),
}


def build(name: str, seed: int = 0):
    cls, config = BUILDERS[name]
    torch.manual_seed(seed)
    return cls(config()).eval()


def inputs(name: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 8), generator=generator)
    if name == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    return {"input_ids": ids}


def logits(model, name: str) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs(name)).logits


def llama_model() -> LlamaForCausalLM:
    """A factory for `retarget device-map` (called under init_empty_weights there)."""
    return LlamaForCausalLM(llama_config())


def llama_inputs() -> dict[str, torch.Tensor]:
    return inputs("llama")
