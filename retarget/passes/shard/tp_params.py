"""Which modules a tensor-parallel plan talks about, and how many elements each rank holds.

A split module holds 1/N of each split parameter per rank (rank 0's share, the largest, when N
does not divide: DTensor's Shard places like torch.chunk); a replicated one holds all of it.
Column-wise splits the weight on its output features and the bias with it; row-wise splits the
weight on its input features and keeps the bias whole (added once after the all-reduce); an
embedding split over the vocabulary (rowwise_rep) and an LM head (colwise, colwise_rep) split
their weight's first dim.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from retarget.core.plans import TpPlan, TpRule
from retarget.core.tp_split_dims import RowOrder

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
