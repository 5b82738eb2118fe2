"""FP8 Linears: recipes with Transformer Engine's semantics, our own Float8Linear on
`torch._scaled_mm`, CUDA's layout rules and the backends (torch only: no pass imports).

The `swap_fp8` pass (`retarget.passes.precision.swap_fp8`, with its eligibility table
`fp8_rules.py` beside it) puts these together; they are also usable alone:

    >>> from retarget.kernels.fp8 import Float8Linear, Fp8Recipe
    >>> layer = Float8Linear.from_linear(nn.Linear(64, 64), Fp8Recipe(scaling="current"))
"""

from retarget.kernels.fp8.backends import BACKENDS, Environment, Fp8BackendError, select_backend
from retarget.kernels.fp8.layout import (
    ScaledMMLayoutError,
    check_scaled_mm,
    cpu_fp8_gemm,
    emulated_scaled_mm,
    scaled_mm,
)
from retarget.kernels.fp8.native import Float8Linear, fp8_linear
from retarget.kernels.fp8.recipe import DelayedScaling, Fp8Recipe, amax_to_scale

__all__ = [
    "BACKENDS",
    "DelayedScaling",
    "Environment",
    "Float8Linear",
    "Fp8BackendError",
    "Fp8Recipe",
    "ScaledMMLayoutError",
    "amax_to_scale",
    "check_scaled_mm",
    "cpu_fp8_gemm",
    "emulated_scaled_mm",
    "fp8_linear",
    "scaled_mm",
    "select_backend",
]
