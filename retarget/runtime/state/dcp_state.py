"""The model and optimizer part of a checkpoint: tensors through torch.distributed.checkpoint.

`model/` holds the tensors, one file per rank (under FSDP each rank's shards, under DDP or a
single process the full tensors, written once; a tensor tp split in strides, its fused q|k|v
parts, whole, since DCP's planner cannot place strided pieces; a tensor tp stores in rank order,
fused parts of unequal widths, and its optimizer state, whole in the model's order, as one
process holds them: execution/tp_row_order); `model_state.json` the rest of
the model and optimizer state dicts (learning rates, betas, parameter names) with references to
the tensors. Loading fills templates built from the live objects, so the model must be built as
it was saved.

Under pp every rank holds the whole model but trains only its stage: each rank writes its
stage's tensors (`PipelineRun.held_keys`; the optimizer has state for those only), and
`model_state.json` keeps one skeleton per rank (`rank_skeletons`), since each rank's tree
names other tensors. Loading fills each rank's stage (the other weights are not this rank's);
such a checkpoint loads on the same number of ranks only.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from retarget.execution.apply_plan import applied_of
from retarget.execution.process import ProcessState
from retarget.execution.tp_row_order import (
    optimizer_state_in_model_order,
    optimizer_state_in_stored_order,
)
from retarget.runtime.state.checkpoint_objects import CheckpointObjects
from retarget.runtime.state.codec import decode, encode, tensor_names
from retarget.runtime.state.folder import CheckpointError


def save_model_state(folder: Path, objects: CheckpointObjects, state: ProcessState) -> bool:
    """Write `model/` (every rank) and `model_state.json` (rank 0); whether tensors are sharded."""
    fresh = _fresh_optimizers(objects)
    trees = _model_trees(objects, fresh)
    skeleton, tensors = encode({"models": trees}, where="model/optimizer state")
    sharded = any(isinstance(t, DTensor) for t in tensors.values())
    tensors = {k: v.full_tensor() if _strided(v) else v for k, v in tensors.items()}
    with _dcp_context(state):
        dcp.save(tensors, checkpoint_id=folder / "model", no_dist=not state.distributed)
    written: dict[str, Any] = {"skeleton": skeleton, "fresh_optimizers": fresh}
    if any(_stage_keys(model) is not None for model in objects.models):
        everyone = [None] * state.world_size
        dist.all_gather_object(everyone, skeleton)
        written["rank_skeletons"] = everyone
        sharded = True
    if state.is_main_process:
        with open(folder / "model_state.json", "w") as f:
            json.dump(written, f)
    return sharded


def _stage_keys(model: torch.nn.Module) -> set[str] | None:
    """Under pp, the state dict keys this rank's stage owns; else None (every key)."""
    applied = applied_of(model)
    if applied is None or applied.pipeline is None:
        return None
    return applied.pipeline.held_keys(model)


def _own_part(model: torch.nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    keys = _stage_keys(model)
    if keys is None:
        return state_dict
    return {k: v for k, v in state_dict.items() if k in keys}


def _own_state(model: torch.nn.Module, optim_state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with the state of this rank's stage's parameters only (a fresh
    optimizer given to torch's get_state_dict is filled for every parameter)."""
    return {**optim_state_dict, "state": _own_part(model, optim_state_dict["state"])}


def load_model_state(folder: Path, objects: CheckpointObjects, state: ProcessState) -> None:
    """Model and optimizer state through DCP, into templates built from the live objects."""
    saved = json.loads((folder / "model_state.json").read_text())
    fresh = saved["fresh_optimizers"]
    skeleton = saved["skeleton"]
    if "rank_skeletons" in saved:
        if len(saved["rank_skeletons"]) != state.world_size:
            raise CheckpointError(
                f"{folder} was saved by {len(saved['rank_skeletons'])} pipeline stages and this "
                f"run has {state.world_size} ranks: a pp checkpoint loads on as many ranks (and "
                "the same pp[size]) as saved it"
            )
        skeleton = saved["rank_skeletons"][state.rank]
    _, tensors = encode({"models": _model_trees(objects, fresh)}, where="model/optimizer state")
    _check_tensor_names(folder, tensor_names(skeleton), set(tensors))
    _check_tensor_shapes(folder, tensors)
    strided = {k: v for k, v in tensors.items() if _strided(v)}
    tensors.update({k: torch.empty(v.shape, dtype=v.dtype) for k, v in strided.items()})
    with _dcp_context(state):
        dcp.load(tensors, checkpoint_id=folder / "model", no_dist=not state.distributed)
    for key, live in strided.items():
        whole = tensors[key].to(live.device)
        tensors[key] = distribute_tensor(
            whole, live.device_mesh, live.placements, src_data_rank=None
        )
    trees = decode(skeleton, tensors)["models"]
    for model, tree in zip(objects.models, trees, strict=True):
        if "optim" in tree:
            optimizer_state_in_stored_order(model, tree["optim"])
    groups = zip(objects.models, objects.optimizers, fresh, trees, strict=True)
    for model, group, flags, tree in groups:
        stepped = [opt for opt, was_fresh in zip(group, flags, strict=True) if not was_fresh]
        # A pp stage loads its own part only (module docstring).
        options = StateDictOptions(strict=_stage_keys(model) is None)
        if stepped:
            set_state_dict(
                model,
                stepped,
                model_state_dict=tree["model"],
                optim_state_dict=tree["optim"],
                options=options,
            )
        else:
            set_model_state_dict(model, tree["model"], options=options)
        stateless = [opt for opt, was_fresh in zip(group, flags, strict=True) if was_fresh]
        # `groups` is missing in a checkpoint written before hyperparameters were saved
        saved_groups = tree.get("groups") or [None] * len(stateless)
        for opt, hyper in zip(stateless, saved_groups, strict=True):
            opt.state.clear()  # it had no state when saved
            if hyper is not None:
                _restore_hyperparameters(folder, opt, hyper)


def _model_trees(objects: CheckpointObjects, fresh: list[list[bool]]) -> list[dict[str, Any]]:
    """Per model: its state dict, its stateful optimizers' (keyed by parameter names), and the
    hyperparameters of the others (`"groups"`).

    An optimizer with no state (one that has not stepped yet, or plain SGD, which keeps none)
    is not given to torch's get_state_dict, which would fill it with a zero-lr step (running
    the optimizer's step hooks). Its param groups' hyperparameters are saved all the same: an
    LR scheduler changes `lr` there, and resuming without it would train at the initial rate.
    """
    trees = []
    for model, group, flags in zip(objects.models, objects.optimizers, fresh, strict=True):
        stepped = [opt for opt, was_fresh in zip(group, flags, strict=True) if not was_fresh]
        if stepped:
            model_sd, optim_sd = get_state_dict(model, stepped)
            optimizer_state_in_model_order(model, optim_sd)
            tree = {"model": _own_part(model, model_sd), "optim": _own_state(model, optim_sd)}
        else:
            tree = {"model": _own_part(model, get_model_state_dict(model))}
        stateless = [opt for opt, was_fresh in zip(group, flags, strict=True) if was_fresh]
        tree["groups"] = [_hyperparameters(opt) for opt in stateless]
        trees.append(tree)
    return trees


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings, with `params` as the number of parameters in the group."""
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": len(group["params"])}
        for group in optimizer.param_groups
    ]


def _restore_hyperparameters(
    folder: Path, optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]
) -> None:
    live = [len(group["params"]) for group in optimizer.param_groups]
    if live != [group["params"] for group in saved]:
        raise CheckpointError(
            f"{folder}: an optimizer's param groups hold {live} parameters here and "
            f"{[group['params'] for group in saved]} in the checkpoint: build the same "
            "optimizers as the saved run"
        )
    for group, hyper in zip(optimizer.param_groups, saved, strict=True):
        group.update({k: v for k, v in hyper.items() if k != "params"})


def _strided(tensor: Any) -> bool:
    """A DTensor split in strides (tp's fused q|k|v parts): DCP's planner reads its pieces as
    contiguous chunks that overlap, so it is saved whole and split again after loading."""
    return isinstance(tensor, DTensor) and any(
        isinstance(p, _StridedShard) for p in tensor.placements
    )


def _fresh_optimizers(objects: CheckpointObjects) -> list[list[bool]]:
    """Per model, per optimizer: it has not stepped yet (its state is empty)."""
    return [[not opt.state for opt in group] for group in objects.optimizers]


@contextlib.contextmanager
def _dcp_context(state: ProcessState) -> Iterator[None]:
    # DCP warns that it assumes a single process even when told so (no_dist=True).
    with warnings.catch_warnings():
        if not state.distributed:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _check_tensor_names(folder: Path, saved: set[str], expected: set[str]) -> None:
    if saved == expected:
        return
    missing, extra = sorted(expected - saved), sorted(saved - expected)
    lines = []
    if missing:
        lines.append(f"not in the checkpoint: {', '.join(missing[:5])}")
    if extra:
        lines.append(f"in the checkpoint but not in this model: {', '.join(extra[:5])}")
    raise CheckpointError(
        f"{folder}: the model/optimizer state does not match ({'; '.join(lines)}): build the "
        "same model and optimizers as the saved run"
    )


def _check_tensor_shapes(folder: Path, tensors: dict[str, Any]) -> None:
    """Refuse, naming the tensors, a checkpoint whose tensors have other (global) shapes than
    this model's: DCP would stop deep inside its load planner on the first one."""
    stored = dcp.FileSystemReader(folder / "model").read_metadata().state_dict_metadata
    differ = [
        f"{name} saved {list(stored[name].size)}, here {list(tensor.shape)}"
        for name, tensor in sorted(tensors.items())
        if hasattr(stored.get(name), "size") and tuple(stored[name].size) != tuple(tensor.shape)
    ]
    if differ:
        more = f" and {len(differ) - 5} more" if len(differ) > 5 else ""
        raise CheckpointError(
            f"{folder}: the model/optimizer state has other shapes ({'; '.join(differ[:5])}"
            f"{more}): build the same model, with the same config, as the saved run"
        )
