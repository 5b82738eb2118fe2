"""Which modules a tensor-parallel plan talks about, and how many elements each rank holds.

A split module holds 1/N of each split parameter per rank (rank 0's share, the largest, when N
does not divide: DTensor's Shard places like torch.chunk); a replicated one holds all of it.
Column-wise splits the weight on its output features and the bias with it; row-wise splits the
weight on its input features and keeps the bias whole (added once after the all-reduce); an
embedding split over the vocabulary (rowwise_rep) and an LM head (colwise, colwise_rep) split
their weight's first dim.

`per_rank_of` counts a plan's elements per rank from the split dims table (fused parts kept
whole count on every rank); `fsdp_shapes` gives, under fsdp+tp, the shape FSDP2 then shards over
dp of each split parameter (the report, shard_fsdp's units and the memory estimate read it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from retarget.core.plans import TpPlan, TpRule
from retarget.core.tp_split_dims import RowOrder, local_numel, module_kind, split_dims
from retarget.ir.program import Program

#: Styles that split a module's weight (and which of its parameters they split).
SPLIT_PARAMETERS = {
    "colwise": ("weight", "bias"),
    "colwise_rep": ("weight", "bias"),
    "rowwise": ("weight",),
    "rowwise_rep": ("weight",),
}


def is_linear_like(module: nn.Module) -> bool:
    """nn.Linear, or HF's Conv1D (a Linear with its weight stored transposed)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or name.endswith(("RMSNorm", "LayerNorm"))


def _local(numel: int, rows: int, size: int) -> int:
    """Elements of rank 0's share when `rows` (the split dim) is chunked over `size` ranks."""
    share = -(-rows // size)
    return numel // rows * share if rows else numel


def tp_per_rank_params(
    model: nn.Module,
    rules: Mapping[str, TpRule] | TpPlan,
    size: int = 0,
    modules: Mapping[str, nn.Module] | None = None,
    held_rows: Mapping[str, int] | None = None,
):
    """Per module of the plan: (elements rank 0 holds, elements in all), of its own parameters.
    `held_rows`: module path -> the rows of its split dim each rank holds, where that is not
    1/N (fused parts kept whole on every rank beside split ones: `fused_rows`).

    >>> tp_per_rank_params(model, plan)["model.layers.0.mlp.up_proj"]
    (4096, 8192)
    """
    if isinstance(rules, TpPlan):
        held_rows = fused_rows(rules.fused_widths, rules.fused_whole, rules.size)
        size, rules = rules.size, rules.rules
    held_rows = held_rows or {}
    if modules is None:
        modules = dict(model.named_modules(remove_duplicate=False))
    counts = {}
    for path, rule in rules.items():
        module = modules[path]
        split = SPLIT_PARAMETERS.get(rule.style, ())
        local = total = 0
        for name, param in _own_parameters(module):
            total += param.numel()
            if name in split and param.dim() >= 1 and path in held_rows:
                rows = param.shape[_split_dim(module, name, rule)]
                local += param.numel() // rows * held_rows[path]
            elif name in split and param.dim() >= 1:
                local += _local(param.numel(), param.shape[_split_dim(module, name, rule)], size)
            else:
                local += param.numel()
        counts[path] = (local, total)
    return counts


def _own_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The module's own parameters (without named_parameters' walk of the tree)."""
    return [(n, p) for n, p in module._parameters.items() if p is not None]


def _split_dim(module: nn.Module, name: str, rule: TpRule) -> int:
    if name == "bias" or param_rows_first(module, rule):
        return 0
    return 1


def param_rows_first(module: nn.Module, rule: TpRule) -> bool:
    """Whether the style splits the weight's dim 0 (Linear colwise, Conv1D rowwise, vocab)."""
    conv1d = type(module).__name__ == "Conv1D"
    if isinstance(module, nn.Embedding):
        return True
    colwise = rule.style.startswith("colwise")
    return colwise != conv1d


def fused_rows(
    widths: Mapping[str, tuple[int, ...]], whole: Mapping[str, tuple[int, ...]], size: int
) -> dict[str, int]:
    """Module path -> rows of the split dim each rank holds, for fused parts some of which are
    kept whole on every rank (Falcon's k and v; `whole` names them by index)."""
    return {
        path: RowOrder(0, widths[path], size, kept).local_rows() for path, kept in whole.items()
    }


def plan_numel(
    model: nn.Module,
    rules: Mapping[str, TpRule],
    size: int,
    held_rows: Mapping[str, int] | None = None,
) -> tuple[int, int]:
    """(parameter elements rank 0 holds, parameter elements of the model), tied ones once."""
    modules = dict(model.named_modules(remove_duplicate=False))
    seen = {id(p): p.numel() for m in modules.values() for _, p in _own_parameters(m)}
    total = sum(seen.values())
    counts = tp_per_rank_params(model, rules, size, modules, held_rows)
    saved = 0
    counted = set()
    for path, (local, full) in counts.items():
        module = modules[path]
        ids = {id(p) for _, p in _own_parameters(module)}
        if ids & counted:
            continue
        counted |= ids
        saved += full - local
    return total - saved, total


def per_rank_of(program: Program, plan: TpPlan, root: nn.Module) -> tuple[int, int]:
    """(elements one rank holds, elements in all) of `root`'s parameters under `plan` (a
    parameter shared by two modules counts once, as its first module splits it)."""
    styles = {id(program.submodule(p)): r.style for p, r in plan.rules.items()}
    held = fused_rows(plan.fused_widths, plan.fused_whole, plan.size)
    held_by_module = {id(program.submodule(p)): rows for p, rows in held.items()}
    mine = total = 0
    seen: set[int] = set()
    for module in root.modules():
        kind = module_kind(module)
        dims = split_dims(kind, styles.get(id(module), "replicate")) if kind else {}
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            total += param.numel()
            rows = held_by_module.get(id(module))
            shape = _local_shape(tuple(param.shape), dims.get(name), plan.size, rows)
            mine += local_numel(shape, None, plan.size)
    return mine, total


def _local_shape(
    shape: tuple[int, ...], dim: int | None, size: int, held_rows: int | None
) -> tuple[int, ...]:
    """The shape one tp rank holds of a parameter split on `dim` (None: whole): 1/`size` of
    it, or `held_rows` rows (fused parts kept whole on every rank: `fused_rows`)."""
    if dim is None:
        return shape
    local = list(shape)
    local[dim] = local[dim] // size if held_rows is None else held_rows
    return tuple(local)


def fsdp_shapes(
    program: Program, plan: TpPlan, dp: int
) -> tuple[dict[int, tuple[int, ...]], set[int]]:
    """fsdp+tp: what FSDP2 then shards over the `dp` ranks of each split parameter.

    Returns id(parameter) -> the tp rank's shape with the dim FSDP2 chunks moved first, and the
    ids each dp rank keeps whole. FSDP2 chunks dim 0, except for fused parts split on dim 0
    (GPT-2's c_attn bias): execution/tp_fsdp.py shards those on the first other dim `dp` divides,
    or keeps them whole on every dp rank when there is none.
    """
    shapes: dict[int, tuple[int, ...]] = {}
    whole: set[int] = set()
    for param, shape, fused_dim_0 in _split_parameters(program, plan):
        if fused_dim_0 and dp > 1:
            dim = next((d for d in range(1, len(shape)) if shape[d] % dp == 0), None)
            if dim is None:
                whole.add(id(param))
            else:
                shape = (shape[dim], *shape[:dim], *shape[dim + 1 :])
        shapes[id(param)] = shape
    return shapes, whole


def _split_parameters(program: Program, plan: TpPlan) -> list[tuple[Any, tuple[int, ...], bool]]:
    """(parameter, the shape one tp rank holds, whether it is fused parts split on dim 0) for
    each parameter the plan splits, once each."""
    found: list[tuple[Any, tuple[int, ...], bool]] = []
    seen: set[int] = set()
    held = fused_rows(plan.fused_widths, plan.fused_whole, plan.size)
    for path, rule in plan.rules.items():
        module = program.submodule(path)
        kind = module_kind(module)
        fused = plan.fused.get(path, 1) > 1
        for name, dim in (split_dims(kind, rule.style) if kind else {}).items():
            param = getattr(module, name, None)
            if param is None or dim is None or id(param) in seen:
                continue
            seen.add(id(param))
            shape = _local_shape(tuple(param.shape), dim, plan.size, held.get(path))
            found.append((param, shape, fused and dim == 0))
    return found
