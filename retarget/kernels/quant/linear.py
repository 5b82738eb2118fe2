"""QuantizedLinear: a frozen quantized nn.Linear (weight-only quantization, our native backend).

The weight lives as one frozen Parameter `weight` (so state_dict keys stay the Linear's), the
format's byte buffer (1-D, formats.py) viewed as a float
dtype (see formats.py): FSDP2 shards, gathers and checkpoints it like any parameter, and the
dtype is the one FSDP gathers in, so a MixedPrecisionPolicy never casts (and so never corrupts)
its bytes. Each call dequantizes the whole weight in the compute dtype and runs one matmul;
gradients flow to the input (and to the bias when it is trainable), never to the weight. The
matmul is `DequantizedLinear`, which saves the packed weight for backward and dequantizes it
again there: a plain F.linear would save the dequantized weight, so that between forward and
backward a training step held a full-precision copy of every quantized weight (7x the packed
bytes in float32, as much as the unquantized model: QLoRA's saving gone). bitsandbytes'
MatMul4Bit and torchao's LinearNF4 do the same.
The output has the input's dtype, as bitsandbytes' Linear4bit returns it: the module is
dtype-preserving wherever it runs (eager, under torch.autocast, or called from a graph).

It subclasses nn.Linear so that PEFT puts LoRA on it (its LoRA layers wrap nn.Linear bases,
as they wrap bitsandbytes' Linear4bit), with `in_features`/`out_features` as the Linear's; but
it never runs nn.Linear's __init__ or forward, and the rules that act on plain Linears check
the exact class (autocast's leaf rule, quant's and fp8's tables keep it as it is). Code that
rewrites a Linear's `.weight` as an (out, in) matrix (PEFT's merge, torch's tensor-parallel
styles) fails loudly on the 1-D buffer: the quant part refuses tp by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from retarget.kernels.quant.formats import (
    QuantLayout,
    code_levels,
    dequantize,
    quantize,
    quantize_from,
)


class DequantizedLinear(torch.autograd.Function):
    """F.linear(x, dequantize(packed), bias), saving only the packed weight (and the code's
    levels) for backward, where the weight is dequantized again for the input's gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        layout: QuantLayout,
        dtype: torch.dtype,
        levels: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(packed, levels)
        ctx.layout, ctx.dtype, ctx.has_bias = layout, dtype, bias is not None
        return F.linear(x, dequantize(packed, layout, dtype, levels), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        packed, levels = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ dequantize(packed, ctx.layout, ctx.dtype, levels)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, None, grad_bias, None, None, None


class QuantizedLinear(nn.Linear):
    """y = x @ dequantize(weight).T + bias, computed in `compute_dtype` (None: x's dtype)."""

    #: Whose format and kernels hold the weight (quant[backend=...]).
    backend = "native"

    def __init__(
        self,
        linear: nn.Linear,
        layout: QuantLayout,
        *,
        storage_dtype: torch.dtype,
        compute_dtype: torch.dtype | None,
    ) -> None:
        """Quantize `linear`'s weight (a meta weight gives a meta buffer, to fill with
        `load_weight`); its bias stays the same Parameter, trainable or not as it was."""
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a float weight
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.layout = layout
        self.compute_dtype = compute_dtype
        self.weight_dtype = linear.weight.dtype
        """The dtype the weight had; `dequantized_weight()` returns it in that dtype."""
        if linear.weight.is_meta:
            count = layout.storage_numel(storage_dtype)
            stored = torch.empty(count, dtype=storage_dtype, device="meta")
        else:
            stored = quantize(linear.weight, layout, storage_dtype)
        self.weight = nn.Parameter(stored, requires_grad=False)
        self.bias = linear.bias
        # The code's values, moved with the module and kept out of its state_dict.
        device = linear.weight.device if not linear.weight.is_meta else None
        self.register_buffer("levels", code_levels(layout.format, device), persistent=False)

    def load_weight(self, weight: torch.Tensor) -> None:
        """Quantize a float (out, in) weight into this module (loading from a checkpoint)."""
        stored = quantize(weight, self.layout, self.weight.dtype)
        self.weight = nn.Parameter(stored, requires_grad=False)

    def load_weight_from(self, read: Callable[[int, int], torch.Tensor], device: Any) -> None:
        """`load_weight` of a weight read piece by piece (see formats.quantize_from)."""
        stored = quantize_from(read, self.layout, self.weight.dtype, device)
        self.weight = nn.Parameter(stored, requires_grad=False)

    def store_as(self, dtype: torch.dtype) -> None:
        """Hold the same bytes viewed as `dtype` (lossless; for FSDP's gather dtype)."""
        if self.weight.dtype == dtype:
            return
        raw = self.weight.detach().reshape(-1).view(torch.uint8)
        size = torch.empty((), dtype=dtype).element_size()
        padded = torch.zeros(-(-raw.numel() // size) * size, dtype=torch.uint8, device=raw.device)
        padded[: raw.numel()] = raw
        self.weight = nn.Parameter(padded.view(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype or x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        out = DequantizedLinear.apply(
            x.to(dtype), self.weight, bias, self.layout, dtype, self.levels
        )
        return out.to(x.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The (out, in) weight this module computes with, in the dtype it had."""
        return dequantize(self.weight.detach(), self.layout, self.weight_dtype, self.levels)

    def dequantized_from(self, stored: torch.Tensor) -> torch.Tensor:
        """The (out, in) weight, in the dtype it had, that `stored` (this module's weight as
        gathered or saved, on any device) holds."""
        return dequantize(stored, self.layout, self.weight_dtype)

    def original_state(self) -> dict[str, torch.Tensor | None]:
        """What the nn.Linear it replaced held: the dequantized weight, and the bias.

        Under FSDP2 the packed weight is gathered whole first (a collective)."""
        weight = self.weight.detach()
        full = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
        weight = self.dequantized_from(full)
        return {"weight": weight, **({"bias": self.bias} if self.bias is not None else {})}

    def quantized_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def extra_repr(self) -> str:
        compute = str(self.compute_dtype).replace("torch.", "") if self.compute_dtype else "input"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, format={self.layout.format}, "
            f"backend={self.backend}, block_size={self.layout.block_size}, "
            f"double_quant={self.layout.double_quant}, "
            f"compute={compute}"
        )


class ForeignQuantizedLinear(QuantizedLinear):
    """A QuantizedLinear whose weight is another library's format (torchao's, bitsandbytes'):
    quantized from a float Linear when the quant pass swaps it, never loaded from a checkpoint
    tensor by tensor (load_and_quantize_model builds native modules) and never re-stored in
    another dtype (the native buffer's FSDP storage trick)."""

    def __init__(
        self, linear: nn.Linear, layout: QuantLayout, *, compute_dtype: torch.dtype | None
    ) -> None:
        """Quantize `linear`'s weight in the library's format (`quantize`); its bias stays the
        same Parameter, trainable or not as it was."""
        nn.Module.__init__(self)  # neither nn.Linear's nor QuantizedLinear's: no float weight
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.layout = layout
        self.compute_dtype = compute_dtype
        self.weight_dtype = linear.weight.dtype
        stored = self.quantize(linear.weight.detach())
        self.weight = nn.Parameter(stored, requires_grad=False)
        self.bias = linear.bias

    def quantize(self, weight: torch.Tensor) -> torch.Tensor:
        """The stored form of the float (out, in) `weight` (self.layout says the format)."""
        raise NotImplementedError

    def load_weight(self, weight: torch.Tensor) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} (backend={self.backend}) does not load checkpoints; "
            "load_and_quantize_model builds native QuantizedLinear modules"
        )

    def load_weight_from(self, read: Callable[[int, int], torch.Tensor], device: Any) -> None:
        self.load_weight(torch.empty(0))

    def store_as(self, dtype: torch.dtype) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} keeps backend={self.backend}'s own storage: its bytes are "
            "never re-stored"
        )
