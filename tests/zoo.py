"""The model zoo that the project's tests run on.

Each :class:`ZooEntry` has a ``factory`` (a fresh model in train mode; it calls
``torch.manual_seed(0)``, so it also resets the global RNG) and an ``inputs(batch)`` function that
returns example inputs in one calling convention: a dict means keyword arguments (Hugging Face
style), a tuple positional arguments, a lone tensor one positional argument. :func:`call` applies
that convention and :func:`loss_of` turns any zoo model's output into a scalar for ``backward``.

The entries cover what a region-by-region capture has to cope with: BatchNorm, dropout, tied
weights, Hugging Face decoder layers with many keyword arguments, a padding mask, and two models
that tracers cannot capture whole (``control_flow_model``) or block by block
(``uncapturable_block_model``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from retarget.frontends.state import copy_state_args

# Shared shape of the Hugging Face models.
VOCAB = 128
HIDDEN = 64
LAYERS = 2
HEADS = 4
INTERMEDIATE = 128
MAX_POSITIONS = 64
SEQ = 16
BERT_LABELS = 3
EXAMPLE_BATCH = 2


def _generator() -> torch.Generator:
    # Inputs come from their own generator so that they neither depend on nor disturb global RNG.
    return torch.Generator().manual_seed(0)


# --------------------------------------------------------------------------- small_cnn


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv+bn, identity (or 1x1 conv+bn) shortcut, relu."""

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = nn.Sequential(BasicBlock(16, 16), BasicBlock(16, 16))
        # Same class as the repeated blocks but another structure (stride, downsample): a capture
        # that keys reuse on the class name alone gets this one wrong.
        self.layer2 = BasicBlock(16, 32, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def small_cnn() -> SmallCNN:
    """ResNet-style CNN with BatchNorm; ``layer1`` holds two identical ``BasicBlock``s."""
    torch.manual_seed(0)
    return SmallCNN().train()


def small_cnn_inputs(batch: int = EXAMPLE_BATCH) -> torch.Tensor:
    return torch.randn(batch, 3, 16, 16, generator=_generator())


# --------------------------------------------------------------------------- mnist_cnn


class MnistNet(nn.Module):
    """The CNN of PyTorch's and Accelerate's MNIST examples, layer for layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def mnist_cnn() -> MnistNet:
    """The MNIST example CNN (no repeated block)."""
    torch.manual_seed(0)
    return MnistNet().train()


def mnist_cnn_inputs(batch: int = EXAMPLE_BATCH) -> torch.Tensor:
    return torch.randn(batch, 1, 28, 28, generator=_generator())


# --------------------------------------------------------------------------- Hugging Face


def tiny_gpt2() -> GPT2LMHeadModel:
    """GPT-2 LM with a tied ``lm_head`` and its default 0.1 dropouts; blocks are ``GPT2Block``."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=MAX_POSITIONS,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_inner=INTERMEDIATE,
        # The defaults (50256) lie outside the small vocabulary and make the config warn.
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    model = GPT2LMHeadModel(config)
    # transformers derives the loss from the class name, which GPT2LMHeadModel does not match:
    # without this it warns on every first forward (and falls back to the same loss).
    model.loss_type = "ForCausalLM"
    return model.train()


def tiny_llama() -> LlamaForCausalLM:
    """Llama causal LM (no dropout modules); blocks are ``LlamaDecoderLayer``."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
    )
    return LlamaForCausalLM(config).train()


def tiny_bert() -> BertForSequenceClassification:
    """BERT sequence classifier with 3 labels and 0.1 dropouts; blocks are ``BertLayer``."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE,
        max_position_embeddings=MAX_POSITIONS,
        num_labels=BERT_LABELS,
    )
    return BertForSequenceClassification(config).train()


def lm_inputs(batch: int = EXAMPLE_BATCH) -> dict[str, torch.Tensor]:
    """Causal-LM kwargs with no padding: ``labels`` are ``input_ids`` (the model shifts them)."""
    input_ids = torch.randint(0, VOCAB, (batch, SEQ), generator=_generator())
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": input_ids.clone(),
    }


def bert_inputs(batch: int = EXAMPLE_BATCH) -> dict[str, torch.Tensor]:
    """Classifier kwargs with right padding: row ``i`` keeps ``max(SEQ - 3 * i, 4)`` tokens.

    Row 0 is never padded, so from batch 2 on the batch mixes padded and unpadded rows and the
    attention mask reaches the layers as a real 4-D mask rather than ``None``.
    """
    gen = _generator()
    pad = BertConfig().pad_token_id
    input_ids = torch.randint(pad + 1, VOCAB, (batch, SEQ), generator=gen)
    lengths = (SEQ - 3 * torch.arange(batch)).clamp(min=4)
    attention_mask = (torch.arange(SEQ) < lengths[:, None]).long()
    return {
        "input_ids": input_ids.masked_fill(attention_mask == 0, pad),
        "attention_mask": attention_mask,
        "labels": torch.randint(0, BERT_LABELS, (batch,), generator=gen),
    }


# --------------------------------------------------------------------------- transformer_encoder


class EncoderClassifier(nn.Module):
    def __init__(self, d_model: int = 32, num_classes: int = 4) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            d_model=d_model, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        # nn.TransformerEncoder deep-copies one layer, so every layer starts with the same
        # weights; re-draw them so that mixing up two layers' weights shows in the outputs.
        for module in self.encoder.layers[1:].modules():
            if isinstance(module, nn.MultiheadAttention):
                module._reset_parameters()
            elif isinstance(module, nn.Linear):
                module.reset_parameters()
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def transformer_encoder() -> EncoderClassifier:
    """Two ``nn.TransformerEncoderLayer``s (d_model 32, dropout 0.1) and a Linear head."""
    torch.manual_seed(0)
    return EncoderClassifier().train()


def transformer_encoder_inputs(batch: int = EXAMPLE_BATCH) -> torch.Tensor:
    return torch.randn(batch, 10, 32, generator=_generator())


# --------------------------------------------------------------------------- control flow


class ResidualMLP(nn.Module):
    """``x + fc2(gelu(fc1(x)))``: a block that every tracer captures."""

    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class ControlFlowNet(nn.Module):
    """Clean repeated blocks under a top-level forward that no tracer can capture whole."""

    def __init__(self, dim: int = 16, num_classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(ResidualMLP(dim) for _ in range(3))
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        # Both branches are parameter-free so every parameter gets a gradient either way.
        if x.sum() > 0:
            x = torch.relu(x)
        else:
            x = torch.tanh(x)
        for _ in range(int(x.detach().abs().mean() * 3) + 1):
            for block in self.blocks:
                x = block(x)
        return self.head(x)


def control_flow_model() -> ControlFlowNet:
    """Data-dependent ``if`` and loop count at the top level; blocks are ``ResidualMLP``."""
    torch.manual_seed(0)
    return ControlFlowNet().train()


def vector_inputs(batch: int = EXAMPLE_BATCH) -> torch.Tensor:
    return torch.randn(batch, 16, generator=_generator())


class DataDependentBlock(nn.Module):
    """A residual MLP whose own forward reads tensor values in Python.

    Eager autograd is exact, but ``float()`` / ``int()`` on a tensor force every tracer
    (``torch.export``, ``torch.fx``, dynamo export) to guard on a value it does not know.
    """

    def __init__(self, dim: int = 16, hidden: int = 32, threshold: float = 1.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Scaled by the size so that the branch does not flip with the batch size alone.
        if float(x.detach().norm()) > self.threshold * x.numel() ** 0.5:
            x = x * 0.5
        for _ in range(int(x.detach().abs().max()) % 2 + 1):
            x = x + self.fc2(F.gelu(self.fc1(x)))
        return x


class UncapturableNet(nn.Module):
    def __init__(self, dim: int = 16, num_classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(DataDependentBlock(dim) for _ in range(3))
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def uncapturable_block_model() -> UncapturableNet:
    """Clean top level around three ``DataDependentBlock``s that no tracer captures."""
    torch.manual_seed(0)
    return UncapturableNet().train()


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ZooEntry:
    name: str
    factory: Callable[[], nn.Module]
    """A fresh, deterministically initialised model in train mode."""
    inputs: Callable[[int], Any]
    """``inputs(batch)``: example inputs in the calling convention of :func:`call`."""
    has_dropout: bool
    has_batchnorm: bool
    repeated_block_type: str | None
    """Class name of the block repeated in the model, ``None`` when there is none."""


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry("small_cnn", small_cnn, small_cnn_inputs, False, True, "BasicBlock"),
        ZooEntry("mnist_cnn", mnist_cnn, mnist_cnn_inputs, True, False, None),
        ZooEntry("tiny_gpt2", tiny_gpt2, lm_inputs, True, False, "GPT2Block"),
        ZooEntry("tiny_llama", tiny_llama, lm_inputs, False, False, "LlamaDecoderLayer"),
        ZooEntry("tiny_bert", tiny_bert, bert_inputs, True, False, "BertLayer"),
        ZooEntry(
            "transformer_encoder",
            transformer_encoder,
            transformer_encoder_inputs,
            True,
            False,
            "TransformerEncoderLayer",
        ),
        ZooEntry(
            "control_flow_model", control_flow_model, vector_inputs, False, False, "ResidualMLP"
        ),
        ZooEntry(
            "uncapturable_block_model",
            uncapturable_block_model,
            vector_inputs,
            False,
            False,
            "DataDependentBlock",
        ),
    )
}


def split_inputs(inputs: Any) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` for zoo inputs, e.g. for ``torch.export.export(model, args, kwargs)``."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, tuple):
        return inputs, {}
    return (inputs,), {}


def call(model: Callable[..., Any], inputs: Any) -> Any:
    """Call ``model`` with zoo inputs in their calling convention."""
    args, kwargs = split_inputs(inputs)
    return model(*args, **kwargs)


def _first_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = tuple(value.values())
    for item in value if isinstance(value, (tuple, list)) else ():
        try:
            return _first_tensor(item)
        except TypeError:
            continue
    raise TypeError(f"no tensor in model output of type {type(value).__name__}")


def loss_of(output: Any) -> torch.Tensor:
    """A scalar to call ``backward`` on, for any zoo model's output.

    The output's ``loss`` (a ModelOutput field or a dict key) when present, else the fp32 mean of
    its first tensor. A mean rather than a sum, like the models' own losses: the value and the
    gradients then do not scale with the batch, so a full batch compares directly with ranks
    that each hold a shard of it and average their gradients.
    """
    if isinstance(output, Mapping) and output.get("loss") is not None:
        return output["loss"]
    return _first_tensor(output).float().mean()


def first_block_call(
    model: nn.Module, inputs: Any, block_type: str
) -> tuple[nn.Module, tuple, dict[str, Any]]:
    """The first module of class ``block_type`` in ``model``, with the args and kwargs it receives
    when ``model`` runs on ``inputs`` (the model runs once, under ``no_grad``)."""
    block = next(m for m in model.modules() if type(m).__name__ == block_type)
    seen: dict[str, Any] = {}

    def record(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if "call" not in seen:  # a KV cache among the inputs is updated by the rest of the forward
            seen["call"] = copy_state_args(args, kwargs)

    handle = block.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            call(model, inputs)
    finally:
        handle.remove()
    args, kwargs = seen["call"]
    return block, args, kwargs
