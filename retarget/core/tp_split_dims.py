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

A parameter whose split dim holds fused parts of unequal widths (Phi3's q|k|v under GQA) is
stored with its rows in rank order (`RowOrder`): rank r's block of the stored tensor is
[q_r|k_r|v_r], so an even Shard of it gives each rank its slice of every part.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
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


def get_width(module: nn.Module, name: str) -> Any:
    """An attribute a tp plan sets per rank: NAME, or "config.NAME" on the module's config."""
    holder, _, attribute = name.partition(".")
    return getattr(getattr(module, holder), attribute) if attribute else getattr(module, name)


def set_width(module: nn.Module, name: str, value: int) -> None:
    """Set NAME on `module`; "config.NAME" on a copy of its config that the module then holds
    alone (the model's config, which other modules and the user read, keeps the whole value)."""
    holder, _, attribute = name.partition(".")
    if not attribute:
        setattr(module, name, value)
        return
    own = copy.copy(getattr(module, holder))
    setattr(own, attribute, value)
    setattr(module, holder, own)


#: The attribute a tp parameter stored in rank order carries its RowOrder in.
ROW_ORDER = "_retarget_row_order"


@dataclass(frozen=True)
class RowOrder:
    """Where the rows of a tp-split parameter with fused parts of unequal `widths` (summing to
    its size on `dim`) are stored: rank by rank, each rank's slice of every part in turn, or
    the whole part for those in `whole` (held by every rank: Falcon's one-head k and v).

        >>> RowOrder(0, (4, 2, 2), 2).stored_rows().tolist()
        [0, 1, 4, 6, 2, 3, 5, 7]
        >>> RowOrder(0, (4, 1, 1), 2, whole=(1, 2)).stored_rows().tolist()
        [0, 1, 4, 5, 2, 3, 4, 5]
    """

    dim: int
    widths: tuple[int, ...]
    size: int
    whole: tuple[int, ...] = ()

    def local_rows(self) -> int:
        return sum(w if i in self.whole else w // self.size for i, w in enumerate(self.widths))

    @cached_property
    def _stored(self) -> torch.Tensor:
        rows: list[int] = []
        for rank in range(self.size):
            offset = 0
            for index, width in enumerate(self.widths):
                if index in self.whole:
                    rows.extend(range(offset, offset + width))
                else:
                    share = width // self.size
                    rows.extend(range(offset + rank * share, offset + (rank + 1) * share))
                offset += width
        return torch.tensor(rows, dtype=torch.long)

    @cached_property
    def _first(self) -> torch.Tensor:
        """For each row of the model's tensor, the first stored row holding it."""
        first = torch.full((sum(self.widths),), len(self._stored), dtype=torch.long)
        positions = torch.arange(len(self._stored))
        return first.scatter_reduce_(0, self._stored, positions, reduce="amin")

    def stored_rows(self) -> torch.Tensor:
        """For each stored row, the row of the model's tensor it holds."""
        return self._stored

    def rank_rows(self, rank: int) -> torch.Tensor:
        """The rows of the model's tensor `rank` holds, in its local order."""
        local = self.local_rows()
        return self._stored[rank * local : (rank + 1) * local]

    @cached_property
    def whole_rows(self) -> torch.Tensor:
        """The positions, among one rank's local rows, of the parts every rank holds whole."""
        rows: list[int] = []
        position = 0
        for index, width in enumerate(self.widths):
            share = width if index in self.whole else width // self.size
            if index in self.whole:
                rows.extend(range(position, position + share))
            position += share
        return torch.tensor(rows, dtype=torch.long)

    def to_stored(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.index_select(self.dim, self._stored.to(tensor.device))

    def to_model(self, tensor: torch.Tensor) -> torch.Tensor:
        """The model's tensor from the stored one (of a row held by every rank, rank 0's)."""
        return tensor.index_select(self.dim, self._first.to(tensor.device))
