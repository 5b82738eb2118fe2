"""What users wrap their models with, compiled for "single": every repeat captured, bitwise eager.

Each case builds the same model twice from seed 0 (a reference that runs eagerly, and one that
`compile_for` compiles), trains both for two SGD steps from the same RNG state, and asserts that
no region ran eagerly and that loss, logits, the returned cache, every gradient and the updated
weights are bitwise equal, then the same for logits and cache of one eval-mode forward. The
wrappers: HF gradient checkpointing, PEFT LoRA, the eager and sdpa attention implementations,
`torch.utils.checkpoint` inside a user's block, blocks taking `**kwargs`, and GPT-2's Conv1D.
Hugging Face configs are the defaults with only the sizes shrunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

import retarget

VOCAB, SEQ, BATCH = 128, 16, 2
LORA_TARGETS = ["q_proj", "v_proj"]


# --------------------------------------------------------------------------- models


def llama(**overrides: Any) -> LlamaForCausalLM:
    """Llama at its default config (use_cache on) with the sizes shrunk; GQA with 2 kv heads."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **overrides,
    )
    return LlamaForCausalLM(config).train()


def bert(**overrides: Any) -> BertForSequenceClassification:
    """BERT classifier at its default config (dropout 0.1) with the sizes shrunk."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        **overrides,
    )
    return BertForSequenceClassification(config).train()


def gpt2() -> GPT2LMHeadModel:
    """GPT-2 at its default config (Conv1D layers, dropout 0.1, use_cache on), sizes shrunk."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    return GPT2LMHeadModel(config).train()


def lora_llama():
    import peft

    model = llama()
    torch.manual_seed(0)  # LoRA's A matrices are drawn at random
    config = peft.LoraConfig(r=4, target_modules=LORA_TARGETS)
    return peft.get_peft_model(model, config)


def checkpointed_llama() -> LlamaForCausalLM:
    model = llama()
    model.gradient_checkpointing_enable()
    return model


class CheckpointedBlock(nn.Module):
    """A pre-norm residual MLP whose forward runs under non-reentrant activation checkpointing."""

    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.mlp, x, use_reentrant=False)


class KwargsBlock(nn.Module):
    """A residual MLP whose options arrive through `**kwargs` (fx refuses such a forward)."""

    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        h = self.fc2(F.gelu(self.fc1(x))) * kwargs.get("scale", 1.0)
        mask = kwargs.get("mask")
        if mask is not None:
            h = h * mask
        return x + h


class BlockStack(nn.Module):
    """Three repeats of a block and a Linear head; the forward returns the logits."""

    def __init__(self, block: type[nn.Module], dim: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block(dim) for _ in range(3))
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale=0.5, mask=mask) if isinstance(block, KwargsBlock) else block(x)
        return self.head(x)


def block_stack(block: type[nn.Module]) -> Callable[[], BlockStack]:
    def factory() -> BlockStack:
        torch.manual_seed(0)
        return BlockStack(block).train()

    return factory


# --------------------------------------------------------------------------- inputs


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def lm_inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=_generator())
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def bert_inputs() -> dict[str, torch.Tensor]:
    """Right padding on the second row, so the attention mask reaches the layers."""
    gen = _generator()
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, SEQ // 2 :] = 0
    labels = torch.randint(0, 2, (BATCH,), generator=gen)
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "labels": labels}


def vector_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = _generator()
    return torch.randn(BATCH, 8, 16, generator=gen), (torch.rand(BATCH, 8, 1, generator=gen) > 0.3)


# --------------------------------------------------------------------------- checks


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs)


def _loss_and_logits(output: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return output.float().square().mean(), output
    return output.loss, output.logits


def cache_tensors(output: Any) -> list[torch.Tensor]:
    """Every key and value tensor of the cache a model returned (none for a plain tensor)."""
    cache = getattr(output, "past_key_values", None)
    if cache is None:
        return []
    return [t.detach() for layer in cache.layers for t in (layer.keys, layer.values)]


def eager_regions(compiled: nn.Module) -> list[str]:
    regions = compiled.program.regions
    return [f"{r.name}: {r.reason}" for r in regions if r.eager_only or r.frontend == "eager"]


def train_step(model: nn.Module, inputs: Any, optimizer: torch.optim.Optimizer, seed: int):
    """One SGD step from RNG state `seed`: loss, logits, returned cache, trainable gradients."""
    optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    output = _call(model, inputs)
    loss, logits = _loss_and_logits(output)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer.step()
    return loss.detach(), logits.detach(), cache_tensors(output), grads


def assert_trains_like_eager(
    factory: Callable[[], nn.Module], inputs: Any, target: str = "single", steps: int = 2
) -> nn.Module:
    """Compile a second copy of the model; both train `steps` SGD steps bitwise alike."""
    reference, model = factory(), factory()
    compiled = retarget.compile_for(model, target, example_inputs=inputs)
    assert eager_regions(compiled) == []
    assert compiled.program.regions, "no region was found"
    trainable = [p for p in reference.parameters() if p.requires_grad]
    sgd_ref = torch.optim.SGD(trainable, lr=0.5)
    sgd = torch.optim.SGD([p for p in compiled.parameters() if p.requires_grad], lr=0.5)
    for seed in range(1, steps + 1):
        loss_ref, logits_ref, cache_ref, grads_ref = train_step(reference, inputs, sgd_ref, seed)
        loss, logits, cache, grads = train_step(compiled, inputs, sgd, seed)
        assert torch.equal(loss, loss_ref), f"step {seed}: loss {loss.item()} != {loss_ref.item()}"
        assert torch.equal(logits, logits_ref), f"step {seed}: logits differ"
        assert len(cache) == len(cache_ref)
        assert all(torch.equal(a, b) for a, b in zip(cache, cache_ref, strict=True)), "cache"
        assert grads.keys() == grads_ref.keys()
        for name, grad in grads.items():
            assert grad is not None and grads_ref[name] is not None, name
            assert torch.equal(grad, grads_ref[name]), f"step {seed}: grad of {name} differs"
    weights_ref = dict(reference.named_parameters())
    for name, param in compiled.named_parameters():
        assert torch.equal(param, weights_ref[name]), f"weight {name} differs after training"
    # Eval mode (HF decoders then fill their cache even under gradient checkpointing).
    outputs = []
    for model in (reference, compiled):
        model.eval()
        with torch.no_grad():
            output = _call(model, inputs)
        outputs.append((_loss_and_logits(output)[1], cache_tensors(output)))
        model.train()
    (logits_ref, cache_ref), (logits, cache) = outputs
    assert torch.equal(logits, logits_ref), "eval logits differ"
    assert len(cache) == len(cache_ref)
    assert all(torch.equal(a, b) for a, b in zip(cache, cache_ref, strict=True)), "eval cache"
    assert eager_regions(compiled) == []
    return compiled


def saved_tensor_count(model: nn.Module, inputs: Any) -> int:
    """How many tensors autograd saves outside any checkpoint during one forward.

    Non-reentrant checkpointing saves through its own saved-tensor hooks, which take precedence
    over these, so a checkpoint that a capture dropped shows up as a higher count.
    """
    count = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return tensor

    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _loss_and_logits(_call(model, inputs))[0].backward()
    model.zero_grad(set_to_none=True)
    return count


# --------------------------------------------------------------------------- cases


@pytest.mark.parametrize("target", ["single", "single+ac"])
def test_hf_gradient_checkpointing_already_enabled(target):
    compiled = assert_trains_like_eager(checkpointed_llama, lm_inputs(), target)
    assert compiled.model.gradient_checkpointing
    # Still checkpointed: autograd keeps exactly what it keeps for the eager checkpointed model.
    assert saved_tensor_count(compiled, lm_inputs()) == saved_tensor_count(
        checkpointed_llama(), lm_inputs()
    )
    assert saved_tensor_count(compiled, lm_inputs()) < saved_tensor_count(llama(), lm_inputs())


def test_peft_lora_trains_only_the_adapters_bitwise(capsys):
    pytest.importorskip("peft")
    compiled = assert_trains_like_eager(lora_llama, lm_inputs())
    compiled.print_trainable_parameters()  # PeftModel's methods work on the compiled model
    assert "trainable params: 1,792" in capsys.readouterr().out
    trainable = [n for n, p in compiled.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # Named like base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
    assert {n.split(".")[-3] for n in trainable} == {"lora_A", "lora_B"}
    assert {n.split(".")[-4] for n in trainable} == set(LORA_TARGETS)
    # B starts at zero, so the second step is the first to move A: both steps were compared.
    peft_model = compiled.unwrap()
    assert peft_model.get_nb_trainable_parameters()[0] == sum(
        compiled.get_parameter(n).numel() for n in trainable
    )
    with torch.no_grad():
        peft_model.eval()
        adapted = peft_model(**lm_inputs()).logits
        merged = peft_model.merge_and_unload()
        assert isinstance(merged, LlamaForCausalLM)
        torch.testing.assert_close(merged(**lm_inputs()).logits, adapted)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_llama_attention_implementations(attention):
    compiled = assert_trains_like_eager(lambda: llama(attn_implementation=attention), lm_inputs())
    assert compiled.config._attn_implementation == attention


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_bert_attention_implementations(attention):
    compiled = assert_trains_like_eager(lambda: bert(attn_implementation=attention), bert_inputs())
    assert compiled.config._attn_implementation == attention


def test_torch_checkpoint_inside_a_users_block():
    factory = block_stack(CheckpointedBlock)
    compiled = assert_trains_like_eager(factory, vector_inputs()[:1])
    # The captured graph must still checkpoint: no more saved tensors than the eager model.
    assert saved_tensor_count(compiled, vector_inputs()[:1]) == saved_tensor_count(
        factory(), vector_inputs()[:1]
    )


def test_blocks_taking_kwargs_are_captured_by_export():
    compiled = assert_trains_like_eager(block_stack(KwargsBlock), vector_inputs())
    (region,) = compiled.program.regions
    assert region.frontend == "export" and region.repeats == 3


def test_gpt2_conv1d_at_default_config():
    compiled = assert_trains_like_eager(gpt2, lm_inputs())
    (region,) = compiled.program.regions
    assert region.block_type == "GPT2Block" and region.repeats == 2
