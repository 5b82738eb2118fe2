"""Device maps: which device holds each module's weights, planned from sizes and budgets.

The format is Accelerate's: a dict from module path ("" is the whole model) to "cuda:N", "cpu"
or "disk". `plan_placement` is the pure planner (ordered units with their sizes in, a map out);
`retarget.passes.place.device_map` feeds it from a model, and passes and the runtime read the
result, so it sits low enough for all of them.

Rules the planner keeps:
- devices are filled in order: cuda:0, cuda:1, ..., then cpu, then disk (disk has no limit);
- a unit that does not fit the device being filled is split into its parts when it has any
  (the caller gives them), else it moves to the next device; units are never reordered;
- the first device (the execution device) keeps room for the largest unit as soon as anything
  is placed on a later device, because an offloaded unit is brought there to run; when that
  device's budget cannot hold even the largest unit, planning fails naming the unit.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from retarget.targets.values import parse_size

DISK = "disk"
CPU = "cpu"


class PlacementError(ValueError):
    """A device map that cannot be planned or is not well formed."""


def parse_bytes(size: int | str, *, what: str = "size") -> int:
    """Bytes in `size`: an int, or "70MB" (powers of 10) / "2GiB" (powers of 2)."""
    try:
        return parse_size(size, what=what)
    except ValueError as error:
        raise PlacementError(str(error)) from None


def normalize_device(device: int | str | torch.device) -> str:
    """ "cpu", "disk" or "cuda:N" (an int N and "cuda" alone mean a CUDA device)."""
    if isinstance(device, bool):
        raise PlacementError(f"{device!r} is not a device")
    if isinstance(device, int):
        return f"cuda:{device}"
    if isinstance(device, str) and device == DISK:
        return DISK
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise PlacementError(
            f"{device!r} is not a device ('cpu', 'disk', 'cuda:N' or N)"
        ) from error
    if parsed.type == "cpu":
        return CPU
    return f"{parsed.type}:{parsed.index or 0}"


def device_order(device: str) -> tuple[int, int]:
    """Sort key: accelerators by index first, then cpu, then disk."""
    if device == DISK:
        return (2, 0)
    if device == CPU:
        return (1, 0)
    return (0, int(device.rpartition(":")[2] or 0))


def normalize_budgets(max_memory: Mapping[int | str, int | str]) -> dict[str, int]:
    """max_memory in Accelerate's spelling ({0: "10GiB", "cpu": "70MB"}) as device -> bytes."""
    budgets = {
        normalize_device(k): parse_bytes(v, what=f"max_memory[{k!r}]")
        for k, v in max_memory.items()
    }
    return dict(sorted(budgets.items(), key=lambda item: device_order(item[0])))


@dataclass(frozen=True)
class Unit:
    """What the planner places: a module path, the bytes it needs, and the parts it splits into."""

    path: str
    size: int
    parts: tuple[Unit, ...] = ()
    kind: str = ""


@dataclass(frozen=True)
class DeviceMap(Mapping[str, str]):
    """A planned device map: a Mapping in Accelerate's format, plus sizes and the budgets used.

    `dict(device_map)` is what Accelerate's `infer_auto_device_map` returns.
    """

    entries: dict[str, str]
    sizes: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    budgets: dict[str, int] = field(default_factory=dict)
    reserve: int = 0
    headroom: int = 0
    """Bytes of activations kept free on each device that runs blocks (budgets are net of it)."""

    def __getitem__(self, path: str) -> str:
        return self.entries[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def device_of(self, name: str) -> str:
        """The device of a module or tensor path: its longest mapped prefix."""
        return device_for(self.entries, name)

    def totals(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for path, device in self.entries.items():
            out[device] = out.get(device, 0) + self.sizes.get(path, 0)
        return dict(sorted(out.items(), key=lambda item: device_order(item[0])))

    def describe(self) -> list[str]:
        """One line per entry (module -> device, size), then one per device with its budget."""
        width = max((len(p or "<model>") for p in self.entries), default=8)
        lines = []
        for path, device in self.entries.items():
            kind = f"  ({self.kinds[path]})" if self.kinds.get(path) else ""
            size = format_bytes(self.sizes.get(path, 0))
            lines.append(f"{path or '<model>':<{width}}  -> {device:<7} {size:>10}{kind}")
        for device, total in self.totals().items():
            budget = self.budgets.get(device)
            limit = f" of {format_bytes(budget)}" if budget is not None else ""
            lines.append(f"{device}: {format_bytes(total)}{limit}")
        if self.headroom:
            lines.append(f"kept free for activations: {format_bytes(self.headroom)}")
        if self.reserve:
            lines.append(
                f"kept free on the execution device for one block: {format_bytes(self.reserve)}"
            )
        return lines

    def __str__(self) -> str:
        return "\n".join(self.describe())


def device_for(entries: Mapping[str, str], name: str) -> str:
    """The device of `name` (module or tensor path) under a map: its longest mapped prefix."""
    probe = name
    while True:
        if probe in entries:
            return entries[probe]
        if not probe:
            raise PlacementError(f"the device map places no prefix of {name!r}")
        probe = probe.rpartition(".")[0]


def format_bytes(size: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size} B"


def plan_placement(
    units: Sequence[Unit], budgets: Mapping[str, int], *, largest: Unit | None
) -> dict[str, str]:
    """Assign each unit (split when needed) to the first device in order with room for it.

    `budgets` is device -> bytes in fill order (disk added last, unlimited). `reserve` is kept
    free on the first device once anything is offloaded: the size of `largest`, the biggest
    unit that may be brought in to run. Returns path -> device, in unit order.
    """
    reserve = largest.size if largest else 0
    devices = [d for d in budgets if d != DISK] + [DISK]
    execution = devices[0]
    runs_on = [d for d in devices if d not in (CPU, DISK)] or [CPU]
    room_to_run = sum(budgets.get(d, 0) for d in runs_on)
    spills = execution != DISK and sum(u.size for u in units) > room_to_run
    if spills and budgets[execution] < reserve:
        raise PlacementError(
            f"max_memory[{execution!r}]={format_bytes(budgets[execution])} is too small for one "
            f"block: {largest.path or '<model>'} ({largest.kind or 'module'}) needs "
            f"{format_bytes(reserve)}; an offloaded block is brought to {execution} "
            "to run, so its budget must hold at least the largest block"
        )
    placed: dict[str, str] = {}
    index, used = 0, 0
    pending = list(units)
    while pending:
        unit = pending.pop(0)
        device = devices[index]
        if device == DISK:
            placed[unit.path] = DISK
            continue
        room = budgets[device] - used - (reserve if index == 0 and spills else 0)
        if unit.size <= room:
            placed[unit.path] = device
            used += unit.size
        elif unit.parts:
            pending[:0] = list(unit.parts)
        else:
            index, used = index + 1, 0
            pending.insert(0, unit)
    return placed
