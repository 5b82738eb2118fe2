"""Float8Linear: our own FP8 Linear on `torch._scaled_mm` (CPU and CUDA), with TE's recipes.

The three GEMMs of a Linear, as Transformer Engine runs them:

    fprop  y  = x  @ W^T    x: input (E4M3),        W: weight (E4M3)
    dgrad  dx = dy @ W      dy: grad_output (E5M2 for the hybrid format, else E4M3)
    wgrad  dW = dy^T @ x

Each goes through `layout.scaled_mm`, which enforces CUDA's operand rules on every device. With
per-tensor scaling (delayed or current) the FP8 copies made for fprop are kept for the backward
GEMMs (as TE keeps them); row-wise scaling re-casts each operand along its GEMM's contraction
dimension. The wgrad GEMM contracts over tokens, so the token count is padded with zero rows to a
multiple of 16. The bias is added in high precision. `override_linear_precision` runs the chosen
GEMMs in the input's precision instead.

    >>> fp8 = Float8Linear.from_linear(nn.Linear(64, 64), Fp8Recipe(scaling="current"))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from retarget.core.capturing import capturing
from retarget.kernels.fp8.layout import column_major, pad_rows, scaled_mm
from retarget.kernels.fp8.recipe import DelayedScaling, Fp8Recipe, quantize_current

_FLOAT8_CLASSES: dict[type, type] = {}


class Float8Linear(nn.Linear):
    """nn.Linear whose matmuls run in FP8; same `weight`/`bias` and state_dict keys.

    Delayed-scaling state (amax history, scales) lives in non-persistent buffers, so a
    checkpoint loads into the plain Linear and back. In eval mode the module runs the plain
    Linear unless `recipe.autocast_eval`; while a region is being captured it does too (see
    `retarget.ir.region.capturing`), so graphs record the user's computation.
    """

    _retarget_mixin = True  # reports show the user's Linear class
    _retarget_fp8 = True
    recipe: Fp8Recipe

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        recipe: Fp8Recipe | None = None,
    ):
        super().__init__(in_features, out_features, bias, device, dtype)
        self._init_fp8(recipe or Fp8Recipe())

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Fp8Recipe) -> Float8Linear:
        """Re-class `linear` in place: same object, Parameters, hooks and state_dict keys."""
        linear.__class__ = float8_class(type(linear))
        linear._init_fp8(recipe)
        return linear

    def _init_fp8(self, recipe: Fp8Recipe) -> None:
        self.recipe = recipe
        if recipe.scaling == "delayed":
            for name, value in DelayedScaling.initial_state(recipe, self.weight.device).items():
                self.register_buffer(name, value, persistent=False)

    def delayed_scaling(self) -> DelayedScaling | None:
        if self.recipe.scaling != "delayed":
            return None
        return DelayedScaling(self.recipe, self.fp8_amax_history, self.fp8_scale, self.fp8_updates)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if capturing() or (not self.training and not self.recipe.autocast_eval):
            return F.linear(x, self.weight, self.bias)
        # A forward re-run inside backward (activation checkpointing) must not record its
        # amaxes a second time.
        observe = self.training and torch._C._current_graph_task_id() == -1
        return fp8_linear(
            x, self.weight, self.bias, self.recipe, self.delayed_scaling(), observe=observe
        )

    def extra_repr(self) -> str:
        r = self.recipe
        return f"{super().extra_repr()}, fp8={r.format}/{r.scaling}"


def float8_class(cls: type) -> type:
    """Float8Linear for nn.Linear; a `Float8<Cls>(Float8Linear, Cls)` for Linear subclasses."""
    if issubclass(cls, Float8Linear):
        return cls
    if cls is nn.Linear:
        return Float8Linear
    if cls not in _FLOAT8_CLASSES:
        attrs = {"__module__": cls.__module__}
        _FLOAT8_CLASSES[cls] = type(f"Float8{cls.__name__}", (Float8Linear, cls), attrs)
    return _FLOAT8_CLASSES[cls]


@dataclass(frozen=True)
class _Call:
    recipe: Fp8Recipe
    delayed: DelayedScaling | None
    observe: bool
    out_dtype: torch.dtype


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Fp8Recipe,
    delayed: DelayedScaling | None = None,
    *,
    observe: bool = True,
) -> torch.Tensor:
    """`F.linear` with FP8 GEMMs; the output has x's dtype, or autocast's dtype when enabled."""
    device = x.device.type
    autocast = torch.is_autocast_enabled(device)
    out_dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
    if recipe.scaling == "delayed" and delayed is None:
        raise ValueError("fp8_linear: delayed scaling needs the module's DelayedScaling state")
    call = _Call(recipe, delayed, observe, out_dtype)
    flat = x.reshape(-1, x.shape[-1])
    out = _Fp8Matmul.apply(flat, weight, call)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _quantize(t: torch.Tensor, role: str, call: _Call, *, observe: bool):
    """Per-tensor cast of `t` for `role`: (t_fp8, inverse scale)."""
    if call.delayed is not None:
        return call.delayed.quantize(role, t, observe=observe)
    return quantize_current(t, call.recipe.dtype(role), call.recipe.margin)


def _unpack(tensors: tuple[torch.Tensor, ...]):
    """A high-precision tensor, or the (fp8 tensor, inverse scale) pair fprop kept."""
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def _per_tensor(saved, role: str, call: _Call):
    """The FP8 copy kept by fprop, or a cast now when fprop ran in high precision."""
    if isinstance(saved, tuple):
        return saved
    return _quantize(saved, role, call, observe=call.observe)


def _rowwise(t: torch.Tensor, contract_dim: int, call: _Call):
    """Row-wise cast of `t` along its contraction dimension: (t_fp8, (rows, 1) or (1, cols))."""
    return quantize_current(t, call.recipe.dtype("input"), call.recipe.margin, dim=contract_dim)


class _Fp8Matmul(torch.autograd.Function):
    """x (M, K) @ W^T with FP8 fprop, dgrad and wgrad GEMMs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, call: _Call) -> torch.Tensor:
        fprop_hp, dgrad_hp, wgrad_hp = call.recipe.override_linear_precision
        ctx.call = call
        saved: dict[str, Any] = {"x": (x,), "weight": (weight,)}
        with torch.autocast(x.device.type, enabled=False):
            if fprop_hp:
                out = x.to(call.out_dtype) @ weight.to(call.out_dtype).t()
            elif call.recipe.scaling == "rowwise":
                x_fp8, x_inv = _rowwise(x, 1, call)
                w_fp8, w_inv = _rowwise(weight, 1, call)
                out = scaled_mm(x_fp8, w_fp8.t(), x_inv, w_inv.t(), torch.bfloat16)
                out = out.to(call.out_dtype)
            else:
                x_fp8, x_inv = _quantize(x, "input", call, observe=call.observe)
                w_fp8, w_inv = _quantize(weight, "weight", call, observe=call.observe)
                out = scaled_mm(x_fp8, w_fp8.t(), x_inv, w_inv, call.out_dtype)
                # Keep the FP8 copies for the backward GEMMs that use them, as TE does.
                if not wgrad_hp:
                    saved["x"] = (x_fp8, x_inv)
                if not dgrad_hp:
                    saved["weight"] = (w_fp8, w_inv)
        ctx.dtypes = (x.dtype, weight.dtype)
        # save_for_backward, so activation checkpointing can drop and recompute them.
        ctx.layout = (len(saved["x"]), len(saved["weight"]))
        ctx.save_for_backward(*saved["x"], *saved["weight"])
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        call: _Call = ctx.call
        x_dtype, w_dtype = ctx.dtypes
        _, dgrad_hp, wgrad_hp = call.recipe.override_linear_precision
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        tensors = ctx.saved_tensors
        n_x = ctx.layout[0]
        saved = {"x": _unpack(tensors[:n_x]), "weight": _unpack(tensors[n_x:])}
        dy = grad_out.contiguous()
        rowwise = call.recipe.scaling == "rowwise"
        per_tensor_dy = None
        if not rowwise and ((need_dx and not dgrad_hp) or (need_dw and not wgrad_hp)):
            per_tensor_dy = _quantize(dy, "grad_output", call, observe=call.observe)
        with torch.autocast(dy.device.type, enabled=False):
            dx = dw = None
            if need_dx:
                dx = _dgrad(dy, per_tensor_dy, saved["weight"], call, x_dtype, dgrad_hp)
            if need_dw:
                dw = _wgrad(dy, per_tensor_dy, saved["x"], call, w_dtype, wgrad_hp)
        return dx, dw, None


def _dgrad(dy, dy_fp8, weight, call: _Call, out_dtype, high_precision: bool):
    """dx (M, K) = dy (M, N) @ W (N, K); W column-major as the second operand."""
    if high_precision:
        return (dy.to(out_dtype) @ weight.to(out_dtype)).to(out_dtype)
    if call.recipe.scaling == "rowwise":
        a, a_inv = _rowwise(dy, 1, call)
        b, b_inv = _rowwise(weight, 0, call)
        return scaled_mm(a, column_major(b), a_inv, b_inv, torch.bfloat16).to(out_dtype)
    dy_fp8, dy_inv = dy_fp8
    w_fp8, w_inv = _per_tensor(weight, "weight", call)
    return scaled_mm(dy_fp8, column_major(w_fp8), dy_inv, w_inv, out_dtype)


def _wgrad(dy, dy_fp8, x, call: _Call, out_dtype, high_precision: bool):
    """dW (N, K) = dy^T (N, M) @ x (M, K); M (tokens) padded to a multiple of 16."""
    if high_precision:
        return (dy.t().to(out_dtype) @ x.to(out_dtype)).to(out_dtype)
    if call.recipe.scaling == "rowwise":
        dy_t = pad_rows(dy).t().contiguous()
        a, a_inv = _rowwise(dy_t, 1, call)
        b, b_inv = _rowwise(pad_rows(x), 0, call)
        return scaled_mm(a, column_major(b), a_inv, b_inv, torch.bfloat16).to(out_dtype)
    dy_fp8, dy_inv = dy_fp8
    x_fp8, x_inv = _per_tensor(x, "input", call)
    a = pad_rows(dy_fp8).t().contiguous()
    return scaled_mm(a, column_major(pad_rows(x_fp8)), dy_inv, x_inv, out_dtype)
