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


def _device_type(module: nn.Module, args: tuple, kwargs: dict) -> str:
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    parameter = next(module.parameters(), None)
    return "cpu" if parameter is None else parameter.device.type
