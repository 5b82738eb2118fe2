"""Measure the memory a training step allocates, on any device, without a device allocator.

CPU torch has no `torch.cuda.max_memory_allocated`. We count at the dispatcher instead: a
`TorchDispatchMode` sees the outputs of every aten op (forward, backward, recompute), and a
storage that none of the op's inputs owns is a new allocation. Each new storage is counted once,
with `storage.nbytes()`, and uncounted by a `weakref.finalize` when torch frees it (torch keeps
one Python object per live storage, so the finalizer fires exactly when the memory goes).
Views and in-place results share an input's storage and cost nothing; parameters, buffers and
the batch exist before the step and are never counted.

    >>> step = measure_training_step(lambda: model(**batch)["loss"])
    >>> step.activations, step.peak      # bytes alive after forward; most alive at once

`activations` is what a forward leaves alive for backward (saved tensors, checkpoint inputs,
selective-checkpoint caches, the outputs); `peak` adds what backward allocates on top of it
(recomputed blocks, gradients, temporaries). Memory torch allocates outside the dispatcher
(the RNG state a checkpoint keeps, a few KiB) is not seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors in a pytree."""
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def tensor_storages(tree: Any) -> list[torch.UntypedStorage]:
    """The storages of the tensors in a pytree (one per tensor, views share theirs)."""
    return [tensor.untyped_storage() for tensor in tensors_in(tree)]


class StorageTracker(TorchDispatchMode):
    """Counts the bytes of storages that ops allocate while it is active, live and at peak.

    Subclasses refine `on_new_storage` / `on_op` to attribute allocations (see
    activation_profile.py).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        owned = {id(s) for s in tensor_storages((args, kwargs))}
        fresh = []
        for storage in tensor_storages(out):
            key = id(storage)
            if key in owned or key in self._sizes or storage.device.type == "meta":
                continue
            fresh.append(storage)
            self._track(storage)
        self.on_op(func, args, kwargs, out, fresh)
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, size = id(storage), storage.nbytes()
        self._sizes[key] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)
        self.on_new_storage(storage)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def is_new(self, storage: torch.UntypedStorage) -> bool:
        """Whether `storage` was allocated by an op while this tracker was active."""
        return id(storage) in self._sizes

    def on_new_storage(self, storage: torch.UntypedStorage) -> None:
        """Called once per newly allocated storage."""

    def on_op(self, func, args: tuple, kwargs: dict, out: Any, fresh: list) -> None:
        """Called after every op with the storages it newly allocated."""


@dataclass(frozen=True)
class StepMemory:
    """Bytes measured over one forward and backward."""

    activations: int
    """Allocated during forward and still alive when it returns (what backward needs, and the
    outputs)."""
    forward_peak: int
    """Most bytes alive at once during forward."""
    peak: int
    """Most bytes alive at once during forward and backward (recompute and gradients too)."""


def measure_training_step(forward: Callable[[], torch.Tensor]) -> StepMemory:
    """Run `forward()` (returning a scalar loss) and its backward under a StorageTracker.

    Gradients are left in `.grad` as the step made them; zero them before measuring again.
    """
    tracker = StorageTracker()
    with tracker:
        loss = forward()
        activations, forward_peak = tracker.live, tracker.peak
        loss.backward()
        del loss
    return StepMemory(activations=activations, forward_peak=forward_peak, peak=tracker.peak)


def format_bytes(size: float) -> str:
    """`1536` -> `'1.5 KiB'`: binary units, three significant digits."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    index = 0
    while abs(size) >= 1024 and index < len(units) - 1:
        size /= 1024
        index += 1
    return f"{size:.0f} B" if index == 0 else f"{size:.3g} {units[index]}"
