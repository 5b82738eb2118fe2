"""Built-in models: a tiny Llama-style LM for the demo, the smoke test, the benchmarks and the
README's command-line examples (`example_inputs`).

Layer: the lowest; torch only, it imports nothing from retarget, so it stays loadable alone.
"""

from retarget.models.tiny_llama import (
    MLP,
    Attention,
    Block,
    RMSNorm,
    TinyConfig,
    TinyLM,
    example_inputs,
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
    "example_inputs",
    "synthetic_batch",
    "tiny_lm",
]
