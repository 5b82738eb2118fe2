"""The models the coverage benchmark runs: the HF zoo, each at its default config, sizes shrunk.

A stand-in of three models (decoder, encoder, encoder-decoder) until the project's HF zoo
(`retarget.models.hf_zoo`) lands; `ZOO_SOURCE` names which list a coverage table was made from.
Each entry has `name`, `factory()` (a fresh model in train mode, seed 0) and `inputs(batch)`
(keyword arguments with labels, so that the output has a loss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

VOCAB, SEQ = 128, 16


@dataclass(frozen=True)
class CoverageModel:
    name: str
    factory: Callable[[], torch.nn.Module]
    inputs: Callable[[int], dict[str, Any]]


def _ids(batch: int) -> torch.Tensor:
    return torch.randint(4, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(0))


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).train()


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    return BertForSequenceClassification(config).train()


def _bart() -> torch.nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=VOCAB,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
    )
    return BartForConditionalGeneration(config).train()


def _lm_inputs(batch: int) -> dict[str, Any]:
    ids = _ids(batch)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _classifier_inputs(batch: int) -> dict[str, Any]:
    ids = _ids(batch)
    return {"input_ids": ids, "labels": torch.arange(batch) % 2}


ZOO_SOURCE = "bench/coverage_zoo.py (stand-in of 3 models)"
ZOO: dict[str, CoverageModel] = {
    m.name: m
    for m in (
        CoverageModel("llama", _llama, _lm_inputs),
        CoverageModel("bert", _bert, _classifier_inputs),
        CoverageModel("bart", _bart, _lm_inputs),
    )
}
