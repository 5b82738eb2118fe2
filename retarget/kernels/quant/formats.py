"""Weight quantization formats: 4-bit NF4 / FP4 with blockwise scales, 8-bit int8 per row.

- nf4 (4 bits): 16 levels at the quantiles of a normal distribution, scaled to [-1, 1] (QLoRA,
  Dettmers et al. 2023); one absmax per block of `block_size` weights (itself int8 with
  `double_quant`).
- fp4 (4 bits): the E2M1 grid (0, 0.5, 1, 1.5, 2, 3, 4, 6, signed) over 6; scales as nf4.
- int8 (8 bits): round(w / scale) in [-127, 127], scale = absmax / 127 per output row.

A quantized weight is ONE flat byte buffer (`QuantLayout` says where each section starts), so a
module holds one frozen tensor that FSDP2 can shard like any parameter: the buffer is stored
viewed as a float dtype (`storage_dtype`, the dtype FSDP gathers in), as bitsandbytes'
`quant_storage` does. Its sections: the codes (two 4-bit codes per byte, high nibble first, or
one int8 per weight), then the scales: float32 absmax per block, or with `double_quant` int8
absmax per block, a float32 scale per group of 256 blocks and one float32 offset (the absmax
mean). Sections start at multiples of 8 bytes, so each can be viewed as its own dtype.

The layout is a function of (shape, format, block_size, double_quant): a state dict holds only
the buffer. Everything here is torch ops, on any device; dequantizing allocates the weight in
the compute dtype for one matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: The NF4 code: 16 values at quantiles of N(0, 1), scaled to [-1, 1], with an exact zero.
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
#: The FP4 (E2M1) magnitudes over 6 (the largest), both signs; code 8 is -0.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_LEVELS = tuple(v / 6 for v in _E2M1) + tuple(-v / 6 for v in _E2M1)
LEVELS = {"nf4": NF4_LEVELS, "fp4": FP4_LEVELS}
FORMATS = ("nf4", "fp4", "int8")
BITS = {"nf4": 4, "fp4": 4, "int8": 8}
#: Blocks of absmax that share one float32 scale under double quantization.
DOUBLE_QUANT_GROUP = 256
#: Weights quantized at a time (the float32 temporaries of one chunk: a few hundred KiB).
CHUNK = 1 << 16
_ALIGN = 8


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class QuantLayout:
    """Where each section of a quantized weight's byte buffer lies."""

    format: str
    shape: tuple[int, int]
    block_size: int
    double_quant: bool

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown quantization format {self.format!r}: one of {FORMATS}")
        if BITS[self.format] == 4 and (self.block_size < 2 or self.block_size % 2):
            raise ValueError(f"block_size={self.block_size}: 4-bit blocks need an even size")

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def blocks(self) -> int:
        """4-bit: blocks of absmax; int8: rows."""
        if BITS[self.format] == 8:
            return self.shape[0]
        return -(-self.numel // self.block_size)

    @property
    def code_bytes(self) -> int:
        return self.numel if BITS[self.format] == 8 else self.blocks * self.block_size // 2

    @property
    def groups(self) -> int:
        return -(-self.blocks // DOUBLE_QUANT_GROUP)

    @property
    def scale_bytes(self) -> int:
        if not self.double_quant:
            return 4 * self.blocks
        return _aligned(self.blocks) + 4 * self.groups + 4

    @property
    def nbytes(self) -> int:
        return _aligned(self.code_bytes) + _aligned(self.scale_bytes)

    def storage_numel(self, storage_dtype: torch.dtype) -> int:
        """Elements of the buffer viewed as `storage_dtype` (bytes rounded up to whole ones)."""
        size = torch.empty((), dtype=storage_dtype).element_size()
        return -(-self.nbytes // size)


def quantize(weight: torch.Tensor, layout: QuantLayout, storage_dtype: torch.dtype) -> torch.Tensor:
    """`weight` (out, in) as the layout's byte buffer, viewed as `storage_dtype` (1-D).

    Works through the weight CHUNK weights at a time, so the float32 temporaries stay small
    next to the buffer."""
    if tuple(weight.shape) != layout.shape:
        raise ValueError(f"weight of shape {tuple(weight.shape)} for a layout of {layout.shape}")
    flat = weight.detach().reshape(-1)
    return quantize_from(lambda start, count: flat[start : start + count], layout, storage_dtype)


def quantize_from(
    read: Callable[[int, int], torch.Tensor],
    layout: QuantLayout,
    storage_dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """`quantize` of a weight read piece by piece: `read(start, count)` gives `count` weights
    of the row-major flat weight from `start` (a checkpoint loader reads them straight from the
    file, so the whole float weight never exists in memory)."""
    probe = read(0, 1)
    device = device if device is not None else probe.device
    buffer = torch.zeros(
        layout.storage_numel(storage_dtype) * _size(storage_dtype), dtype=torch.uint8, device=device
    )
    scales = torch.empty(layout.blocks, dtype=torch.float32, device=device)
    if BITS[layout.format] == 8:
        out, inner = layout.shape
        rows = max(1, CHUNK // max(1, inner))
        for first in range(0, out, rows):
            count = min(rows, out - first)
            w = read(first * inner, count * inner).to(device, torch.float32).reshape(count, inner)
            absmax = w.abs().amax(dim=1)
            scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax)) / 127
            codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            buffer[first * inner : (first + w.shape[0]) * inner] = codes.view(torch.uint8).view(-1)
            scales[first : first + w.shape[0]] = scale
    else:
        size = layout.block_size
        per = max(1, CHUNK // size)
        for first in range(0, layout.blocks, per):
            count = min(per, layout.blocks - first)
            available = min(count * size, layout.numel - first * size)
            chunk = read(first * size, available).to(device, torch.float32)
            packed, absmax = _quantize_4bit(chunk, layout, count)
            buffer[first * size // 2 : (first + count) * size // 2] = packed
            scales[first : first + count] = absmax
    start = _aligned(layout.code_bytes)
    if layout.double_quant:
        q8, group_scale, offset = _quantize_absmax(scales, layout)
        buffer[start : start + layout.blocks] = q8.view(torch.uint8)
        start += _aligned(layout.blocks)
        buffer[start : start + 4 * layout.groups] = group_scale.view(torch.uint8)
        start += 4 * layout.groups
        buffer[start : start + 4] = offset.reshape(1).view(torch.uint8)
    else:
        buffer[start : start + 4 * layout.blocks] = scales.contiguous().view(torch.uint8)
    return buffer.view(storage_dtype)


def dequantize(
    storage: torch.Tensor,
    layout: QuantLayout,
    dtype: torch.dtype,
    levels: torch.Tensor | None = None,
) -> torch.Tensor:
    """The (out, in) weight in `dtype` from a buffer `quantize` wrote (any storage dtype).

    `levels`: the 4-bit code's values on the storage's device (`code_levels`), which a module
    keeps as a buffer so that a call does not build them again (on a GPU: a host-to-device
    copy per call); made here when not given."""
    raw = storage.reshape(-1).view(torch.uint8)
    codes = raw[: layout.code_bytes]
    start = _aligned(layout.code_bytes)
    if layout.double_quant:
        q8 = raw[start : start + layout.blocks].view(torch.int8)
        start += _aligned(layout.blocks)
        group_scale = raw[start : start + 4 * layout.groups].view(torch.float32)
        start += 4 * layout.groups
        offset = raw[start : start + 4].view(torch.float32)
        scales = _dequantize_absmax(q8, group_scale, offset, layout)
    else:
        scales = raw[start : start + 4 * layout.blocks].view(torch.float32)
    out, inner = layout.shape
    if BITS[layout.format] == 8:
        w = codes.view(torch.int8).reshape(out, inner).to(torch.float32) * scales[:, None]
        return w.to(dtype)
    if levels is None:
        levels = code_levels(layout.format, raw.device)
    pairs = torch.stack((codes >> 4, codes & 15), dim=-1).reshape(-1).long()
    values = levels[pairs].reshape(layout.blocks, layout.block_size) * scales[:, None]
    return values.reshape(-1)[: layout.numel].reshape(out, inner).to(dtype)


def code_levels(format: str, device: torch.device | str | None = None) -> torch.Tensor:
    """The values of a 4-bit code as a float32 tensor (empty for int8, which has none)."""
    return torch.tensor(LEVELS.get(format, ()), dtype=torch.float32, device=device)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _quantize_4bit(
    flat: torch.Tensor, layout: QuantLayout, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, float32 absmax per block) of `count` blocks (the last one padded)."""
    pad = count * layout.block_size - flat.numel()
    blocks = F.pad(flat, (0, pad)).reshape(count, layout.block_size)
    absmax = blocks.abs().amax(dim=1)
    normalized = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]
    levels = code_levels(layout.format, flat.device)
    ordered, order = levels.sort(stable=True)
    # The nearest level: each value falls between two midpoints of the sorted levels.
    nearest = torch.bucketize(normalized, (ordered[1:] + ordered[:-1]) / 2)
    codes = order[nearest].to(torch.uint8).reshape(-1)
    packed = (codes[0::2] << 4) | codes[1::2]
    return packed, absmax


def _quantize_absmax(
    absmax: torch.Tensor, layout: QuantLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Double quantization: absmax - mean as int8 with a float32 scale per group of blocks."""
    offset = absmax.mean()
    centered = F.pad(absmax - offset, (0, layout.groups * DOUBLE_QUANT_GROUP - layout.blocks))
    grouped = centered.reshape(layout.groups, DOUBLE_QUANT_GROUP)
    group_max = grouped.abs().amax(dim=1)
    group_scale = torch.where(group_max > 0, group_max, torch.ones_like(group_max)) / 127
    q8 = torch.round(grouped / group_scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q8.reshape(-1)[: layout.blocks], group_scale, offset


def _dequantize_absmax(
    q8: torch.Tensor, group_scale: torch.Tensor, offset: torch.Tensor, layout: QuantLayout
) -> torch.Tensor:
    pad = layout.groups * DOUBLE_QUANT_GROUP - layout.blocks
    grouped = F.pad(q8.to(torch.float32), (0, pad)).reshape(layout.groups, DOUBLE_QUANT_GROUP)
    absmax = (grouped * group_scale[:, None]).reshape(-1)[: layout.blocks] + offset
    return absmax.clamp_min(0)


def max_error(layout: QuantLayout) -> float:
    """The largest |w - dequantized w| relative to a block's (or row's) absmax, without
    double quantization: half the widest gap between neighbouring levels."""
    if BITS[layout.format] == 8:
        return 0.5 / 127
    levels = sorted(set(LEVELS[layout.format]))
    return max(b - a for a, b in zip(levels, levels[1:], strict=False)) / 2


def bytes_per_weight(layout: QuantLayout) -> float:
    return layout.nbytes / max(1, layout.numel)


__all__ = [
    "BITS",
    "FORMATS",
    "FP4_LEVELS",
    "NF4_LEVELS",
    "QuantLayout",
    "dequantize",
    "max_error",
    "quantize",
]
