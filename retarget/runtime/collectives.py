"""Collectives on nested structures of tensors: gather, gather_for_metrics, reduce, pad, broadcast.

Training loops exchange whole structures (a dict of logits and labels, a list of strings), not
single tensors, and on CPU they do it over gloo, which has two sharp edges (docs/facts.md):
`all_gather` needs equal sizes on every rank (a mismatched call desynchronises the group), and
some dtypes (float8, int16, uint16, uint32) are refused. So every function here first exchanges
a description of the structure (paths, shapes, dtypes), checks it is the same on every rank
(all ranks see the same descriptions, so all raise the same error instead of hanging), then
moves each tensor: padded to a common size and trimmed back, and refused dtypes travel as bytes.

Every function takes the `ProcessState` first (None means `ProcessState.current()`), and in a
world of one returns its input unchanged (gather_for_metrics still cuts a loader's short last
batch to its real samples).

    >>> gather(state, {"pred": preds})            # rank 0: 3 rows, rank 1: 2 rows
    {'pred': tensor of 5 rows}                     # on every rank, in rank order
    >>> for batch in loader:                       # a ShardedDataLoader
    ...     preds.append(gather_for_metrics(state, model(batch).argmax(-1)))
    >>> torch.cat(preds)                           # exactly the dataset, in sampler order
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from retarget.execution.nested import (
    map_leaves,
    map_structure,
    map_tensors,
    replace_tensors,
    tensor_leaves,
)
from retarget.execution.process import ProcessState
from retarget.runtime.data.sharded_loader import active_loader

#: dtypes gloo carries as they are (measured); any other travels as its raw bytes, which is
#: exact for gather and broadcast. Reductions need arithmetic, so they refuse the others.
_WIRE_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)

_REDUCTIONS = ("sum", "mean")

#: One tensor as the other ranks see it: (path in the structure, shape, dtype).
_Meta = tuple[str, tuple[int, ...], torch.dtype]


def gather(state: ProcessState | None, data: Any) -> Any:
    """Every rank's tensors concatenated along dim 0, in rank order, on every rank.

    `data` is a tensor or a nested dict/list/tuple of them (non-tensor leaves pass through).
    The first dimension may differ between ranks; the others must not. 0-dim tensors become
    one row per rank.
    """
    state = _resolve(state)
    if not state.distributed:
        return data
    found = tensor_leaves(data)
    metas = _exchange_meta(state, found)
    _check_alike(metas, "gather", compare=lambda a, b: a[1:] == b[1:])
    gathered = [
        _gather_rows(state, tensor, [meta[i][1] for meta in metas])
        for i, (_, tensor) in enumerate(found)
    ]
    return replace_tensors(data, gathered)


def gather_object(state: ProcessState | None, obj: Any) -> list[Any]:
    """Every rank's picklable `obj`, as one list on every rank.

    Lists and tuples are concatenated in rank order (a list of per-sample strings gathers into
    the list of all samples); any other object gives a list with one entry per rank. A world of
    one returns a list input unchanged and wraps another object in a list, so the result has
    the same shape on 1 and N processes.
    """
    state = _resolve(state)
    if not state.distributed:
        return obj if isinstance(obj, list) else list(obj) if isinstance(obj, tuple) else [obj]
    everyone: list[Any] = [None] * state.world_size
    dist.all_gather_object(everyone, obj, group=state.group)
    if all(isinstance(part, (list, tuple)) for part in everyone):
        return [item for part in everyone for item in part]
    return everyone


def gather_for_metrics(
    state: ProcessState | None, data: Any, *, use_gather_object: bool = False
) -> Any:
    """`gather`, cut to the real samples of the last round: exactly the dataset over an epoch.

    Call it on per-sample values (first dimension = the batch) of each batch of a
    `ShardedDataLoader`. On the loader's last batch, when the last round is short of a full
    step, the result keeps its first `remainder` rows (the loader's real samples of that round):
    the wrap-around samples `even_batches` added are dropped, and so are rows a value has per
    batch slot rather than per sample (`loss.repeat(batch_size)`), in a world of one too, as
    Accelerate does. So concatenating the results over the epoch gives every sample once, in
    the sampler's order. Scalars (0-dim tensors) pass through whole.

    Tensors are gathered as by `gather`; lists of plain objects (a batch's strings) are
    concatenated across ranks like tensors, through one `all_gather_object`; a lone object
    becomes a list with one entry per rank. `use_gather_object=True` sends all of `data`
    through `gather_object` instead (which concatenates lists).
    """
    state = _resolve(state)
    keep = _real_rows_of_last_round(state)
    if not state.distributed:
        if keep is None:
            return data
        return map_structure(lambda leaf: _first_rows(leaf, keep), data, _is_sample_leaf)
    if use_gather_object:
        gathered = gather_object(state, data)
        return gathered[:keep] if keep is not None and isinstance(data, (list, tuple)) else gathered
    return _gather_samples(state, data, keep)


def _real_rows_of_last_round(state: ProcessState) -> int | None:
    """How many rows gather_for_metrics keeps now: the loader's `remainder` while its last
    batch is processed and that round is short of a full step; None (keep all) otherwise."""
    loader = active_loader()
    if loader is None or not loader.end_of_dataloader:
        return None
    if loader.duplicates < 0 or loader.remainder < 0:
        if state.distributed:
            warnings.warn(
                "gather_for_metrics: the loader cannot tell how many samples of its last batch "
                "are wrap-around duplicates (an IterableDataset without len() read by worker "
                "processes); the last batch is returned whole. Use even_batches=False or "
                "num_workers=0 for exact metrics.",
                stacklevel=3,
            )
        return None
    full = loader.total_batch_size
    if loader.duplicates > 0 or (full is not None and loader.remainder < full):
        return loader.remainder
    return None


def _is_sample_leaf(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or _is_object_leaf(value)


def _first_rows(leaf: Any, keep: int) -> Any:
    if isinstance(leaf, torch.Tensor):
        return leaf[:keep] if leaf.dim() else leaf
    if isinstance(leaf, (list, tuple)) and not hasattr(type(leaf), "_fields"):
        return type(leaf)(leaf[:keep])
    return leaf


@dataclass(frozen=True)
class _ObjectSlot:
    """Where a list of plain objects sat in a structure sent through `gather`."""

    index: int
    per_sample: bool


def _is_object_leaf(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, Mapping)):
        return False
    if isinstance(value, (list, tuple)) and not hasattr(type(value), "_fields"):
        return not any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in value)
    return not isinstance(value, tuple)


def _gather_samples(state: ProcessState, data: Any, keep: int | None) -> Any:
    objects: list[list[Any]] = []

    def lift(value: Any) -> _ObjectSlot:
        per_sample = isinstance(value, (list, tuple))
        objects.append(list(value) if per_sample else [value])
        return _ObjectSlot(len(objects) - 1, per_sample)

    skeleton = map_structure(lift, data, _is_object_leaf)
    gathered = gather(state, skeleton)  # tensors; the slots pass through
    if keep is not None:
        gathered = map_tensors(lambda t: t[:keep], gathered)
    if not objects:
        return gathered
    everyone: list[Any] = [None] * state.world_size
    dist.all_gather_object(everyone, objects, group=state.group)
    if len({len(part) for part in everyone}) != 1:
        raise ValueError(
            "gather_for_metrics: the processes passed different numbers of object lists "
            f"({[len(part) for part in everyone]}); every process must pass the same structure"
        )

    def joined(slot: _ObjectSlot) -> list[Any]:
        items = [item for part in everyone for item in part[slot.index]]
        return items[:keep] if keep is not None and slot.per_sample else items

    return map_leaves(joined, gathered, _ObjectSlot)


def reduce(state: ProcessState | None, data: Any, reduction: str = "sum") -> Any:
    """Every tensor of `data` summed (or averaged) across ranks, elementwise, on every rank.

    Shapes and dtypes must agree across ranks. A `mean` of integers is a float tensor.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduce: reduction={reduction!r} is not one of {_REDUCTIONS}")
    state = _resolve(state)
    if not state.distributed:
        return data
    found = tensor_leaves(data)
    metas = _exchange_meta(state, found)
    _check_alike(metas, "reduce", compare=lambda a, b: a == b)
    for path, tensor in found:
        if tensor.dtype not in _WIRE_DTYPES:
            raise TypeError(
                f"reduce: the tensor at {path} is {tensor.dtype}, which the {state.backend} "
                "backend cannot add; reduce it in a wider dtype, e.g. tensor.float()"
            )
    summed = []
    for _, tensor in found:
        total = tensor.detach().clone()
        dist.all_reduce(total)
        summed.append(total / state.world_size if reduction == "mean" else total)
    return replace_tensors(data, summed)


def pad_across_processes(
    state: ProcessState | None,
    data: Any,
    dim: int = 0,
    pad_index: int | float = 0,
    pad_first: bool = False,
) -> Any:
    """Every tensor of `data` padded with `pad_index` along `dim` to the largest size any rank has.

    Used before `gather` when a dimension other than the first differs (sequence lengths).
    Padding goes after the data, or before it with `pad_first`. A tensor with fewer than
    `dim + 1` dimensions is returned as it is.
    """
    state = _resolve(state)
    if not state.distributed:
        return data
    found = tensor_leaves(data)
    metas = _exchange_meta(state, found)
    _check_alike(metas, "pad_across_processes", compare=lambda a, b: len(a) == len(b))
    padded = []
    for i, (_, tensor) in enumerate(found):
        if not -tensor.ndim <= dim < tensor.ndim:
            padded.append(tensor)
            continue
        axis = dim % tensor.ndim
        most = max(meta[i][1][axis] for meta in metas)
        filler_shape = list(tensor.shape)
        filler_shape[axis] = most - tensor.shape[axis]
        filler = tensor.new_full(filler_shape, pad_index)
        padded.append(torch.cat([filler, tensor] if pad_first else [tensor, filler], dim=axis))
    return replace_tensors(data, padded)


@dataclass(frozen=True)
class _TensorSpec:
    """A tensor's place in a broadcast structure: what the receivers allocate."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def broadcast(state: ProcessState | None, data: Any, from_process: int = 0) -> Any:
    """Rank `from_process`'s `data` on every rank; the other ranks' `data` is ignored.

    Tensors move as tensors (on this rank's device), everything else in the structure is
    pickled, so receivers need not know shapes in advance (they may pass None).
    """
    state = _resolve(state)
    if not state.distributed:
        return data
    source = state.rank == from_process
    box = [map_tensors(lambda t: _TensorSpec(tuple(t.shape), t.dtype), data) if source else None]
    dist.broadcast_object_list(box, src=from_process)
    if not source:
        data = map_leaves(
            lambda spec: torch.empty(spec.shape, dtype=spec.dtype, device=state.device),
            box[0],
            _TensorSpec,
        )
    for _, tensor in tensor_leaves(data):
        # receivers' wire tensors are views of the freshly allocated leaves: filled in place
        dist.broadcast(_rows_to_wire(tensor.detach().reshape(1, *tensor.shape)), from_process)
    return data


def broadcast_object_list(
    state: ProcessState | None, objs: list[Any], from_process: int = 0
) -> list[Any]:
    """`objs` replaced in place, on every rank, by rank `from_process`'s picklable objects."""
    state = _resolve(state)
    if state.distributed:
        dist.broadcast_object_list(objs, src=from_process)
    return objs


# -- helpers -------------------------------------------------------------------------------------


def _resolve(state: ProcessState | None) -> ProcessState:
    return state if state is not None else ProcessState.current()


def _exchange_meta(
    state: ProcessState, found: Sequence[tuple[str, torch.Tensor]]
) -> list[list[_Meta]]:
    mine = [(path, tuple(t.shape), t.dtype) for path, t in found]
    everyone: list[Any] = [None] * state.world_size
    dist.all_gather_object(everyone, mine, group=state.group)
    return everyone


def _check_alike(metas: list[list[_Meta]], op: str, *, compare: Any) -> None:
    """Raise the same error on every rank when the structures cannot be exchanged."""
    reference = metas[0]
    for rank, meta in enumerate(metas[1:], start=1):
        if [m[0] for m in meta] != [m[0] for m in reference]:
            raise ValueError(
                f"{op}: rank {rank} passed tensors at {[m[0] for m in meta]} but rank 0 at "
                f"{[m[0] for m in reference]}; every process must pass the same structure"
            )
        for (path, shape, dtype), (_, shape0, dtype0) in zip(meta, reference, strict=True):
            if dtype != dtype0 or not compare(shape, shape0):
                raise ValueError(
                    f"{op}: the tensor at {path} is {dtype} {shape} on rank {rank} but "
                    f"{dtype0} {shape0} on rank 0; {_SHAPE_RULE[op]}"
                )


_SHAPE_RULE = {
    "gather": "only the first dimension may differ between processes "
    "(pad_across_processes pads the others)",
    "reduce": "shapes and dtypes must be equal on every process",
    "pad_across_processes": "dtypes and the number of dimensions must be equal",
}


def _gather_rows(state: ProcessState, tensor: torch.Tensor, shapes: list[tuple]) -> torch.Tensor:
    rows = tensor.detach().reshape(1) if tensor.ndim == 0 else tensor.detach()
    counts = [shape[0] if shape else 1 for shape in shapes]
    wire = _rows_to_wire(rows)
    if wire.shape[0] < max(counts):
        wire = torch.cat([wire, wire.new_zeros(max(counts) - wire.shape[0], *wire.shape[1:])])
    buffers = [torch.empty_like(wire) for _ in range(state.world_size)]
    dist.all_gather(buffers, wire, group=state.group)
    joined = torch.cat([buffer[:count] for buffer, count in zip(buffers, counts, strict=True)])
    return _rows_from_wire(joined, tensor.dtype, rows.shape[1:])


def _rows_to_wire(rows: torch.Tensor) -> torch.Tensor:
    """`rows` (dim 0 = rows) in a dtype the backend carries; a view where possible."""
    rows = rows.contiguous()
    if rows.dtype in _WIRE_DTYPES:
        return rows
    return rows.reshape(rows.shape[0], math.prod(rows.shape[1:])).view(torch.uint8)


def _rows_from_wire(wire: torch.Tensor, dtype: torch.dtype, row_shape: Sequence[int]):
    if dtype in _WIRE_DTYPES:
        return wire
    return wire.view(dtype).reshape(wire.shape[0], *row_shape)
