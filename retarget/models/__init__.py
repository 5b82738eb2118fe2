"""Built-in models: a tiny Llama-style LM for the demo, the smoke test and the benchmarks."""

from retarget.models.tiny_llama import (
    MLP,
    Attention,
    Block,
    RMSNorm,
    TinyConfig,
    TinyLM,
    synthetic_batch,
    tiny_lm,
)

__all__ = [
    "MLP",
    "Attention",
    "Block",
    "RMSNorm",
    "TinyConfig",
    "TinyLM",
    "synthetic_batch",
    "tiny_lm",
]
