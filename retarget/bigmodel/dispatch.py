"""dispatch_model, cpu_offload, disk_offload, cpu_offload_with_hook: Accelerate's signatures.

A dispatched model runs on its execution device (`main_device`) while the weights of its
offloaded modules live elsewhere: on the CPU (when the execution device is an accelerator) or
in safetensors files on disk. Forward hooks (runtime/offload) bring a block's weights in just
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
from safetensors.torch import save_file
from torch import nn

from retarget.bigmodel.device_map import no_split_paths, resolve_device_map
from retarget.core.disk_weights import INDEX_NAME, DiskWeight, read_disk_index, write_disk_index
from retarget.core.placement import CPU, DISK, PlacementError, device_for, normalize_device
from retarget.core.slots import DISK_WEIGHTS, OFFLOAD
from retarget.runtime.nested import send_to_device
from retarget.runtime.offload.hooks import OffloadRuntime
from retarget.runtime.offload.units import UnitPlanner


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
        preload_module_classes=preload_module_classes,
        prefetch=prefetch,
    )
    model.hf_device_map = dict(entries)
    return model


def offload_entries(
    model: nn.Module,
    entries: Mapping[str, str],
    main: torch.device,
    *,
    records: Mapping[str, DiskWeight] | None = None,
    offload_dir: str | Path | None = None,
    offload_buffers: bool = False,
    preload_module_classes: Sequence[str] | None = None,
    prefetch: int = 0,
    also: Sequence[nn.Module] = (),
) -> OffloadRuntime:
    """Place and hook `model` along checked `entries`; `also`: models sharing its tensors,
    whose slots are swapped with `model`'s (a compiled model and the user's)."""
    undispatch(model)
    records = dict(records if records is not None else DISK_WEIGHTS.get(model, None) or {})
    for other in also:
        records |= DISK_WEIGHTS.get(other, None) or {}
    offloaded = [
        (k, d) for k, d in entries.items() if d == DISK or (d == CPU and main.type != "cpu")
    ]
    to_disk = [k for k, d in offloaded if d == DISK]
    records |= _write_real_disk_tensors(model, to_disk, records, offload_dir)
    for key, device in entries.items():
        if device not in (CPU, DISK) or main.type == "cpu" and device == CPU:
            _move(model, key, torch.device(device))
    _refuse_meta_left(model, entries, offloaded, records)
    blocks = no_split_paths(model, preload_module_classes)
    planner = UnitPlanner(model, records, offload_buffers, blocks, also=tuple(also))
    runtime = OffloadRuntime(planner.plan(offloaded), main, prefetch).attach().watch_calls(model)
    for key, device in entries.items():
        if device not in (CPU, DISK) and torch.device(device) != main:
            runtime.align_inputs(model.get_submodule(key), torch.device(device))
    if len(set(entries.values())) > 1 and main.type != "cpu":
        runtime.align_inputs(model, main)
    OFFLOAD.set(model, runtime)
    return runtime


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
    records |= _write_real_disk_tensors(model, [""], records, folder)
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


def undispatch(model: nn.Module) -> None:
    """Take a previous dispatch's hooks off `model` (its offloaded tensors stay on meta)."""
    runtime = OFFLOAD.get(model, None)
    if runtime is not None:
        runtime.remove()
        OFFLOAD.pop(model)


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


def _write_real_disk_tensors(model, keys, records, folder) -> dict[str, DiskWeight]:
    """Write each real (not meta) tensor under a "disk" key to `folder`; their records."""
    written: dict[str, DiskWeight] = {}
    names = [
        n
        for n, t in model.state_dict(keep_vars=True).items()
        if _under(n, keys) and not t.is_meta and n not in records
    ]
    if not names:
        return written
    if folder is None:
        raise PlacementError(
            f"{names[0]} is mapped to disk and holds real weights: give offload_dir (a folder "
            "to write them to) or load the checkpoint with offload_folder"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = model.state_dict(keep_vars=True)
    first: dict[int, DiskWeight] = {}  # a tied tensor is written once, under its first name
    for name in names:
        tensor = state[name]
        if id(tensor) not in first:
            path = folder / f"{name}.safetensors"
            save_file({name: tensor.detach().to("cpu").contiguous()}, path)
            dtype = str(tensor.dtype).removeprefix("torch.")
            first[id(tensor)] = DiskWeight(str(path.resolve()), name, dtype, tuple(tensor.shape))
        written[name] = first[id(tensor)]
    write_disk_index(folder, records | written)
    return written


def _use_state_dict(model, state_dict, keys) -> None:
    """Set the tensors under `keys` from `state_dict` (kept as they are, on the CPU)."""
    for name, value in state_dict.items():
        if not _under(name, keys):
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


def _move(model: nn.Module, key: str, device: torch.device) -> None:
    owner, _, leaf = key.rpartition(".")
    modules = dict(model.named_modules())
    if key in modules:
        module = modules[key]
        if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            module.to(device)
        return
    holder = model.get_submodule(owner)
    table = holder._parameters if leaf in holder._parameters else holder._buffers
    if table[leaf] is not None and not table[leaf].is_meta:
        table[leaf].data = table[leaf].data.to(device)


def _refuse_meta_left(model: nn.Module, entries, offloaded, records) -> None:
    """Refuse a tensor that would stay on meta: kept resident, never loaded, no disk record."""
    names: dict[int, list[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(tensor), []).append(name)
    away = {k for k, _ in offloaded}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        aliases = names[id(tensor)]
        if not tensor.is_meta or any(a in records for a in aliases):
            continue
        if all(device_for(entries, a) == DISK or _under(a, away) for a in aliases):
            continue  # the planner reports it, naming the unit
        raise PlacementError(
            f"{name} is on the meta device and the device map keeps it on "
            f"{device_for(entries, name)}: it was never loaded (load the checkpoint first, "
            "load_checkpoint_in_model) and has no disk record to bring it in from"
        )


def _under(name: str, keys) -> bool:
    return any(k == "" or name == k or name.startswith(k + ".") for k in keys)
