"""Accelerate's "fp32 wrapper": a model's forward run in autocast, floating outputs in float32.

Accelerate installs it on the model object at prepare under bf16/fp16, and `unwrap_model`
keeps it unless `keep_fp32_wrapper=False`. retarget's prepare leaves the user's model alone
(autocast lives in the compiled regions), so `unwrap_model` installs it on the model it hands
back, or removes it, as asked.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from retarget.execution.nested import map_tensors

_MARK = "_retarget_fp32_wrapper"


def set_fp32_wrapper(model: nn.Module, dtype: torch.dtype | None, device_type: str) -> None:
    """Make `model.forward` autocast to `dtype` with float32 outputs; None: the plain forward."""
    wrapped = getattr(model.forward, _MARK, None)
    if wrapped is not None and wrapped[0] == (dtype, device_type):
        return
    if "forward" in vars(model) and wrapped is not None:
        del model.forward  # back to the class's forward
    if dtype is None:
        return
    plain = model.forward

    @functools.wraps(plain)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            outputs = plain(*args, **kwargs)
        return map_tensors(_to_fp32, outputs)

    setattr(forward, _MARK, ((dtype, device_type),))
    model.forward = forward


def _to_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.is_floating_point() else tensor
