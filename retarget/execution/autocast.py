"""Low precision at step time: a forward run under torch.autocast, outputs in float32 (a region's
eager form: in bfloat16/float16 when all its floating inputs were).

insert_autocast (passes/precision/) decides where it applies and records a `LowPrecision` policy:
in a Linear/Conv leaf's record (`install`: the glue outside regions, and the leaves a graph calls),
which RetargetedModule's forward runs under the policy except while a capture traces; or as the
eager form of a region no frontend captured (`eager_form`).

    >>> policy = LowPrecision(torch.bfloat16)
    >>> policy.install(model.lm_head)     # lm_head runs in bf16 and returns float32
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from retarget.core.modules import original_class
from retarget.execution.module_call import retarget_module


@dataclass(frozen=True)
class LowPrecision:
    """Runs a forward under torch.autocast and casts its low-precision outputs to float32."""

    dtype: torch.dtype
    autocast_eval: bool = True

    def call(
        self, module: nn.Module, forward, args: tuple, kwargs: dict, *, as_inputs: bool = False
    ) -> Any:
        """`forward(*args, **kwargs)` of `module` under this policy. With `as_inputs` (a
        region's eager form) outputs stay low precision when every floating input was (FSDP's
        mixed precision hands a block bfloat16 activations): the dtypes its graph form gives,
        and what the next unit's low-precision parameters expect (a norm refuses mixed dtypes
        on CPU)."""
        if not (module.training or self.autocast_eval):
            return forward(*args, **kwargs)
        if _plain_linear_call(module, forward, args, kwargs):
            # what torch.autocast's linear computes, without keeping the weight's low-precision
            # cast from forward to backward (cast_weight_linear)
            bias = None if module.bias is None else module.bias.to(self.dtype)
            out = cast_weight_linear(args[0].to(self.dtype), module.weight, bias, self.dtype)
            return out if as_inputs else self._to_float32(out)
        with torch.autocast(_device_type(module, args, kwargs), dtype=self.dtype):
            out = forward(*args, **kwargs)
        if as_inputs and self._all_low_precision((args, kwargs)):
            return out
        return tree_map_only(torch.Tensor, self._to_float32, out)

    def _all_low_precision(self, inputs: Any) -> bool:
        floats = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
        floats = [t for t in floats if t.is_floating_point()]
        return bool(floats) and all(t.dtype == self.dtype for t in floats)

    def install(self, module: nn.Module) -> None:
        """Run every call of `module` under this policy (its record's `autocast`)."""
        retarget_module(module, autocast=self)

    def _to_float32(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.float() if tensor.dtype == self.dtype else tensor

    def eager_form(self, fallback: nn.Module):
        """Region.add_transform's eager_form: wraps a region's eager forward."""

        def wrap(forward):
            # The innermost callable is the module's bound forward; other forms may wrap it.
            module = getattr(inspect.unwrap(forward), "__self__", fallback)

            @functools.wraps(forward)
            def run(*args, **kwargs):
                return self.call(module, forward, args, kwargs, as_inputs=True)

            return run

        return wrap


def _plain_linear_call(module: nn.Module, forward: Any, args: tuple, kwargs: dict) -> bool:
    """A plain nn.Linear's own forward on one float32 tensor (nothing wrapped around it)."""
    own = getattr(forward, "__func__", None) is nn.Linear.forward
    single = len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)
    plain = original_class(module) is nn.Linear
    return plain and own and single and args[0].dtype == torch.float32


def _device_type(module: nn.Module, args: tuple, kwargs: dict) -> str:
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    parameter = next(module.parameters(), None)
    return "cpu" if parameter is None else parameter.device.type


class CastWeightLinear(torch.autograd.Function):
    """F.linear(x, weight.to(dtype), bias) saving `weight` itself for backward, not its cast:
    the graph form's cast of a float32 parameter to bf16/fp16 is a new tensor, which a plain
    linear would keep from forward to backward (a low-precision copy of every frozen weight for
    the step: under LoRA, the whole model's size). The cast is redone in backward. Outputs and
    the input's and bias's gradients are those of the cast followed by F.linear; the weight
    gets none (cast_weight_linear sends frozen weights only)."""

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
        return torch.nn.functional.linear(x, weight.to(dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (weight,) = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ weight.to(ctx.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, None, grad_bias, None


def cast_weight_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """F.linear(x, weight.to(dtype), bias). A frozen weight goes through CastWeightLinear (its
    bf16 copy is not kept for backward: LoRA's frozen base would cost the model's size); a
    trainable one through autograd as usual, which keeps the copy rather than cast it twice (the
    cast again in backward cost 5% of a bf16 step on CPU; a trained weight's gradient needs the
    input saved anyway)."""
    if weight.requires_grad:
        return torch.nn.functional.linear(x, weight.to(dtype), bias)
    return CastWeightLinear.apply(x, weight, bias, dtype)
