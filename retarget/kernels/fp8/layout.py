"""CUDA's rules for `torch._scaled_mm`, enforced on every device.

The CPU kernel accepts layouts and shapes that cuBLASLt rejects (a row-major second operand,
dimensions that are not multiples of 16, fp32 output with a bias ...), so a CPU test would never
notice code that fails on the first GPU run. Every FP8 GEMM of the native backend goes through
`scaled_mm`, which checks the rules below first (from `aten/src/ATen/native/cuda/ScaledBlas.cpp`
and cuBLASLt's FP8 requirements). Where CUDA builds differ we keep the strictest portable rule.

    a (M, K) row-major  @  b (K, N) column-major  ->  (M, N)

A row-major weight `w` of shape (N, K) gives the column-major `b` for free as `w.t()`; any other
operand is made column-major with `column_major(t)` (one copy).

On the CPU the GEMM itself is emulated by default: torch's CPU `_scaled_mm` is a slow reference
kernel whose cost depends on the processor (on an Intel Xeon with AMX, 220x an fp32 matmul of
the same 128x1024x1024 shape), while every float8 value is exact in float32,
so `a.float() @ b.float()` multiplies the same numbers, and the scales are applied to the fp32
product as `_scaled_mm` applies them. Only the summation order differs (checked against
`_scaled_mm` in tests/kernels/test_fp8_native.py). `RETARGET_FP8_CPU_GEMM=scaled_mm`, or
`with cpu_fp8_gemm("scaled_mm"):`, runs torch's kernel instead; CUDA always runs `_scaled_mm`.
The layout rules above are checked either way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from retarget.kernels.fp8.recipe import E4M3, E5M2

FP8_DTYPES = (E4M3, E5M2)
MULTIPLE = 16


class ScaledMMLayoutError(RuntimeError):
    """A `_scaled_mm` call breaks a CUDA rule (raised on every device, CPU included)."""


@dataclass(frozen=True)
class Call:
    a: torch.Tensor
    b: torch.Tensor
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    out_dtype: torch.dtype

    @property
    def rowwise(self) -> bool:
        return self.scale_a.numel() != 1 or self.scale_b.numel() != 1


def is_row_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= max(t.size(1), 1)


def is_column_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(0) == 1 and t.stride(1) >= max(t.size(0), 1)


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major (a no-op when it already is)."""
    return t if is_column_major(t) else t.t().contiguous().t()


def pad_rows(t: torch.Tensor, multiple: int = MULTIPLE) -> torch.Tensor:
    """Append zero rows up to a multiple of `multiple` (zero rows add nothing to a GEMM's sum)."""
    missing = -t.size(0) % multiple
    if not missing:
        return t
    return torch.cat([t, t.new_zeros(missing, *t.shape[1:])])


def _scales_ok(c: Call) -> bool:
    if c.scale_a.dtype != torch.float32 or c.scale_b.dtype != torch.float32:
        return False
    if not c.rowwise:
        return True
    m, n = c.a.size(0), c.b.size(1)
    return tuple(c.scale_a.shape) == (m, 1) and tuple(c.scale_b.shape) == (1, n)


#: (rule, check, what CUDA says when it is broken). Checked in order; all broken ones are named.
RULES: tuple[tuple[str, Callable[[Call], bool], str], ...] = (
    ("matrices", lambda c: c.a.dim() == 2 and c.b.dim() == 2, "both operands must be 2-D"),
    (
        "float8",
        lambda c: c.a.dtype in FP8_DTYPES and c.b.dtype in FP8_DTYPES,
        "both operands must be float8_e4m3fn or float8_e5m2",
    ),
    (
        "not_both_e5m2",
        lambda c: not (c.a.dtype == E5M2 and c.b.dtype == E5M2),
        "multiplication of two float8_e5m2 matrices is not supported",
    ),
    ("a_row_major", lambda c: is_row_major(c.a), "the first operand must be row-major"),
    (
        "b_column_major",
        lambda c: is_column_major(c.b),
        "the second operand must be column-major (pass w.t() of a row-major weight)",
    ),
    (
        "k_multiple_of_16",
        lambda c: c.a.size(-1) % MULTIPLE == 0,
        "the first operand's trailing dimension must be divisible by 16",
    ),
    (
        "b_multiple_of_16",
        lambda c: c.b.size(0) % MULTIPLE == 0 and c.b.size(-1) % MULTIPLE == 0,
        "both dimensions of the second operand must be divisible by 16",
    ),
    (
        "scales",
        _scales_ok,
        "scales must be float32: 1 element each, or (M, 1) and (1, N) for row-wise scaling",
    ),
    (
        "rowwise_e4m3",
        lambda c: not c.rowwise or (c.a.dtype == E4M3 and c.b.dtype == E4M3),
        "row-wise scaling takes float8_e4m3fn operands (ROCm and CUTLASS kernels)",
    ),
    (
        "rowwise_bf16_out",
        lambda c: not c.rowwise or c.out_dtype == torch.bfloat16,
        "row-wise scaling outputs bfloat16 (the only type every CUDA/ROCm build takes)",
    ),
)


def broken_rules(a, b, scale_a, scale_b, out_dtype) -> list[str]:
    """Names of the CUDA rules the call would break (empty when CUDA would take it)."""
    call = Call(a, b, scale_a, scale_b, out_dtype)
    broken = []
    for name, holds, _ in RULES:
        if not holds(call):
            broken.append(name)
            if name in ("matrices", "float8"):
                break  # the later checks assume 2-D float8 operands
    return broken


def check_scaled_mm(a, b, scale_a, scale_b, out_dtype: torch.dtype) -> None:
    """Raise ScaledMMLayoutError naming every CUDA rule the call breaks."""
    broken = broken_rules(a, b, scale_a, scale_b, out_dtype)
    if broken:
        messages = {name: message for name, _, message in RULES}
        detail = "; ".join(f"{name}: {messages[name]}" for name in broken)
        shapes = (
            f"a {a.dtype}{list(a.shape)} stride {a.stride()}, "
            f"b {b.dtype}{list(b.shape)} stride {b.stride()}"
        )
        raise ScaledMMLayoutError(f"_scaled_mm would fail on CUDA ({shapes}): {detail}")


#: How a float8 GEMM runs on the CPU: "emulated" (fp32 matmul of the float8 values, scaled) or
#: "scaled_mm" (torch's CPU kernel). A setting, read at each call; see `cpu_fp8_gemm`.
CPU_GEMMS = ("emulated", "scaled_mm")
CPU_GEMM_ENV = "RETARGET_FP8_CPU_GEMM"


def _checked_cpu_gemm(kind: str, given_as: str) -> str:
    if kind not in CPU_GEMMS:
        raise ValueError(f"{given_as}: choose one of {', '.join(CPU_GEMMS)}")
    return kind


def _initial_cpu_gemm() -> str:
    kind = os.environ.get(CPU_GEMM_ENV) or "emulated"
    return _checked_cpu_gemm(kind, f"{CPU_GEMM_ENV}={kind!r}")


_cpu_gemm = _initial_cpu_gemm()


@contextlib.contextmanager
def cpu_fp8_gemm(kind: str) -> Iterator[None]:
    """Run the float8 GEMMs of the block on the CPU as `kind` ("emulated" or "scaled_mm")."""
    global _cpu_gemm
    previous, _cpu_gemm = _cpu_gemm, _checked_cpu_gemm(kind, f"cpu_fp8_gemm({kind!r})")
    try:
        yield
    finally:
        _cpu_gemm = previous


def emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype: torch.dtype) -> torch.Tensor:
    """What `torch._scaled_mm` computes, as an fp32 matmul of the float8 values, then scaled.

    out[i, j] = (sum_k a[i, k] * b[k, j]) * scale_a[i or 0] * scale_b[j or 0], accumulated in
    fp32 and cast to `out_dtype` once, as `_scaled_mm` does; the products are exact.
    """
    out = torch.mm(a.to(torch.float32), b.to(torch.float32))
    return (out * (scale_a * scale_b)).to(out_dtype)


def scaled_mm(a, b, scale_a, scale_b, out_dtype: torch.dtype) -> torch.Tensor:
    """`torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=...)` after checking CUDA's rules
    (emulated on the CPU unless `cpu_fp8_gemm("scaled_mm")`; see the module docstring)."""
    check_scaled_mm(a, b, scale_a, scale_b, out_dtype)
    if a.device.type == "cpu" and _cpu_gemm == "emulated":
        return emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype)
    return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)
