"""Every transformers config class with a `base_model_tp_plan`, built small for the agreement test.

`build(model_type)` takes the config class's defaults and shrinks only sizes (the fields in
`SIZES`, wherever they sit: the config itself or a `text_config`; 4 layers, so that models
alternating two layer types, or with a first dense layer, still have repeated blocks), builds
the causal-LM class (else the base model) with random weights, and gives example inputs. A model
that cannot be built or run this way raises `Unbuildable` with the reason (a skip in the test).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

SEQ = 8
VOCAB = 128
#: Size fields and their small values; everything else keeps the class default.
SIZES: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rotary_dim": 8,
    "max_position_embeddings": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "moe_hidden_size": 32,
    "intermediate_size_mlp": 128,
    # Falcon's MLP width (4 x its default 4,544: 18,176 wide at any hidden size otherwise).
    "ffn_hidden_size": 128,
    # Multi-head latent attention's low ranks and DeepSeek-V3.2-style indexers (58M parameters
    # at hidden 64 otherwise: an 8,192 x 1,536 indexer projection per layer).
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "o_lora_rank": 32,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


#: A model past this after shrinking kept a size field SIZES does not name (GPT-J's default is
#: 5.6e9 parameters: built whole, it took the test process past the machine's memory).
MAX_PARAMETERS = 64_000_000


class Unbuildable(Exception):
    """The model cannot be built small and run here; the message says why."""


class NotShrunk(AssertionError):
    """The config still builds a large model: a size field is missing from SIZES (a failure,
    not a skip, so that a new transformers' field names are added rather than hidden)."""


def _check_shrunk(auto: Any, config: Any, model_type: str) -> None:
    """Build on the meta device (no memory) and refuse a model over MAX_PARAMETERS."""
    with torch.device("meta"):
        model = auto.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    if total > MAX_PARAMETERS:
        name, largest = max(model.named_parameters(), key=lambda kv: kv[1].numel())
        raise NotShrunk(
            f"{model_type}: {total:,} parameters after shrinking (largest {name} "
            f"{list(largest.shape)}): add its size field to SIZES"
        )


def tp_plan_model_types() -> list[str]:
    """Every model type whose config class carries a base_model_tp_plan."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    found = []
    for model_type in CONFIG_MAPPING.keys():
        try:
            config_class = CONFIG_MAPPING[model_type]
        except Exception:  # a config whose optional dependency is missing
            continue
        if getattr(config_class, "base_model_tp_plan", None):
            found.append(model_type)
    return sorted(found)


def small_config(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    _shrink(config)
    for name in ("text_config", "decoder_config"):
        inner = getattr(config, name, None)
        if inner is not None and hasattr(inner, "to_dict"):
            _shrink(inner)
    return config


def _shrink(config: Any) -> None:
    fields = config.to_dict()
    aliases = getattr(type(config), "attribute_map", {})  # GPT-J's hidden_size is its n_embd
    for key, value in SIZES.items():
        if (key in fields or aliases.get(key) in fields) and isinstance(
            getattr(config, key, None), (int, type(None))
        ):
            setattr(config, key, value)
    if hasattr(config, "layer_types") and isinstance(config.layer_types, list):
        config.layer_types = config.layer_types[: config.num_hidden_layers]


def build(model_type: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers

    try:
        config = small_config(model_type)
    except Exception as exc:
        raise Unbuildable(f"config: {_line(exc)}") from None
    layer_types = getattr(config, "layer_types", None) or ()
    slow = sorted({t for t in layer_types if "linear" in str(t) or "mamba" in str(t)})
    if slow:  # their eager kernels take one to three minutes per forward here
        raise Unbuildable(f"hybrid with {', '.join(slow)} layers: minutes per forward here")
    towers = [n for n in ("vision_config", "audio_config") if getattr(config, n, None) is not None]
    if towers:  # default vision/audio towers take a minute or more to capture here
        raise Unbuildable(f"multimodal composite ({', '.join(towers)}): not built small here")
    model = None
    errors = []
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            _check_shrunk(auto, config, model_type)
            torch.manual_seed(0)
            model = auto.from_config(config).train()
            break
        except NotShrunk:
            raise
        except Exception as exc:
            errors.append(f"{auto.__name__}: {_line(exc)}")
    if model is None:
        raise Unbuildable("; ".join(errors))
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids}
    try:
        with torch.no_grad():
            model(**inputs)
    except Exception as exc:
        raise Unbuildable(f"forward on input_ids: {_line(exc)}") from None
    return model, inputs


def _line(exc: BaseException) -> str:
    text = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {text[:160]}"
