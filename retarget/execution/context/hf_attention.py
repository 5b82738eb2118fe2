"""transformers' attention interface routed to the context-parallel attention op.

A model whose attention modules look their function up by `config._attn_implementation`
(every decoder in transformers 4.48 and later) is given a config of its own whose
implementation is a name registered here: its attention calls then reach
`retarget::context_attention` with the module's scale, causality and sliding window, and a
captured block holds that op as one node. transformers builds no mask for a name it has no
mask function for (its mask helpers return None), so masks are the op's, from global
positions. What the op cannot honour is refused when called: an explicit 4-D mask, attention
dropout, a softcap.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

#: Registered implementation names start with this; the layout key follows.
PREFIX = "retarget_cp_"


def implementation_name(layout_key: int) -> str:
    return f"{PREFIX}{layout_key}"


def register_implementation(layout_key: int) -> str:
    """Register the attention function for layout `layout_key` with transformers; its name."""
    from transformers import AttentionInterface

    name = implementation_name(layout_key)

    def context_parallel_attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        sliding_window: int | None = None,
        is_causal: bool | None = None,
        softcap: float | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        where = type(module).__name__
        if attention_mask is not None:
            raise ValueError(
                f"cp: {where} was handed an attention mask of shape {tuple(attention_mask.shape)};"
                " context parallelism builds its masks from positions (causal, sliding window) "
                "and does not take padding or custom masks: pass unpadded (packed) sequences"
            )
        if dropout:
            raise ValueError(
                f"cp: {where} runs attention dropout {dropout}; the split attention has none: "
                "set the config's attention_dropout to 0"
            )
        if softcap:
            raise ValueError(
                f"cp: {where} caps attention scores (softcap={softcap}), which "
                "the split attention does not implement"
            )
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out, _ = torch.ops.retarget.context_attention(
            query, key, value, float(scale), bool(causal), int(sliding_window or 0), layout_key
        )
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, context_parallel_attention)
    return name
