"""Activation headroom: the most bytes a block's forward keeps alive, measured on meta.

A device that runs a block needs room for the block's activations as well as its weights. With
example inputs, one forward runs with every parameter, buffer and input on the meta device (an
empty model costs nothing; a real one has its tensors swapped for meta stand-ins and put back
after), under no_grad as inference runs. A dispatch mode counts each new tensor an op returns
(views excluded) as alive until Python frees it (a weakref finalizer), and the forward hooks of
each block read the peak of live bytes between its entry and its exit, less what was alive at
entry. The headroom is the largest such peak over the blocks.

Not from `annotate_shapes`: that pass needs captured regions and real weights (it runs the
original model eagerly); the meta forward needs neither and sees the transient peak inside a
block, not only its input and output shapes.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map


class _LiveBytes(TorchDispatchMode):
    """Bytes of tensors ops created and Python still holds; its running peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and not tensor._is_view():
                nbytes = tensor.numel() * tensor.element_size()
                self.live += nbytes
                weakref.finalize(tensor, self._free, nbytes)
        self.peak = max(self.peak, self.live)
        return out


def activation_headroom(model: nn.Module, blocks: Iterable[str], example_inputs: Any) -> int:
    """Largest per-block peak of live activation bytes for one no-grad forward on meta."""
    counter = _LiveBytes()
    peaks: dict[str, int] = {}
    entry: dict[str, tuple[int, int]] = {}
    handles = []
    for path in blocks:
        module = model.get_submodule(path)

        def before(_module, _args, path=path):
            entry[path] = (counter.live, counter.peak)
            counter.peak = counter.live

        def after(_module, _args, _out, path=path):
            live_at_entry, outer_peak = entry.pop(path)
            peaks[path] = max(peaks.get(path, 0), counter.peak - live_at_entry)
            counter.peak = max(outer_peak, counter.peak)

        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))
    args, kwargs = _split(example_inputs)
    to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
    try:
        with _on_meta(model), torch.no_grad(), counter:
            model(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
    finally:
        for handle in handles:
            handle.remove()
    return max(peaks.values(), default=0)


def _split(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), example_inputs
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    return (example_inputs,), {}


@contextmanager
def _on_meta(model: nn.Module):
    """Every real parameter and buffer swapped for a meta stand-in; the originals put back."""
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    stand_ins: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or tensor.is_meta:
                    continue
                if id(tensor) not in stand_ins:
                    meta = tensor.to("meta")
                    if isinstance(tensor, nn.Parameter):
                        meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
                    stand_ins[id(tensor)] = meta
                swapped.append((table, name, tensor))
                table[name] = stand_ins[id(tensor)]
    try:
        yield
    finally:
        for table, name, tensor in swapped:
            table[name] = tensor
