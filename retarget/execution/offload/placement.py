"""Place a model along a device map and hook its offloaded tensors (the execution of a map).

`offload_entries` moves what the map keeps on an accelerator there, writes the real tensors of
"disk" modules to the offload folder (a tied tensor once), refuses a tensor left on the meta
device with nowhere to load it from, plans the offload units (blocks never split) and attaches
the hooks that bring each unit's weights in just before it runs (hooks.py). Who decides the
map: `retarget.dispatch_model`'s caller (bigmodel/dispatch.py) or the stream part's pass
(passes/place/plan_stream.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from retarget.core.disk_weights import DiskWeight, write_disk_index
from retarget.core.placement import CPU, DISK, PlacementError, device_for
from retarget.core.slots import DISK_WEIGHTS, OFFLOAD
from retarget.execution.offload.hooks import OffloadRuntime
from retarget.execution.offload.units import UnitPlanner


def offload_entries(
    model: nn.Module,
    entries: Mapping[str, str],
    main: torch.device,
    *,
    records: Mapping[str, DiskWeight] | None = None,
    offload_dir: str | Path | None = None,
    offload_buffers: bool = False,
    blocks: set[str] = frozenset(),
    prefetch: int = 0,
    also: Sequence[nn.Module] = (),
) -> OffloadRuntime:
    """Place and hook `model` along checked `entries`; `blocks`: the module paths whose
    weights come in together (never split); `also`: models sharing its tensors, whose slots
    are swapped with `model`'s (a compiled model and the user's)."""
    undispatch(model)
    records = dict(records if records is not None else DISK_WEIGHTS.get(model, None) or {})
    for other in also:
        records |= DISK_WEIGHTS.get(other, None) or {}
    offloaded = [
        (k, d) for k, d in entries.items() if d == DISK or (d == CPU and main.type != "cpu")
    ]
    to_disk = [k for k, d in offloaded if d == DISK]
    records |= write_real_disk_tensors(model, to_disk, records, offload_dir)
    for key, device in entries.items():
        if device not in (CPU, DISK) or main.type == "cpu" and device == CPU:
            _move(model, key, torch.device(device))
    _refuse_meta_left(model, entries, offloaded, records)
    planner = UnitPlanner(model, records, offload_buffers, blocks, also=tuple(also))
    runtime = OffloadRuntime(planner.plan(offloaded), main, prefetch).attach().watch_calls(model)
    for key, device in entries.items():
        if device not in (CPU, DISK) and torch.device(device) != main:
            runtime.align_inputs(model.get_submodule(key), torch.device(device))
    if len(set(entries.values())) > 1 and main.type != "cpu":
        runtime.align_inputs(model, main)
    OFFLOAD.set(model, runtime)
    return runtime


def undispatch(model: nn.Module) -> None:
    """Take a previous dispatch's hooks off `model` (its offloaded tensors stay on meta)."""
    runtime = OFFLOAD.get(model, None)
    if runtime is not None:
        runtime.remove()
        OFFLOAD.pop(model)


def write_real_disk_tensors(model, keys, records, folder) -> dict[str, DiskWeight]:
    """Write each real (not meta) tensor under a "disk" key to `folder`; their records."""
    written: dict[str, DiskWeight] = {}
    names = [
        n
        for n, t in model.state_dict(keep_vars=True).items()
        if under(n, keys) and not t.is_meta and n not in records
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
        if all(device_for(entries, a) == DISK or under(a, away) for a in aliases):
            continue  # the planner reports it, naming the unit
        raise PlacementError(
            f"{name} is on the meta device and the device map keeps it on "
            f"{device_for(entries, name)}: it was never loaded (load the checkpoint first, "
            "load_checkpoint_in_model) and has no disk record to bring it in from"
        )


def under(name: str, keys) -> bool:
    """Whether tensor `name` lies under one of the module paths `keys` ("" is the root)."""
    return any(k == "" or name == k or name.startswith(k + ".") for k in keys)
