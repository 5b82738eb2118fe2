"""BnbLinear: a frozen quantized nn.Linear on bitsandbytes' formats and kernels
(`quant[backend=bnb]`).

- 4 bits (nf4 / fp4): `bitsandbytes.functional.quantize_4bit`, Linear4bit's format (codes packed
  two per byte, one absmax per block of `block_size` weights, with `double_quant` the absmax
  themselves 8-bit per 256 blocks: bitsandbytes' `compress_statistics`); each call runs
  `bitsandbytes.matmul_4bit`, bitsandbytes' QLoRA matmul, which saves the packed weight for
  backward and dequantizes it there.
- 8 bits: LLM.int8's weight format (`int8_vectorwise_quant`: int8 per weight, one float scale
  per output row, as Linear8bitLt's `Int8Params` hold it) through `bitsandbytes.matmul` with
  no outlier threshold (Linear8bitLt's default). In training on a CPU that matmul dequantizes
  the weight (bitsandbytes' MatMul8bitFp); elsewhere it quantizes the activations to int8 too
  (LLM.int8), so outputs move more than weight-only int8's.

It is a QuantizedLinear (every rule, optimizer check and save path that finds quantized
modules finds it) with bitsandbytes' storage and kernels in place of ours. Like the native
module, the whole quantized state (codes and every scale bitsandbytes keeps in its QuantState)
is ONE frozen 1-D uint8 Parameter `weight`, so a state dict or checkpoint holds all of it under
the Linear's own key and loading it back restores the module exactly; the sections are viewed
out of it at each call (`_Sections`). The module's output has the input's dtype, computed in
`compute_dtype` (None: the input's).

Not here: FSDP or DDP over it (quantize_linears refuses them by name; the native and torchao
backends shard), loading a checkpoint tensor by tensor (load_and_quantize_model builds native
modules), meta weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from retarget.kernels.quant.linear import ForeignQuantizedLinear

#: Block sizes bitsandbytes' 4-bit quantization takes.
BNB_BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
#: Sections start at multiples of this many bytes, so each can be viewed as its own dtype.
_ALIGN = 8


def bnb_api() -> Any:
    """The `bitsandbytes` module, refused with what to do when it is missing."""
    try:
        import bitsandbytes
    except ImportError as error:
        raise ImportError(
            "quant[backend=bnb] needs bitsandbytes: pip install bitsandbytes (0.50 is tested), "
            f"or use backend=native, the same nf4/fp4/int8 formats in torch ops ({error})"
        ) from error
    return bitsandbytes


@dataclass(frozen=True)
class _Section:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _Sections:
    """Named tensors packed into one uint8 buffer, each at an aligned offset."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.sections: dict[str, _Section] = {}
        offset = 0
        for name, tensor in tensors.items():
            self.sections[name] = _Section(offset, tensor.dtype, tuple(tensor.shape))
            offset += -(-self.sections[name].nbytes // _ALIGN) * _ALIGN
        self.nbytes = offset

    def pack(self, tensors: dict[str, torch.Tensor], device: Any) -> torch.Tensor:
        buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        for name, tensor in tensors.items():
            section = self.sections[name]
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[section.offset : section.offset + section.nbytes] = raw
        return buffer

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        section = self.sections[name]
        raw = buffer[section.offset : section.offset + section.nbytes]
        return raw.view(section.dtype).view(section.shape)


class BnbLinear(ForeignQuantizedLinear):
    """y = x @ W.T + bias with W in bitsandbytes' format (see the module docstring)."""

    backend = "bnb"

    def quantize(self, weight: torch.Tensor) -> torch.Tensor:
        """bitsandbytes' codes and scales for `weight` (layout.format nf4, fp4 or int8), packed
        into one uint8 buffer; the sections and the QuantState's plain fields stay here."""
        bnb = bnb_api()
        layout = self.layout
        if layout.format == "int8":
            codes, scales, _ = bnb.functional.int8_vectorwise_quant(weight.to(torch.float16))
            parts = {"codes": codes, "scales": scales.to(torch.float32)}
            self._state_fields: dict[str, Any] = {}
        else:
            codes, state = bnb.functional.quantize_4bit(
                weight,
                blocksize=layout.block_size,
                compress_statistics=layout.double_quant,
                quant_type=layout.format,
                quant_storage=torch.uint8,
            )
            parts = {"codes": codes, "absmax": state.absmax, "code": state.code}
            if state.nested:
                parts |= {
                    "offset": state.offset.reshape(1),
                    "absmax2": state.state2.absmax,
                    "code2": state.state2.code,
                }
            self._state_fields = {
                "shape": state.shape,
                "dtype": state.dtype,
                "blocksize": state.blocksize,
                "quant_type": state.quant_type,
                "blocksize2": state.state2.blocksize if state.nested else None,
            }
        self._sections = _Sections(parts)
        return self._sections.pack(parts, weight.device)

    def _quant_state(self, stored: torch.Tensor) -> Any:
        """bitsandbytes' QuantState over the sections of `stored` (a 4-bit weight's buffer)."""
        functional = bnb_api().functional
        fields = self._state_fields

        def view(name: str) -> torch.Tensor:
            return self._sections.view(stored, name)

        nested = None
        if fields["blocksize2"] is not None:
            nested = functional.QuantState(
                absmax=view("absmax2"), code=view("code2"), blocksize=fields["blocksize2"],
                dtype=torch.float32,
            )  # fmt: skip
        return functional.QuantState(
            absmax=view("absmax"),
            shape=fields["shape"],
            code=view("code"),
            blocksize=fields["blocksize"],
            quant_type=fields["quant_type"],
            dtype=fields["dtype"],
            offset=view("offset")[0] if nested is not None else None,
            state2=nested,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bnb = bnb_api()
        dtype = self.compute_dtype or x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        stored = self.weight
        if self.layout.format == "int8":
            state = bnb.MatmulLtState()
            state.CB = self._sections.view(stored, "codes")
            state.SCB = self._sections.view(stored, "scales")
            state.has_fp16_weights = False
            state.is_training = self.training
            out = bnb.matmul(x.to(dtype), state.CB, bias=bias, state=state)
        else:
            codes = self._sections.view(stored, "codes")
            state = self._quant_state(stored)
            out = bnb.matmul_4bit(x.to(dtype), codes.t(), quant_state=state, bias=bias)
        return out.to(x.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        return self.dequantized_from(self.weight.detach())

    def dequantized_from(self, stored: torch.Tensor) -> torch.Tensor:
        functional = bnb_api().functional
        stored = stored.to(self.weight.device)
        codes = self._sections.view(stored, "codes")
        if self.layout.format == "int8":
            scales = self._sections.view(stored, "scales")
            dense = functional.int8_vectorwise_dequant(codes, scales)
        else:
            dense = functional.dequantize_4bit(codes, self._quant_state(stored))
        return dense.to(self.weight_dtype)
