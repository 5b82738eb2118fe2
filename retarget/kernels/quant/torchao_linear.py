"""TorchaoLinear: a frozen quantized nn.Linear whose weight is one of torchao's tensor subclasses
(`quant[backend=torchao]`).

- nf4: torchao's `NF4Tensor` (`to_nf4`: 4-bit normal-float codes per block of `block_size`
  weights, the block scales themselves quantized to int8 per 256 scales: torchao's QLoRA
  format, the one torchtune trains with). Its scale blocks need the weight's element count to be
  a multiple of block_size x 256 (`NF4_SCALER_BLOCK`); the quant rule table keeps a smaller
  Linear as it is, saying so.
- int8: torchao's `Int8Tensor` with one scale per output row (`Int8WeightOnlyConfig`'s
  default), whose `F.linear` runs torchao's weight-only int8 kernel.

It is a QuantizedLinear (so every rule, optimizer check and save path that finds quantized
modules finds it) with torchao's storage and kernels in place of ours, and the same contract:
the output in the input's dtype, computed in `compute_dtype`; gradients to the input and the
bias, never to the weight; only the quantized weight saved for backward, where it is
dequantized again (`TorchaoMatmul`). `dequantized_weight()` / `original_state()` give the float
weight back for unwrap() and save_model. FSDP2 shards an NF4Tensor through torchao's own FSDP
hooks (its pre/post all-gather and split), gathering it in the policy's dtype itself, so it is
never re-stored (`store_as`); Int8Tensor has no split, and quantize_linears refuses it under
fsdp. Not here: loading a checkpoint into it (`load_weight`): load_and_quantize_model builds
native modules.

torchao is imported when a module is built (it is an optional package, slow to import); the
pass checks that it is installed with these names (`torchao_api`) before swapping anything.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from retarget.kernels.quant.linear import ForeignQuantizedLinear

#: NF4Tensor quantizes its block scales in blocks of this many scales.
NF4_SCALER_BLOCK = 256
#: The names this backend takes from `torchao.quantization` (0.18 is the version tested).
TORCHAO_NAMES = ("NF4Tensor", "to_nf4", "Int8Tensor", "PerRow")


def torchao_api() -> Any:
    """`torchao.quantization`, refused with what to do when it is missing or lacks a name."""
    try:
        import torchao.quantization as quantization
    except ImportError as error:
        raise ImportError(
            "quant[backend=torchao] needs torchao: pip install torchao (0.18 is tested), or "
            f"use backend=native ({error})"
        ) from error
    missing = [name for name in TORCHAO_NAMES if not hasattr(quantization, name)]
    if missing:
        import torchao

        version = getattr(torchao, "__version__", "unknown")
        raise ImportError(
            f"quant[backend=torchao]: torchao {version} has no {', '.join(missing)} in "
            "torchao.quantization; install torchao 0.18 or newer, or use backend=native"
        )
    return quantization


def dense(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float (out, in) matrix a torchao quantized weight stands for, in `dtype`."""
    if hasattr(weight, "get_original_weight"):  # NF4Tensor: .to(dtype) dequantizes
        return weight.to(dtype)
    return weight.dequantize(dtype)


class TorchaoMatmul(torch.autograd.Function):
    """F.linear(x, weight, bias) with torchao's kernel (NF4 dequantizes itself; Int8Tensor runs
    its weight-only matmul), saving the quantized weight only; backward dequantizes it again."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.dtype, ctx.has_bias = dtype, bias is not None
        if hasattr(weight, "get_original_weight"):
            return F.linear(x, weight.to(dtype), bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (weight,) = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ dense(weight, ctx.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, None, grad_bias, None


class TorchaoLinear(ForeignQuantizedLinear):
    """y = x @ W.T + bias with W one of torchao's quantized tensors (see the module docstring)."""

    backend = "torchao"

    def quantize(self, weight: torch.Tensor) -> torch.Tensor:
        """torchao's tensor for `weight` (layout.format nf4 or int8)."""
        api = torchao_api()
        layout = self.layout
        if layout.format == "nf4":
            return api.to_nf4(weight, layout.block_size, NF4_SCALER_BLOCK)
        if layout.format == "int8":
            return api.Int8Tensor.from_hp(weight, granularity=api.PerRow())
        raise ValueError(f"torchao backend: no {layout.format} format (nf4 or int8)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype or x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return TorchaoMatmul.apply(x.to(dtype), self.weight, bias, dtype).to(x.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        return dense(self.weight.detach(), self.weight_dtype)

    def dequantized_from(self, stored: torch.Tensor) -> torch.Tensor:
        return dense(stored, self.weight_dtype)

    def quantized_bytes(self) -> int:
        names, _ = self.weight.__tensor_flatten__()
        parts = [getattr(self.weight, name) for name in names]
        return sum(t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor))
