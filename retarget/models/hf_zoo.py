"""Hugging Face models as users load them: each at its default config, only the sizes shrunk.

`HF_ZOO` maps a name to an `HFModel`: a factory (random weights, seed 0, train mode), example
inputs with labels (so the output carries a loss) and what the tests and the coverage benchmark
expect of it. Every other default is kept, `use_cache` included: decoder layers then receive a KV
cache even in training, dropout stays on, attention is whatever the config picks.

transformers is imported inside the factories, so importing this module costs nothing and needs
nothing beyond torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

VOCAB = 128
SEQ = 16
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
FFN = 128
POSITIONS = 64
WINDOW = 8  # sliding windows shrunk below SEQ, so that generate() slides them
IMAGE, PATCH, LABELS = 32, 8, 3

#: Size fields in Llama-style configs (Llama, Mistral, Qwen, Gemma, Phi3, GPT-NeoX, Falcon...).
_LLAMA_SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": FFN,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "max_position_embeddings": POSITIONS,
}
_BERT_SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "intermediate_size": FFN,
    "max_position_embeddings": POSITIONS,
}


@dataclass(frozen=True)
class HFModel:
    """One architecture of the zoo."""

    name: str
    kind: str  # decoder | encoder | seq2seq | vision
    config_class: str
    model_class: str
    sizes: dict[str, Any]
    blocks: tuple[str, ...]
    """Class names of the repeated blocks that must become captured regions."""
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    """Non-size settings a default config needs before it can train (named in `notes`)."""

    @property
    def generates(self) -> bool:
        return self.kind in ("decoder", "seq2seq")

    def config(self) -> Any:
        transformers = importlib.import_module("transformers")
        return getattr(transformers, self.config_class)(**self.sizes, **self.extra)

    def factory(self) -> nn.Module:
        """A fresh model with random weights (seed 0), in train mode."""
        transformers = importlib.import_module("transformers")
        torch.manual_seed(0)
        return getattr(transformers, self.model_class)(self.config()).train()

    def inputs(self, batch: int = 2) -> dict[str, torch.Tensor]:
        """Keyword arguments for one training forward (with labels, so the output has a loss)."""
        generator = torch.Generator().manual_seed(0)
        if self.kind == "vision":
            pixels = torch.randn(batch, 3, IMAGE, IMAGE, generator=generator)
            return {"pixel_values": pixels, "labels": torch.arange(batch) % LABELS}
        ids = torch.randint(4, VOCAB, (batch, SEQ), generator=generator)
        if self.kind == "encoder":
            mask = torch.ones(batch, SEQ, dtype=torch.long)
            mask[0, SEQ - 3 :] = 0  # one padded row: the mask path is exercised
            return {"input_ids": ids, "attention_mask": mask, "labels": torch.arange(batch) % 2}
        return {"input_ids": ids, "labels": ids}

    def prompt(self, batch: int = 1, length: int = 5) -> torch.Tensor:
        """Input ids for generate()."""
        generator = torch.Generator().manual_seed(1)
        return torch.randint(4, VOCAB, (batch, length), generator=generator)


def _llama_like(
    name: str, prefix: str, block: str, *, layers: int = 2, notes: str = "", **sizes: Any
) -> HFModel:
    return HFModel(
        name,
        "decoder",
        f"{prefix}Config",
        f"{prefix}ForCausalLM",
        {**_LLAMA_SIZES, "num_hidden_layers": layers, **sizes},
        (block,),
        notes,
    )


_ENTRIES = [
    _llama_like("llama", "Llama", "LlamaDecoderLayer"),
    _llama_like(
        "mistral",
        "Mistral",
        "MistralDecoderLayer",
        sliding_window=WINDOW,
        notes="sliding-window cache layers",
    ),
    _llama_like("qwen2", "Qwen2", "Qwen2DecoderLayer"),
    _llama_like("qwen3", "Qwen3", "Qwen3DecoderLayer", head_dim=HEAD_DIM),
    _llama_like("gemma", "Gemma", "GemmaDecoderLayer", head_dim=HEAD_DIM),
    _llama_like(
        "gemma2",
        "Gemma2",
        "Gemma2DecoderLayer",
        layers=4,
        head_dim=HEAD_DIM,
        sliding_window=WINDOW,
        notes="hybrid cache: sliding and full attention layers alternate (4 layers: both repeat)",
    ),
    HFModel(
        "gemma3",
        "decoder",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {**_LLAMA_SIZES, "num_hidden_layers": 4, "head_dim": HEAD_DIM, "sliding_window": WINDOW},
        ("Gemma3DecoderLayer",),
        "hybrid cache; 4 layers: the sliding ones repeat, the full-attention one is glue",
    ),
    HFModel(
        "phi3",
        "decoder",
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(_LLAMA_SIZES),
        ("Phi3DecoderLayer",),
        "pad_token_id=0: the default (32000) lies outside the shrunk vocabulary",
        extra={"pad_token_id": 0},
    ),
    HFModel(
        "opt",
        "decoder",
        "OPTConfig",
        "OPTForCausalLM",
        {
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "word_embed_proj_dim": HIDDEN,
            "ffn_dim": FFN,
            "num_hidden_layers": 2,
            "num_attention_heads": HEADS,
            "max_position_embeddings": POSITIONS,
        },
        ("OPTDecoderLayer",),
    ),
    HFModel(
        "falcon",
        "decoder",
        "FalconConfig",
        "FalconForCausalLM",
        {
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "num_hidden_layers": 2,
            "num_attention_heads": HEADS,
        },
        ("FalconDecoderLayer",),
    ),
    HFModel(
        "gpt2",
        "decoder",
        "GPT2Config",
        "GPT2LMHeadModel",
        {
            "vocab_size": VOCAB,
            "n_embd": HIDDEN,
            "n_layer": 2,
            "n_head": HEADS,
            "n_positions": POSITIONS,
        },
        ("GPT2Block",),
        "Conv1D layers, tied embeddings",
    ),
    HFModel(
        "gpt_neox",
        "decoder",
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {k: v for k, v in _LLAMA_SIZES.items() if k != "num_key_value_heads"},
        ("GPTNeoXLayer",),
        "fused query_key_value",
    ),
    HFModel(
        "bloom",
        "decoder",
        "BloomConfig",
        "BloomForCausalLM",
        {"vocab_size": VOCAB, "hidden_size": HIDDEN, "n_layer": 2, "n_head": HEADS},
        ("BloomBlock",),
        "alibi; its GeLU is an autograd.Function with its own backward (dynamo keeps it)",
    ),
    HFModel(
        "deberta_v2",
        "encoder",
        "DebertaV2Config",
        "DebertaV2ForSequenceClassification",
        dict(_BERT_SIZES),
        ("DebertaV2Layer",),
        "relative attention; masks with finfo(scores.dtype).min",
    ),
    HFModel(
        "bert",
        "encoder",
        "BertConfig",
        "BertForSequenceClassification",
        dict(_BERT_SIZES),
        ("BertLayer",),
    ),
    HFModel(
        "roberta",
        "encoder",
        "RobertaConfig",
        "RobertaForSequenceClassification",
        {**_BERT_SIZES, "max_position_embeddings": POSITIONS + 2},
        ("RobertaLayer",),
    ),
    HFModel(
        "distilbert",
        "encoder",
        "DistilBertConfig",
        "DistilBertForSequenceClassification",
        {
            "vocab_size": VOCAB,
            "dim": HIDDEN,
            "n_layers": 2,
            "n_heads": HEADS,
            "hidden_dim": FFN,
            "max_position_embeddings": POSITIONS,
        },
        ("TransformerBlock",),
    ),
    HFModel(
        "t5",
        "seq2seq",
        "T5Config",
        "T5ForConditionalGeneration",
        {
            "vocab_size": VOCAB,
            "d_model": HIDDEN,
            "d_kv": HEAD_DIM,
            "d_ff": FFN,
            "num_layers": 3,
            "num_heads": HEADS,
        },
        ("T5Block",),
        "3 layers: block 0 holds the relative position bias, blocks 1-2 repeat; "
        "decoder_start_token_id=0 set (the default config has none, labels need it)",
        extra={"decoder_start_token_id": 0},
    ),
    HFModel(
        "bart",
        "seq2seq",
        "BartConfig",
        "BartForConditionalGeneration",
        {
            "vocab_size": VOCAB,
            "d_model": HIDDEN,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": HEADS,
            "decoder_attention_heads": HEADS,
            "encoder_ffn_dim": FFN,
            "decoder_ffn_dim": FFN,
            "max_position_embeddings": POSITIONS,
        },
        ("BartEncoderLayer", "BartDecoderLayer"),
    ),
    HFModel(
        "vit",
        "vision",
        "ViTConfig",
        "ViTForImageClassification",
        {
            "hidden_size": HIDDEN,
            "num_hidden_layers": 2,
            "num_attention_heads": HEADS,
            "intermediate_size": FFN,
            "image_size": IMAGE,
            "patch_size": PATCH,
            "num_labels": LABELS,
        },
        ("ViTLayer",),
    ),
]

HF_ZOO: dict[str, HFModel] = {entry.name: entry for entry in _ENTRIES}

#: Entries by kind, for parametrizing tests.
DECODERS = [e.name for e in _ENTRIES if e.kind == "decoder"]
GENERATING = [e.name for e in _ENTRIES if e.generates]


def hf_model(name: str) -> HFModel:
    """The zoo entry `name` (KeyError names the known ones)."""
    try:
        return HF_ZOO[name]
    except KeyError:
        raise KeyError(f"no HF zoo model {name!r}; known: {', '.join(HF_ZOO)}") from None


__all__ = ["DECODERS", "GENERATING", "HF_ZOO", "HFModel", "hf_model"]
