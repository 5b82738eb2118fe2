"""load_checkpoint_and_dispatch: plan a device map, load the checkpoint into it, dispatch.

Tensors the map sends to disk are not loaded: the loader records where each lives, and
`dispatch_model` hooks their modules to bring them in from there when they run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from retarget.bigmodel.checkpoint_files import as_floating_dtype
from retarget.bigmodel.dispatch import dispatch_model
from retarget.bigmodel.load_checkpoint import load_checkpoint_in_model
from retarget.passes.place.device_map import resolve_device_map


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | Path,
    device_map: str | Mapping[str, int | str | torch.device] | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: Sequence[str] | None = None,
    offload_folder: str | Path | None = None,
    dtype: str | torch.dtype | None = None,
    strict: bool = True,
    **dispatch_options,
) -> nn.Module:
    """Accelerate's signature: load `checkpoint` into `model` along `device_map`; dispatch it.

    `device_map` "auto" / "balanced" / "sequential" is planned by `infer_auto_device_map` with
    `max_memory` and `no_split_module_classes`; a dict is used as given. Returns the model.
    """
    target = as_floating_dtype(dtype)
    entries = resolve_device_map(
        model,
        device_map,
        max_memory=max_memory,
        no_split_module_classes=no_split_module_classes,
        dtype=target,
    )
    loaded = load_checkpoint_in_model(
        model,
        checkpoint,
        entries or None,
        dtype=target,
        offload_folder=offload_folder,
        strict=strict,
    )
    if not entries:
        return model
    return dispatch_model(model, loaded.device_map, offload_dir=offload_folder, **dispatch_options)
