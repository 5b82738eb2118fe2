"""Example inputs for `Accelerator.prepare(model, ..., loader)`: a batch of that loader, when it
says how the model is called.

compile_for captures regions from one probe forward on example inputs; without them it captures
at the first call. A loader prepared in the same call gives a batch, but a batch is not always
the model's arguments: a dict is keyword arguments (the Hugging Face way) when the forward takes
those names; a tensor is the one argument; a tuple or list is positional arguments only when the
forward takes that many. `(images, labels)` for a `forward(self, x)` is not, so the capture waits
for the first call (the report says "lazy"), which always sees the real arguments.

The batch is the loader's first `batch_size` samples (per process), collated by the loader's
own collate_fn, read without iterating the loader: no shuffle is drawn, no worker started, and
the RNG states (torch, Python, NumPy) are put back, so training is exactly what it would be
without this probe.
"""

from __future__ import annotations

import contextlib
import inspect
import random
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from retarget.execution.nested import send_to_device


@contextlib.contextmanager
def _rng_untouched() -> Iterator[None]:
    python = random.getstate()
    try:
        import numpy as np

        numpy_state = np.random.get_state()
    except ImportError:  # numpy is a dependency, but the probe must not need it
        np, numpy_state = None, None
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python)
        if np is not None:
            np.random.set_state(numpy_state)


def first_batch(loader: DataLoader, split: int) -> Any | None:
    """The loader's first `batch_size // split` samples collated, or None when it cannot tell."""
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset) or loader.batch_size is None:
        return None
    size = max(1, loader.batch_size // split)
    try:
        count = min(size, len(dataset))
    except TypeError:
        return None
    if count == 0:
        return None
    with _rng_untouched():
        return loader.collate_fn([dataset[i] for i in range(count)])


def _calls_with(model: nn.Module, batch: Any) -> Any | None:
    """`batch` as example_inputs when it matches the forward's signature, else None."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    takes_var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    takes_var_pos = any(p.kind is p.VAR_POSITIONAL for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if isinstance(batch, Mapping):
        names = {p.name for p in params}
        return dict(batch) if takes_var_kw or set(batch) <= names else None
    if isinstance(batch, torch.Tensor):
        return batch if positional or takes_var_pos else None
    if isinstance(batch, (tuple, list)):
        fits = len(required) <= len(batch) <= (len(positional) if not takes_var_pos else 1 << 30)
        return tuple(batch) if fits else None
    return None


def example_inputs_for(
    model: nn.Module, loader: DataLoader, split: int, device: torch.device
) -> Any | None:
    """Example inputs for compile_for from `loader`, or None (capture at the first call)."""
    batch = first_batch(loader, split)
    if batch is None:
        return None
    inputs = _calls_with(model, batch)
    return None if inputs is None else send_to_device(inputs, device)
