"""Which modules get an offload hook, and which tensors each one brings in.

A device-map entry that is offloaded ("disk", or "cpu" when the execution device is not the
CPU) becomes one or more units. A block (the caller names them: the repeated blocks find_blocks
sees, plus classes asked to stay whole) or a module holding no block (an embedding, a head) is
one unit, whole: its tensors all arrive before it runs, so a region's graph, captured for the
block, always sees them. A module that holds blocks (a whole model, an encoder) is split: its
own direct tensors form a unit, and each child is planned the same way, so a whole-model entry
("") is brought in block by block and never at once. A key that names a tensor
("model.norm.weight") is a unit of that tensor.

Tied tensors: every (module, name) that holds the same tensor object shares one
`OffloadedTensor`, so swapping it updates every alias at once and the tie holds. A tensor that
is also held by a module outside the offloaded units stays resident.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from retarget.core.disk_weights import DiskWeight
from retarget.execution.offload.sources import CpuSource, DiskSource, SafetensorsFiles

Owner = tuple[nn.Module, str, bool]  # module, local tensor name, is a parameter


@dataclass(eq=False)
class OffloadedTensor:
    """One offloaded tensor with all the (module, name) slots that hold it."""

    name: str
    source: CpuSource | DiskSource
    placeholder: torch.Tensor
    owners: list[Owner]
    users: int = 0

    @property
    def nbytes(self) -> int:
        return self.source.nbytes

    def install(self, value: torch.Tensor) -> None:
        if isinstance(self.placeholder, nn.Parameter):
            value = nn.Parameter(value, requires_grad=self.placeholder.requires_grad)
        for module, local, is_param in self.owners:  # one object under every name: ties hold
            (module._parameters if is_param else module._buffers)[local] = value

    def uninstall(self) -> None:
        for module, local, is_param in self.owners:
            if is_param:
                module._parameters[local] = self.placeholder
            else:
                module._buffers[local] = self.placeholder


@dataclass(eq=False)
class OffloadUnit:
    """A module whose hook brings `tensors` in before it runs and releases them after."""

    path: str
    module: nn.Module
    tensors: list[OffloadedTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _has_block_list(module: nn.Module) -> bool:
    return any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) for m in module.modules())


def split_into_units(
    module: nn.Module, path: str, blocks: Collection[str] = ()
) -> list[tuple[str, nn.Module, bool]]:
    """(path, module, whole) per unit of an offloaded module, in module order.

    A module is one unit, whole, when it is a block (`blocks`: the repeated blocks and the
    classes asked to stay whole) or holds none; a module holding blocks is split. Without
    `blocks` known, a module holding a ModuleList/ModuleDict is split.
    """
    prefix = f"{path}." if path else ""
    holds = any(b.startswith(prefix) and b != path for b in blocks) if blocks else None
    if path in blocks or holds is False or (holds is None and not _has_block_list(module)):
        return [(path, module, True)]
    units = [(path, module, False)]
    for name, child in module.named_children():
        units += split_into_units(child, f"{prefix}{name}", blocks)
    return units


def _owners(model: nn.Module) -> dict[int, list[tuple[str, Owner]]]:
    owners: dict[int, list[tuple[str, Owner]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for local, tensor in table.items():
                if tensor is not None:
                    full = f"{prefix}.{local}" if prefix else local
                    owners.setdefault(id(tensor), []).append((full, (module, local, is_param)))
    return owners


@dataclass
class UnitPlanner:
    """Builds `OffloadUnit`s for a model; one `OffloadedTensor` per tensor object."""

    model: nn.Module
    disk_records: Mapping[str, DiskWeight]
    offload_buffers: bool = False
    blocks: Collection[str] = ()
    """Paths of the modules that are units whole (the repeated blocks, preloaded classes)."""
    files: SafetensorsFiles = field(default_factory=SafetensorsFiles)
    also: Sequence[nn.Module] = ()
    """Other models sharing these tensors (the user's, beside a compiled copy): their slots
    holding an offloaded tensor are swapped with the model's."""

    def __post_init__(self) -> None:
        self._owners = _owners(self.model)
        self._other_owners: dict[int, list[Owner]] = {}
        for other in self.also:
            for key, found in _owners(other).items():
                self._other_owners.setdefault(key, []).extend(owner for _, owner in found)
        self._persistent = {
            f"{p}.{b}" if p else b
            for p, m in self.model.named_modules()
            for b in m._buffers
            if b not in m._non_persistent_buffers_set
        }
        self._offloaded: dict[int, OffloadedTensor] = {}

    def plan(self, entries: Sequence[tuple[str, str]]) -> list[OffloadUnit]:
        """Units for the offloaded `(key, kind)` entries, kind "disk" or "cpu"."""
        chosen: list[tuple[str, nn.Module, list[str], str]] = []
        modules = dict(self.model.named_modules())
        for key, kind in entries:
            if key in modules:
                for path, module, whole in split_into_units(modules[key], key, self.blocks):
                    chosen.append((path, module, self._local_names(module, whole), kind))
            else:
                owner, _, local = key.rpartition(".")
                if owner not in modules or local not in _tensors(modules[owner]):
                    raise KeyError(f"device map key {key!r} names no module or tensor of the model")
                chosen.append((owner, modules[owner], [local], kind))
        inside = {f"{path}.{n}" if path else n for path, _, names, _ in chosen for n in names}
        # Read every tensor before any is swapped for its placeholder (a tie seen twice).
        found = []
        for path, module, names, kind in chosen:
            tensors = []
            for local in names:
                holder, _, leaf = local.rpartition(".")
                tensor = _tensors(module.get_submodule(holder))[leaf]
                if tensor is not None:
                    tensors.append((f"{path}.{local}" if path else local, tensor))
            found.append((path, module, tensors, kind))
        units = []
        for path, module, tensors, kind in found:
            unit = OffloadUnit(path, module)
            for full, tensor in tensors:
                aliases = self._owners[id(tensor)]
                if not all(f in inside for f, _ in aliases):
                    self._keep_resident(full, tensor, aliases)
                    continue
                offloaded = self._offload(full, tensor, aliases, kind)
                if offloaded is not None and offloaded not in unit.tensors:
                    unit.tensors.append(offloaded)
            if unit.tensors:
                units.append(unit)
        return units

    def _local_names(self, module: nn.Module, whole: bool) -> list[str]:
        if not whole:
            return list(_tensors(module))
        return [n for n, _ in _named_tensors(module)]

    def _offload(self, full, tensor, aliases, kind) -> OffloadedTensor | None:
        if id(tensor) in self._offloaded:
            return self._offloaded[id(tensor)]
        is_param = isinstance(tensor, nn.Parameter)
        names = [f for f, _ in aliases]
        record = next((self.disk_records[n] for n in names if n in self.disk_records), None)
        if not is_param and full not in self._persistent and record is None:
            return None  # non-persistent buffers (rotary tables) stay where they are
        if not is_param and not self.offload_buffers and record is None:
            return None
        if kind == "disk" and record is not None:
            source = DiskSource(record, self.files)
        elif tensor.device.type == "meta":
            raise ValueError(
                f"{full} is on meta with no disk record: load the checkpoint first "
                "(load_checkpoint_in_model) or give offload_dir with its disk_index.json"
            )
        else:
            source = CpuSource(tensor.detach().to("cpu"))
        placeholder = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
        if is_param:
            placeholder = nn.Parameter(placeholder, requires_grad=tensor.requires_grad)
        owners = [o for _, o in aliases] + self._other_owners.get(id(tensor), [])
        offloaded = OffloadedTensor(full, source, placeholder, owners)
        offloaded.uninstall()
        self._offloaded[id(tensor)] = offloaded
        return offloaded

    def _keep_resident(self, full, tensor, aliases) -> None:
        if tensor.device.type != "meta":
            return
        names = [f for f, _ in aliases]
        record = next((self.disk_records[n] for n in names if n in self.disk_records), None)
        if record is None:
            raise ValueError(f"{full} is on meta with no disk record and is tied to {names}")
        value = DiskSource(record, self.files).load(torch.device("cpu"))
        owners = [o for _, o in aliases] + self._other_owners.get(id(tensor), [])
        OffloadedTensor(full, CpuSource(value), tensor, owners).install(value)


def _tensors(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {**module._parameters, **module._buffers}


def _named_tensors(module: nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)
