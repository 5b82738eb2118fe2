"""infer_auto_device_map: a device map for a model from its sizes, its blocks and the budgets.

What may not be split across devices defaults to the repeated blocks `find_blocks` finds
(its structural fingerprint on the module tree, no class names to type), plus any class named in
`no_split_module_classes`. Sizes come from parameters and buffers (floating ones counted in
`dtype` when given; a tied tensor once, at its first name). The planner itself
(`core.placement.plan_placement`) fills the devices in order: accelerators, cpu, disk.

    >>> with retarget.init_empty_weights():
    ...     model = LlamaForCausalLM(config)
    >>> plan = retarget.infer_auto_device_map(model, max_memory={"cpu": "70MB"})
    >>> print(plan)     # module -> device, size; then each device's total and budget
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from retarget.core.placement import (
    CPU,
    DISK,
    DeviceMap,
    PlacementError,
    Unit,
    device_for,
    device_order,
    normalize_budgets,
    normalize_device,
    plan_placement,
)
from retarget.passes.analysis.find_blocks import repeated_blocks
from retarget.passes.place.activation_headroom import activation_headroom
from retarget.targets.values import parse_dtype

MODES = ("auto", "balanced", "sequential")
#: Share of the free memory planned for when max_memory is not given.
FREE_SHARE = 0.9


def infer_auto_device_map(
    model: nn.Module,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: Sequence[str] | None = None,
    dtype: str | torch.dtype | None = None,
    mode: str = "sequential",
    example_inputs: Any = None,
) -> DeviceMap:
    """Plan module path -> "cuda:N" | "cpu" | "disk" within `max_memory` (default: free memory).

    `mode` "balanced" (and "auto", as Accelerate) spreads the model evenly over several CUDA
    devices; "sequential" fills each device before the next. With `example_inputs` (a tuple of
    positional arguments, a dict of keyword arguments, or one argument), the largest activation
    peak of one block (measured on meta) is kept free on each device that runs blocks.
    """
    if mode not in MODES:
        raise PlacementError(f"device_map={mode!r}: use one of {', '.join(MODES)} or a dict")
    try:
        dtype = parse_dtype(dtype)
    except ValueError as error:
        raise PlacementError(f"infer_auto_device_map: {error}") from None
    budgets = normalize_budgets(max_memory) if max_memory is not None else available_memory()
    budgets.pop(DISK, None)
    sizes = tensor_sizes(model, dtype)
    blocks = no_split_paths(model, no_split_module_classes)
    headroom = 0
    if example_inputs is not None:
        headroom = activation_headroom(model, sorted(blocks), example_inputs)
        runs = [d for d in budgets if d != CPU] or [CPU]
        budgets = {d: max(b - headroom, 0) if d in runs else b for d, b in budgets.items()}
    root = _unit(model, "", sizes, blocks)
    atoms = list(_atoms(root))
    largest = max(atoms, key=lambda u: u.size, default=None)
    if mode != "sequential":
        budgets = balanced_budgets(budgets, root.size, largest.size if largest else 0)
    placed = plan_placement(root.parts or (root,), budgets, largest=largest)
    placed = _follow_ties(model, placed)
    if len(set(placed.values())) == 1:
        placed = {"": next(iter(placed.values()))}
    module_sizes = _sizes_by_path(root)
    kinds = {u.path: u.kind for u in _walk(root) if u.kind}
    spills = (
        any(d in (CPU, DISK) for d in placed.values())
        and any(d not in (CPU, DISK) for d in budgets)
        or DISK in placed.values()
    )
    return DeviceMap(
        entries=placed,
        sizes={p: module_sizes.get(p, 0) for p in placed},
        kinds={p: kinds[p] for p in placed if p in kinds},
        budgets={d: b for d, b in budgets.items()},
        reserve=largest.size if largest and spills else 0,
        headroom=headroom,
    )


def resolve_device_map(
    model: nn.Module,
    device_map: str | Mapping[str, int | str | torch.device] | None,
    *,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: Sequence[str] | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, str]:
    """A device map as a checked dict: planned for a mode name, normalized for a dict."""
    if device_map is None:
        return {}
    if isinstance(device_map, str):
        plan = infer_auto_device_map(model, max_memory, no_split_module_classes, dtype, device_map)
        return dict(plan)
    names = {n for n, _ in model.named_modules()} | set(model.state_dict(keep_vars=True))
    names |= {n for n, _ in model.named_buffers()}
    unknown = [p for p in device_map if p not in names]
    if unknown:
        raise PlacementError(
            f"device_map names {unknown[0]!r}, which is not a module of {type(model).__name__}"
        )
    return {p: normalize_device(d) for p, d in device_map.items()}


def tensor_sizes(model: nn.Module, dtype: torch.dtype | None) -> dict[str, int]:
    """Bytes per tensor name (first name of a tied tensor only), floating ones in `dtype`."""
    sizes = {}
    seen: set[int] = set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        kind = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        sizes[name] = tensor.numel() * torch.empty((), dtype=kind).element_size()
    return sizes


def no_split_paths(model: nn.Module, class_names: Sequence[str] | None) -> set[str]:
    """The repeats of every repeated block, plus modules of the named classes."""
    paths = {p for group in repeated_blocks(model, {}, 2) for p in group.paths}
    wanted = set(class_names or ())
    paths |= {p for p, m in model.named_modules() if type(m).__name__ in wanted}
    return paths


def balanced_budgets(budgets: dict[str, int], total: int, largest: int) -> dict[str, int]:
    """Cap every CUDA device but the last to an even share of the model (+ one block)."""
    cuda = [d for d in budgets if d not in (CPU, DISK)]
    if len(cuda) < 2:
        return budgets
    share = -(-total // len(cuda)) + largest
    return {d: min(b, share) if d in cuda[:-1] else b for d, b in budgets.items()}


def available_memory() -> dict[str, int]:
    """Free memory per device now (FREE_SHARE of it): every CUDA device, then the cpu."""
    budgets = {}
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            free, _ = torch.cuda.mem_get_info(index)
            budgets[f"cuda:{index}"] = int(free * FREE_SHARE)
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    budgets[CPU] = int(int(fields["MemAvailable"].split()[0]) * 1024 * FREE_SHARE)
    return dict(sorted(budgets.items(), key=lambda item: device_order(item[0])))


def _unit(module: nn.Module, path: str, sizes: dict[str, int], blocks: set[str]) -> Unit:
    prefix = f"{path}." if path else ""
    own = [
        Unit(path=prefix + n, size=sizes.get(prefix + n, 0))
        for n, t in [*module._parameters.items(), *module._buffers.items()]
        if t is not None
    ]
    children = [
        _unit(c, prefix + n, sizes, blocks) for n, c in module._modules.items() if c is not None
    ]
    size = sum(u.size for u in own) + sum(u.size for u in children)
    kind = type(module).__name__
    if path in blocks or not children:
        return Unit(path=path, size=size, kind=kind)
    return Unit(path=path, size=size, parts=tuple(own + children), kind=kind)


def _follow_ties(model: nn.Module, placed: dict[str, str]) -> dict[str, str]:
    """An entry whose tensors are all another name's (a tied head) goes where that name went."""
    first: dict[int, str] = {}
    alias: dict[str, str] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        alias[name] = first.setdefault(id(tensor), name)
    out = dict(placed)
    for path in placed:
        prefix = f"{path}." if path else ""
        names = [n for n in alias if n == path or n.startswith(prefix)]
        targets = {alias[n] for n in names if alias[n] != n}
        if names and len(targets) == len(names) and len(targets) == 1:
            out[path] = device_for(placed, targets.pop())
    return out


def _walk(unit: Unit):
    yield unit
    for part in unit.parts:
        yield from _walk(part)


def _atoms(unit: Unit):
    return (u for u in _walk(unit) if not u.parts)


def _sizes_by_path(root: Unit) -> dict[str, int]:
    return {u.path: u.size for u in _walk(root)}
