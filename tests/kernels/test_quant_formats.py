"""The weight quantization formats (nf4, fp4, int8) and the frozen QuantizedLinear built on them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from retarget.kernels.quant.formats import (
    FP4_LEVELS,
    NF4_LEVELS,
    QuantLayout,
    dequantize,
    max_error,
    quantize,
)
from retarget.kernels.quant.linear import QuantizedLinear

LEVELS = {"nf4": NF4_LEVELS, "fp4": FP4_LEVELS}


@pytest.mark.parametrize("fmt", ["nf4", "fp4"])
def test_every_level_of_the_code_comes_back_exactly(fmt):
    """A block holding each level times its absmax dequantizes to itself: codes, nibble order
    (high first) and scales all line up."""
    levels = torch.tensor(LEVELS[fmt])
    scale = 0.37
    row = torch.cat([levels, levels.flip(0)]) * scale  # 32 values, absmax = scale
    weight = torch.stack([row, row * 2])  # a second block with another scale
    layout = QuantLayout(fmt, (2, 32), 32, False)
    back = dequantize(quantize(weight, layout, torch.float32), layout, torch.float32)
    torch.testing.assert_close(back, weight, rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    ("fmt", "double_quant"), [("nf4", False), ("nf4", True), ("fp4", False), ("int8", False)]
)
@pytest.mark.parametrize("shape", [(96, 130), (7, 5)])
def test_error_stays_within_half_a_level_step(fmt, double_quant, shape):
    torch.manual_seed(0)
    weight = torch.randn(shape) * 0.02
    layout = QuantLayout(fmt, shape, 64, double_quant)
    back = dequantize(quantize(weight, layout, torch.float32), layout, torch.float32)
    if fmt == "int8":
        scale = weight.abs().amax(dim=1, keepdim=True).expand(shape)
    else:
        flat = F.pad(weight.reshape(-1), (0, layout.blocks * 64 - weight.numel()))
        absmax = flat.reshape(-1, 64).abs().amax(dim=1)
        scale = absmax.repeat_interleave(64)[: weight.numel()].reshape(shape)
    # Double quantization moves each block's scale by at most half an int8 step of its group.
    slack = 1.02 if double_quant else 1.0 + 1e-6
    assert ((back - weight).abs() <= max_error(layout) * scale * slack + 1e-9).all()
    assert (back - weight).abs().max() > 0  # it did quantize


def test_sizes_and_storage_dtypes():
    layout = QuantLayout("nf4", (256, 256), 64, False)
    # 4 bits per weight plus a float32 absmax per 64 weights.
    assert layout.nbytes == 256 * 256 // 2 + 4 * 256 * 256 // 64
    double = QuantLayout("nf4", (256, 256), 64, True)
    assert double.nbytes < layout.nbytes
    assert QuantLayout("int8", (256, 256), 64, False).nbytes == 256 * 256 + 4 * 256
    weight = torch.randn(256, 256)
    as_f32 = quantize(weight, layout, torch.float32)
    as_bf16 = quantize(weight, layout, torch.bfloat16)
    assert as_f32.dtype == torch.float32 and as_bf16.dtype == torch.bfloat16
    assert as_f32.numel() * 4 == as_bf16.numel() * 2 == layout.nbytes
    assert torch.equal(as_f32.view(torch.uint8), as_bf16.view(torch.uint8))  # the same bytes
    assert torch.equal(
        dequantize(as_f32, layout, torch.float32), dequantize(as_bf16, layout, torch.float32)
    )


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="unknown quantization format 'nf3'"):
        QuantLayout("nf3", (4, 4), 64, False)
    with pytest.raises(ValueError, match="block_size=63: 4-bit blocks need an even size"):
        QuantLayout("nf4", (4, 4), 63, False)
    with pytest.raises(ValueError, match=r"weight of shape \(4, 5\) for a layout of \(4, 4\)"):
        quantize(torch.zeros(4, 5), QuantLayout("nf4", (4, 4), 64, False), torch.float32)


def _quantized(bias: bool = True, compute: torch.dtype | None = None) -> QuantizedLinear:
    torch.manual_seed(0)
    linear = nn.Linear(40, 24, bias=bias)
    layout = QuantLayout("nf4", (24, 40), 64, True)
    return QuantizedLinear(linear, layout, storage_dtype=torch.float32, compute_dtype=compute)


def test_quantized_linear_is_the_matmul_with_the_dequantized_weight():
    module = _quantized()
    x = torch.randn(3, 40, requires_grad=True)
    out = module(x)
    expected = F.linear(x, module.dequantized_weight(), module.bias)
    assert torch.equal(out, expected)
    out.sum().backward()
    assert x.grad is not None and module.bias.grad is not None
    assert module.weight.grad is None and not module.weight.requires_grad
    assert module.weight.dtype == torch.float32 and module.weight.dim() == 1
    assert "format=nf4" in repr(module) and "double_quant=True" in repr(module)


def test_quantized_linear_computes_in_its_compute_dtype_and_returns_the_input_dtype():
    module = _quantized(compute=torch.bfloat16)
    x = torch.randn(3, 40)
    out = module(x)
    assert out.dtype == torch.float32
    expected = F.linear(
        x.bfloat16(), module.dequantized_weight().bfloat16(), module.bias.bfloat16()
    ).float()
    assert torch.equal(out, expected)


def test_a_training_forward_saves_the_packed_weight_not_a_dequantized_copy():
    """Between forward and backward a quantized Linear holds its packed bytes only: a plain
    F.linear on the dequantized weight would keep a full-precision copy of it for the input's
    gradient (7x the packed bytes), which is the memory QLoRA exists to save."""
    module = _quantized()
    module.bias.requires_grad_(True)
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    x = torch.randn(3, 40, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = module(x)
    assert any(t is module.weight or t.data_ptr() == module.weight.data_ptr() for t in saved)
    assert all(t.numel() < module.in_features * module.out_features for t in saved), [
        t.shape for t in saved
    ]
    out.square().sum().backward()
    reference_x = x.detach().clone().requires_grad_(True)
    reference_bias = module.bias.detach().clone().requires_grad_(True)
    F.linear(reference_x, module.dequantized_weight(), reference_bias).square().sum().backward()
    assert torch.equal(x.grad, reference_x.grad)
    assert torch.equal(module.bias.grad, reference_bias.grad)


def test_original_state_gives_back_what_the_linear_held():
    module = _quantized(bias=False)
    state = module.original_state()
    assert set(state) == {"weight"}
    assert state["weight"].shape == (24, 40)
    assert torch.equal(state["weight"], module.dequantized_weight())


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_quantizing_in_chunks_writes_the_same_bytes(monkeypatch, fmt):
    """quantize works through CHUNK weights at a time (to bound its temporaries while a
    checkpoint loads); a chunk boundary inside the weight changes no byte."""
    from retarget.kernels.quant import formats

    torch.manual_seed(0)
    weight = torch.randn(50, 70)
    layout = QuantLayout(fmt, (50, 70), 64, fmt == "nf4")
    whole = quantize(weight, layout, torch.float32)
    monkeypatch.setattr(formats, "CHUNK", 128)  # 2 blocks, or 1 row, per chunk
    assert torch.equal(
        quantize(weight, layout, torch.float32).view(torch.uint8), whole.view(torch.uint8)
    )
