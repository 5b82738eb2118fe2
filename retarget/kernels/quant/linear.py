"""QuantizedLinear: a frozen quantized nn.Linear (weight-only quantization, our native backend).

The weight lives as one frozen Parameter `weight` (so state_dict keys stay the Linear's), the
format's byte buffer (1-D, formats.py) viewed as a float
dtype (see formats.py): FSDP2 shards, gathers and checkpoints it like any parameter, and the
dtype is the one FSDP gathers in, so a MixedPrecisionPolicy never casts (and so never corrupts)
its bytes. Each call dequantizes the whole weight in the compute dtype and runs one matmul;
gradients flow to the input (and to the bias when it is trainable), never to the weight.
The output has the input's dtype, as bitsandbytes' Linear4bit returns it: the module is
dtype-preserving wherever it runs (eager, under torch.autocast, or called from a graph).

It is deliberately not an nn.Linear subclass: code that reads `.weight` of every Linear
(FP8 swaps, torch's tensor-parallel styles, autocast's Linear rule) must not take it for one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from retarget.kernels.quant.formats import QuantLayout, dequantize, quantize


class QuantizedLinear(nn.Module):
    """y = x @ dequantize(weight).T + bias, computed in `compute_dtype` (None: x's dtype)."""

    def __init__(
        self,
        linear: nn.Linear,
        layout: QuantLayout,
        *,
        storage_dtype: torch.dtype,
        compute_dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.layout = layout
        self.compute_dtype = compute_dtype
        self.weight_dtype = linear.weight.dtype
        """The dtype the weight had; `dequantized_weight()` returns it in that dtype."""
        stored = quantize(linear.weight, layout, storage_dtype)
        self.weight = nn.Parameter(stored, requires_grad=False)
        self.bias = linear.bias  # the same Parameter, trainable or not as it was

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype or x.dtype
        weight = dequantize(self.weight, self.layout, dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x.to(dtype), weight, bias).to(x.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The (out, in) weight this module computes with, in the dtype it had."""
        return dequantize(self.weight.detach(), self.layout, self.weight_dtype)

    def original_state(self) -> dict[str, torch.Tensor | None]:
        """What the nn.Linear it replaced held: the dequantized weight, and the bias.

        Under FSDP2 the packed weight is gathered whole first (a collective)."""
        weight = self.weight.detach()
        full = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
        weight = dequantize(full, self.layout, self.weight_dtype)
        return {"weight": weight, **({"bias": self.bias} if self.bias is not None else {})}

    def quantized_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def extra_repr(self) -> str:
        compute = str(self.compute_dtype).replace("torch.", "") if self.compute_dtype else "input"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, format={self.layout.format}, "
            f"block_size={self.layout.block_size}, double_quant={self.layout.double_quant}, "
            f"compute={compute}"
        )
