"""Which dim of which parameter a tensor-parallel style splits, per kind of module.

The one table both the plan (passes/shard/shard_tp: per-rank counts, divisibility checks) and
the runtime (execution/apply_tp: the DTensor placements) read, so the two cannot disagree.

Kinds of module a style can split:
- linear: nn.Linear, weight [out, in] (and subclasses with that layout);
- embedding: nn.Embedding, weight [vocab, dim];
- conv1d: GPT-2's Conv1D (transformers.pytorch_utils), weight [in, out] (transposed Linear),
  recognised by its class name and its `nf` attribute (the output width).

    >>> split_dims("conv1d", "colwise")
    {'weight': 1, 'bias': 0}
"""

from __future__ import annotations

import math

from torch import nn

#: kind -> style -> {parameter name: dim it is split on, None: kept whole on every rank}.
SPLIT_DIMS: dict[str, dict[str, dict[str, int | None]]] = {
    "linear": {
        "colwise": {"weight": 0, "bias": 0},
        "colwise_rep": {"weight": 0, "bias": 0},
        "rowwise": {"weight": 1, "bias": None},
        "rowwise_rep": {"weight": 1, "bias": None},
    },
    "embedding": {
        "colwise": {"weight": 1},
        "colwise_rep": {"weight": 1},
        "rowwise": {"weight": 0},
        "rowwise_rep": {"weight": 0},
    },
    "conv1d": {
        "colwise": {"weight": 1, "bias": 0},
        "colwise_rep": {"weight": 1, "bias": 0},
        "rowwise": {"weight": 0, "bias": None},
        "rowwise_rep": {"weight": 0, "bias": None},
    },
}
#: Styles that split parameters (the others keep them whole: sequence_parallel, replicate).
SPLITTING_STYLES = ("colwise", "colwise_rep", "rowwise", "rowwise_rep")
#: Styles whose output dim holds fused parts (q|k|v) that must be split one by one.
COLWISE_STYLES = ("colwise", "colwise_rep")


def module_kind(module: nn.Module) -> str | None:
    """linear, embedding, conv1d, or None for a module no style here splits."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and weight is not None:
        if weight.dim() == 2 and weight.shape[1] == module.nf:
            return "conv1d"
    return None


def split_dims(kind: str, style: str) -> dict[str, int | None]:
    """{parameter name: split dim or None} for a module `kind` under `style` ({} if unsplit)."""
    if style not in SPLITTING_STYLES:
        return {}
    return SPLIT_DIMS[kind][style]


def local_numel(shape: tuple[int, ...], dim: int | None, size: int) -> int:
    """Elements one rank holds of a parameter of `shape` split evenly on `dim` (None: whole)."""
    if dim is None:
        return math.prod(shape)
    return math.prod(shape) // size
