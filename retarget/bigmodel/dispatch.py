"""dispatch_model, cpu_offload, disk_offload, cpu_offload_with_hook: Accelerate's signatures.

A dispatched model runs on its execution device (`main_device`) while the weights of its
offloaded modules live elsewhere: on the CPU (when the execution device is an accelerator) or
in safetensors files on disk. Forward hooks (execution/offload) bring a block's weights in just
before it runs and drop them after; with `prefetch=k` the next k blocks' weights are read on a
background thread while the current one computes. Modules mapped to another accelerator are
moved there and get their inputs moved to them.

    >>> with retarget.init_empty_weights():
    ...     model = LlamaForCausalLM(config)
    >>> retarget.load_checkpoint_and_dispatch(model, "ckpt", device_map="auto",
    ...     max_memory={"cpu": "2GB"}, offload_folder="offload", prefetch=1)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from retarget.core.disk_weights import INDEX_NAME, DiskWeight, read_disk_index
from retarget.core.placement import CPU, DISK, PlacementError, normalize_device
from retarget.core.slots import DISK_WEIGHTS, OFFLOAD
from retarget.execution.nested import send_to_device
from retarget.execution.offload.hooks import OffloadRuntime
from retarget.execution.offload.placement import (
    offload_entries,
    under,
    undispatch,
    write_real_disk_tensors,
)
from retarget.execution.offload.units import UnitPlanner
from retarget.passes.place.device_map import no_split_paths, resolve_device_map


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, int | str | torch.device],
    main_device: int | str | torch.device | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    offload_dir: str | Path | None = None,
    offload_index: Mapping[str, DiskWeight] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    force_hooks: bool = False,
    prefetch: int = 0,
) -> nn.Module:
    """Place `model` along `device_map` and hook its offloaded modules; returns the model.

    `main_device` (default: the first accelerator in the map, else the cpu) runs every
    offloaded block. Tensors of "disk" modules come from the records the checkpoint loader
    left (or `offload_index`, or `offload_dir`'s disk_index.json); real tensors of a disk module
    are written to `offload_dir` first. `state_dict` gives the tensors of "cpu" modules.
    `skip_keys` and `force_hooks` are accepted for Accelerate's callers: outputs here are never
    moved, and a model on one device is simply moved there.
    """
    entries = resolve_device_map(model, device_map)
    if not entries:
        raise PlacementError("device_map is empty: map at least '' to a device")
    main = _main_device(entries, main_device)
    if state_dict is not None:
        offloaded = [k for k, d in entries.items() if d == CPU and main.type != "cpu"]
        _use_state_dict(model, state_dict, offloaded)
    records = _disk_records(model, offload_dir, offload_index)
    offload_entries(
        model,
        entries,
        main,
        records=records,
        offload_dir=offload_dir,
        offload_buffers=offload_buffers,
        blocks=no_split_paths(model, preload_module_classes),
        prefetch=prefetch,
    )
    model.hf_device_map = dict(entries)
    return model


def cpu_offload(
    model: nn.Module,
    execution_device: int | str | torch.device | None = None,
    offload_buffers: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    prefetch: int = 0,
) -> nn.Module:
    """Keep every weight on the CPU; each block's come to `execution_device` while it runs."""
    main = _default_execution(execution_device)
    undispatch(model)
    if state_dict is not None:
        _use_state_dict(model, state_dict, [""])
    blocks = no_split_paths(model, preload_module_classes)
    planner = UnitPlanner(model, {}, offload_buffers, blocks)
    units = planner.plan([("", CPU)])
    runtime = OffloadRuntime(units, main, prefetch).attach().watch_calls(model)
    OFFLOAD.set(model, runtime)
    return model


def disk_offload(
    model: nn.Module,
    offload_dir: str | Path,
    execution_device: int | str | torch.device | None = None,
    offload_buffers: bool = False,
    preload_module_classes: Sequence[str] | None = None,
    prefetch: int = 0,
) -> nn.Module:
    """Write the weights to `offload_dir` (unless it already holds them) and run from there."""
    main = _default_execution(execution_device)
    undispatch(model)
    folder = Path(offload_dir)
    records = read_disk_index(folder) if (folder / INDEX_NAME).is_file() else {}
    records |= write_real_disk_tensors(model, [""], records, folder)
    blocks = no_split_paths(model, preload_module_classes)
    planner = UnitPlanner(model, records, offload_buffers, blocks)
    units = planner.plan([("", DISK)])
    runtime = OffloadRuntime(units, main, prefetch).attach().watch_calls(model)
    OFFLOAD.set(model, runtime)
    return model


class UserCpuOffloadHook:
    """What `cpu_offload_with_hook` returns: `offload()` sends the model back to the CPU."""

    def __init__(self, model: nn.Module, execution_device: torch.device, previous=None):
        self.model = model
        self.execution_device = execution_device
        self.previous = previous
        self.on_device = False
        self._handle = model.register_forward_pre_hook(self._bring_in, with_kwargs=True)

    def _bring_in(self, module, args, kwargs):
        if self.previous is not None:
            self.previous.offload()
        if not self.on_device:
            self.model.to(self.execution_device)
            self.on_device = True
        return send_to_device(args, self.execution_device), send_to_device(
            kwargs, self.execution_device
        )

    def offload(self) -> None:
        if self.on_device:
            self.model.to("cpu")
            self.on_device = False

    def remove(self) -> None:
        self._handle.remove()


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: int | str | torch.device | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[nn.Module, UserCpuOffloadHook]:
    """A model kept on the CPU that moves whole to `execution_device` when it runs, and stays
    there until `hook.offload()`; running it offloads `prev_module_hook`'s model first (the
    pipeline-of-models form: text encoder, then denoiser, then decoder)."""
    main = _default_execution(execution_device)
    model.to("cpu")
    return model, UserCpuOffloadHook(model, main, prev_module_hook)


def _default_execution(device) -> torch.device:
    if device is not None:
        return torch.device(normalize_device(device))
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device(CPU)


def _main_device(entries: Mapping[str, str], main_device) -> torch.device:
    if main_device is not None:
        return torch.device(normalize_device(main_device))
    accelerators = [d for d in entries.values() if d not in (CPU, DISK)]
    return torch.device(accelerators[0] if accelerators else CPU)


def _disk_records(model, offload_dir, offload_index) -> dict[str, DiskWeight]:
    records = dict(DISK_WEIGHTS.get(model, None) or {})
    if offload_dir is not None and (Path(offload_dir) / INDEX_NAME).is_file():
        records |= read_disk_index(offload_dir)
    if offload_index is not None:
        records |= dict(offload_index)
    return records


def _use_state_dict(model, state_dict, keys) -> None:
    """Set the tensors under `keys` from `state_dict` (kept as they are, on the CPU)."""
    for name, value in state_dict.items():
        if not under(name, keys):
            continue
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        table = module._parameters if leaf in module._parameters else module._buffers
        if leaf not in table:
            raise KeyError(f"state_dict key {name!r} is not a tensor of {type(model).__name__}")
        old = table[leaf]
        value = value.detach().to("cpu")
        is_param = isinstance(old, nn.Parameter)
        table[leaf] = nn.Parameter(value, old.requires_grad) if is_param else value
