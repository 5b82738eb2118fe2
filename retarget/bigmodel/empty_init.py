"""init_empty_weights / init_on_device: build a model whose parameters are created on a device.

Inside `init_empty_weights()` every parameter a module registers is moved to the meta device
right after it is created (`nn.Module.register_parameter` is wrapped for the duration), so the
module's own initialisation (`reset_parameters`, HF's `_init_weights`) runs on meta and costs
nothing; a model of any size is built in the time its Python constructors take. Buffers are
left real unless `include_buffers=True` (non-persistent buffers such as rotary frequencies are
computed at construction and are not in checkpoints). With `include_buffers=True` the whole
block runs under `torch.device(device)`, so every tensor created there lands on the device.

The parameter keeps its class and `requires_grad`; ties made after registration (HF's
`tie_weights` assigns one Parameter object to two modules) are ties of the meta parameters
and stay ties: the loader fills both names with one tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Parameters (and buffers if asked) created inside are on the meta device."""
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


@contextlib.contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool = False) -> Iterator[None]:
    """Parameters (and buffers if asked) created inside are created on `device`."""
    device = torch.device(device)
    if include_buffers:
        with torch.device(device):
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device != device:
            moved = param.to(device)
            kept = type(param)(moved, requires_grad=param.requires_grad)
            kept.__dict__.update(param.__dict__)
            module._parameters[name] = kept

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original
