"""A small built-in Llama-style causal language model, written in plain torch.

Used by ``retarget demo`` and the benchmarks so that neither needs ``transformers``. The control
flow is export-friendly: no data-dependent Python branches and no ``.item()``, so every ``Block``
captures with ``torch.export`` on its own, from a single tensor input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

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

_ROPE_BASE = 10000.0
_INIT_STD = 0.02


@dataclass(frozen=True, kw_only=True)
class TinyConfig:
    """Shape and regularisation of a :class:`TinyLM`."""

    vocab_size: int = 256
    """Number of token ids."""
    hidden: int = 64
    """Width of the residual stream."""
    layers: int = 2
    """Number of decoder blocks."""
    heads: int = 4
    """Attention heads; must divide ``hidden``."""
    intermediate: int | None = None
    """MLP width; ``None`` uses Llama's rule, see :attr:`intermediate_size`."""
    max_seq: int = 128
    """Longest sequence the rotary tables cover."""
    dropout: float = 0.0
    """Dropout probability after the attention and MLP of each block."""
    tie_embeddings: bool = True
    """Share one weight between the embedding and the LM head."""
    rms_eps: float = 1e-6
    """Epsilon of every RMSNorm."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if (self.hidden // self.heads) % 2:
            raise ValueError("rotary embeddings need an even head dimension")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def intermediate_size(self) -> int:
        """The MLP width: ``intermediate`` when set, else Llama's ``8/3 * hidden`` rounded up to a
        multiple of 16 (176 for hidden 64), which keeps the SwiGLU MLP's parameter count close to
        a classic ``4 * hidden`` MLP."""
        if self.intermediate is not None:
            return self.intermediate
        return 16 * math.ceil(int(8 * self.hidden / 3) / 16)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 so that bf16 activations do not lose the variance.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden, config.hidden, bias=False)
        self.k_proj = nn.Linear(config.hidden, config.hidden, bias=False)
        self.v_proj = nn.Linear(config.hidden, config.hidden, bias=False)
        self.o_proj = nn.Linear(config.hidden, config.hidden, bias=False)
        # Each block owns its rotary tables so that a block captures from the hidden states alone.
        # Non-persistent: they are derived from the config and stay out of checkpoints.
        inv_freq = 1.0 / (
            _ROPE_BASE ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        )
        angles = torch.outer(torch.arange(config.max_seq, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = (
            proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        cos = self.cos[:seq].to(q.dtype)
        sin = self.sin[:seq].to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, hidden))


class MLP(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        width = config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden, width, bias=False)
        self.up_proj = nn.Linear(config.hidden, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder block: ``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))``."""

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden, config.rms_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden, config.rms_eps)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x)))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class TinyLM(nn.Module):
    """Decoder-only causal LM: ``embed -> layers -> norm -> lm_head``.

    ``forward(input_ids, labels=None)`` returns ``{"logits": (batch, seq, vocab)}``, plus ``"loss"``
    (mean shifted next-token cross-entropy, ``-100`` labels ignored) when labels are given.
    """

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden, config.rms_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        # Llama's init; the default N(0, 1) embedding would give a tied head huge initial logits.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=_INIT_STD)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        out = {"logits": logits}
        if labels is not None:
            # fp32 loss: under bf16 autocast the logits are bf16.
            out["loss"] = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        return out


def tiny_lm(**overrides) -> TinyLM:
    """Build a :class:`TinyLM` from :class:`TinyConfig` defaults updated with ``overrides``.

    The weights come from the global torch RNG: seed it first for a reproducible model.
    """
    return TinyLM(replace(TinyConfig(), **overrides))


def synthetic_batch(
    config: TinyConfig, batch: int = 4, seq: int = 32, *, generator: torch.Generator | None = None
) -> dict[str, torch.Tensor]:
    """Random tokens as ``{"input_ids", "labels"}`` for ``TinyLM(**batch)``.

    ``labels`` equals ``input_ids``: the model shifts them itself for next-token prediction.
    """
    if seq > config.max_seq:
        raise ValueError(f"seq={seq} exceeds max_seq={config.max_seq}")
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def example_inputs() -> dict[str, torch.Tensor]:
    """A seeded batch for the default TinyLM: what the README's command-line examples pass
    (`retarget inspect retarget.models:tiny_lm --inputs retarget.models:example_inputs`)."""
    return synthetic_batch(TinyConfig(), generator=torch.Generator().manual_seed(0))
