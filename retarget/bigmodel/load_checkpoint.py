"""load_checkpoint_in_model: a checkpoint into a (meta-initialised) model, tensor by tensor.

Everything is checked from the files' headers before the model is touched: shards exist, every
key of the model has a stored tensor (tied keys share one), no stored key is unknown to the
model, shapes match, dtypes can be cast. Then tensors are read one at a time, cast (floating
ones only), moved to their device and set into the model: a meta parameter is replaced by a
real one of the same class (every name of a tied group gets the same new object), a real one
is overwritten in place. At most one tensor is in flight, so no second copy of the weights
ever exists.

Tensors of modules the device map sends to "disk" are not loaded: they stay on meta and get a
`DiskWeight` record (core/disk_weights.py) for the offload runtime. If reading fails half way,
every tensor loaded so far goes back to meta, the model is marked (slot LOAD_FAILED) and its
forward refuses to run until a load succeeds.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from retarget.bigmodel.checkpoint_files import (
    CheckpointError,
    CheckpointFiles,
    StoredTensor,
    as_floating_dtype,
    find_checkpoint,
    tensor_reader,
)
from retarget.core.disk_weights import DiskWeight, write_disk_index
from retarget.core.placement import CPU, DISK, device_for
from retarget.core.slots import DISK_WEIGHTS, LOAD_FAILED
from retarget.passes.place.device_map import resolve_device_map


@dataclass
class TensorGroup:
    """State-dict keys naming one tensor (more than one when tied), and where it comes from."""

    keys: list[str]
    stored: StoredTensor | None = None
    dtype: torch.dtype | None = None
    device: str = CPU


@dataclass
class LoadedCheckpoint:
    """What a load did: the device map used and the tensors left on disk (name -> DiskWeight)."""

    device_map: dict[str, str]
    disk: dict[str, DiskWeight] = field(default_factory=dict)
    loaded: int = 0


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | Path,
    device_map: str | Mapping[str, int | str | torch.device] | None = None,
    dtype: str | torch.dtype | None = None,
    offload_folder: str | Path | None = None,
    strict: bool = True,
    max_memory: Mapping[int | str, int | str] | None = None,
    mmap: bool = False,
) -> LoadedCheckpoint:
    """Load `checkpoint` into `model` in place; tensors mapped to "disk" are recorded instead.

    `device_map` is None (keep each tensor's device; meta ones go to the cpu), a dict in
    Accelerate's format, or "auto" / "balanced" / "sequential" (planned with `max_memory`).
    `strict=False` turns missing and unexpected keys into a warning (missing ones stay meta).
    `mmap=True` leaves cpu tensors that need no cast backed by the safetensors file's private
    memory map (no copy, no anonymous memory; the file must then not be rewritten in place
    while the model lives); their file and key are recorded beside the disk ones (slot
    DISK_WEIGHTS), so the stream part reads them from the checkpoint instead of a copy.

        >>> with retarget.init_empty_weights():
        ...     model = LlamaForCausalLM(config)
        >>> retarget.load_checkpoint_in_model(model, "out/llama", dtype=torch.bfloat16)
    """
    target = as_floating_dtype(dtype)
    files = find_checkpoint(checkpoint)
    state = model.state_dict(keep_vars=True)
    entries = resolve_device_map(model, device_map, max_memory=max_memory, dtype=target)
    groups = _plan(model, state, files, entries, target)
    _check_keys(model, files, state, groups, strict)
    _check_offload_folder(groups, offload_folder)
    disk, loaded, mapped = _load_groups(model, groups, files, offload_folder, mmap)
    if offload_folder is not None and disk:
        write_disk_index(offload_folder, disk)
    DISK_WEIGHTS.set(model, disk | mapped)
    return LoadedCheckpoint(device_map=entries, disk=disk, loaded=loaded)


def _load_groups(model, groups, files, folder, mmap):
    """Read, cast, place and set every group; on any failure, undo and mark the model.

    Returns (records of tensors left on disk, tensors loaded, records of memory-mapped ones).
    """
    disk: dict[str, DiskWeight] = {}
    mapped: dict[str, DiskWeight] = {}
    done: list[tuple[nn.Module, str, torch.Tensor]] = []
    try:
        with tensor_reader(mapped=mmap) as reader:
            for group in groups:
                if group.stored is None:
                    continue
                if group.device == DISK:
                    disk |= _offload(model, group, reader, folder)
                    continue
                value = reader.read(group.stored)
                if value.dtype != group.dtype:
                    value = value.to(group.dtype)
                elif mmap and _mappable(group) and group.device == CPU:
                    mapped |= _record(group, str(group.stored.file.resolve()), group.stored.key)
                done += _set_tensor(model, group, value.to(group.device))
    except Exception as error:
        metas: dict[int, torch.Tensor] = {}
        for module, name, old in done:
            _put_back_meta(module, name, old, metas)
        message = (
            f"loading {files.origin} failed: {error}; the {len(done)} tensors loaded before "
            "were put back on the meta device and the model refuses to run until a load succeeds"
        )
        _mark_failed(model, message)
        raise CheckpointError(message) from error
    _clear_failed(model)
    return disk, len(done), mapped


def _plan(model, state, files: CheckpointFiles, entries, target) -> list[TensorGroup]:
    """One group per distinct tensor: its stored source, dtype and device, checked."""
    by_tensor: dict[int, TensorGroup] = {}
    for key, tensor in state.items():
        by_tensor.setdefault(id(tensor), TensorGroup(keys=[])).keys.append(key)
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for group in by_tensor.values():
        sources = [k for k in group.keys if k in files.tensors]
        sources += [files.aliases[k] for k in group.keys if files.aliases.get(k) in files.tensors]
        if not sources:
            continue
        group.stored = files.tensors[sources[0]]
        tensor = state[group.keys[0]]
        group.dtype = target if target is not None and tensor.is_floating_point() else tensor.dtype
        _check_tensor(model, group, tuple(tensor.shape))
        group.device = _device_of(group, entries, tensor)
        if group.device.startswith("cuda") and int(group.device[5:]) >= cuda:
            raise CheckpointError(
                f"the device map puts {group.keys[0]!r} on {group.device}, "
                f"but this machine has {cuda} CUDA devices"
            )
    return list(by_tensor.values())


def _device_of(group: TensorGroup, entries: dict[str, str], tensor: torch.Tensor) -> str:
    """Where the map puts the group; a tie between memory and disk stays in memory."""
    if not entries:
        return CPU if tensor.is_meta else str(tensor.device)
    in_memory = [d for d in (device_for(entries, k) for k in group.keys) if d != DISK]
    return in_memory[0] if in_memory else DISK


def _check_keys(model, files: CheckpointFiles, state, groups, strict: bool) -> None:
    """Missing and unexpected keys: an error under strict, else one warning."""
    missing = [k for g in groups if g.stored is None for k in g.keys]
    unexpected = [k for k in files.tensors if k not in state]
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} keys of the model are not in the checkpoint: "
            + ", ".join(f"{k!r} ({_owner(model, k)})" for k in missing[:5])
        )
    if unexpected:
        problems.append(
            f"{len(unexpected)} keys of the checkpoint are not in the model: "
            + ", ".join(f"{k!r} in {files.tensors[k].file.name}" for k in unexpected[:5])
        )
    if problems and strict:
        raise CheckpointError(f"{files.origin}: " + "; ".join(problems) + " (strict=True)")
    if problems:
        warnings.warn(
            f"{files.origin}: "
            + "; ".join(problems)
            + " (strict=False: missing ones stay as they are)",
            stacklevel=3,
        )


def _check_offload_folder(groups: list[TensorGroup], offload_folder) -> None:
    needs_cast = [g for g in groups if g.stored is not None and g.device == DISK]
    needs_cast = [g for g in needs_cast if not _mappable(g)]
    if needs_cast and offload_folder is None:
        first = needs_cast[0]
        raise CheckpointError(
            f"the device map sends {first.keys[0]!r} to disk but it cannot be mapped "
            f"from {first.stored.file} as it is ({first.stored.dtype} stored, "
            f"{first.dtype} wanted): give offload_folder= to write it there"
        )


def _check_tensor(model: nn.Module, group: TensorGroup, shape: tuple[int, ...]) -> None:
    stored, key = group.stored, group.keys[0]
    where = f"{key!r} ({_owner(model, key)}) in {stored.file.name}"
    if stored.shape != shape:
        raise CheckpointError(
            f"{where}: stored shape {list(stored.shape)}, model wants {list(shape)}"
        )
    if stored.dtype != group.dtype and not (
        stored.dtype.is_floating_point and group.dtype.is_floating_point
    ):
        raise CheckpointError(
            f"{where}: stored as {stored.dtype}, which cannot be cast to {group.dtype} "
            "(only floating tensors are cast)"
        )


def _owner(model: nn.Module, key: str) -> str:
    path = key.rpartition(".")[0]
    try:
        return f"{type(model.get_submodule(path)).__name__} {path or '<model>'}"
    except AttributeError:
        return "no such module"


def _mappable(group: TensorGroup) -> bool:
    return group.stored.is_safetensors and group.stored.dtype == group.dtype


def _offload(model, group, reader, folder) -> dict[str, DiskWeight]:
    stored, shape = group.stored, group.stored.shape
    if _mappable(group):
        file, key = str(stored.file.resolve()), stored.key
    else:
        value = reader.read(stored).to(group.dtype).contiguous()
        path = Path(folder) / f"{group.keys[0]}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({group.keys[0]: value}, path)
        file, key = str(path.resolve()), group.keys[0]
        del value
    meta = torch.empty(shape, dtype=group.dtype, device="meta")
    _set_tensor(model, group, meta)
    return _record(group, file, key)


def _record(group: TensorGroup, file: str, key: str) -> dict[str, DiskWeight]:
    """A DiskWeight for every key of the group: `file`'s tensor `key` holds its value."""
    dtype_name = str(group.dtype).removeprefix("torch.")
    shape = group.stored.shape
    return {k: DiskWeight(file=file, key=key, dtype=dtype_name, shape=shape) for k in group.keys}


def _set_tensor(model: nn.Module, group: TensorGroup, value: torch.Tensor):
    """Set `value` under every key of the group; returns (module, name, old) per key."""
    changed = []
    new = None
    for key in group.keys:
        path, _, name = key.rpartition(".")
        module = model.get_submodule(path)
        old = module._parameters.get(name)
        is_param = old is not None
        if not is_param:
            old = module._buffers[name]
        same = not old.is_meta and old.dtype == value.dtype and old.device == value.device
        if same and not value.is_meta:
            with torch.no_grad():
                old.copy_(value)
        elif is_param:
            if new is None:
                new = _parameter_like(old, value)
            module._parameters[name] = new
        else:
            module._buffers[name] = value
        changed.append((module, name, old))
    return changed


def _parameter_like(old: nn.Parameter, value: torch.Tensor) -> nn.Parameter:
    try:
        new = type(old)(value, requires_grad=old.requires_grad)
    except TypeError:
        new = nn.Parameter(value, requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)
    return new


def _put_back_meta(module: nn.Module, name: str, old: torch.Tensor, metas: dict) -> None:
    # One meta tensor per old tensor, so that tied names stay tied.
    if old.is_meta:
        metas[id(old)] = old
    elif id(old) not in metas:
        meta = torch.empty(old.shape, dtype=old.dtype, device="meta")
        if isinstance(old, nn.Parameter):
            meta = _parameter_like(old, meta)
        metas[id(old)] = meta
    if name in module._parameters:
        module._parameters[name] = metas[id(old)]
    else:
        module._buffers[name] = metas[id(old)]


def _refuse_to_run(module: nn.Module, args, kwargs):
    raise RuntimeError(LOAD_FAILED.get(module)[0])


def _mark_failed(model: nn.Module, message: str) -> None:
    _clear_failed(model)
    handle = model.register_forward_pre_hook(_refuse_to_run, with_kwargs=True)
    LOAD_FAILED.set(model, (message, handle))


def _clear_failed(model: nn.Module) -> None:
    failed = LOAD_FAILED.pop(model)
    if failed is not None:
        failed[1].remove()
