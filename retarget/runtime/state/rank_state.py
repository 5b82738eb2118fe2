"""The per-rank part of a checkpoint: `rank_<r>.json` + `rank_<r>.safetensors`.

RNG states (Python, NumPy, torch, device), LR schedulers, the loss scaler, data loader
positions, registered objects, step and accumulation step: what each rank holds for itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from retarget.runtime.state.checkpoint_objects import CheckpointObjects
from retarget.runtime.state.codec import read_tree, write_tree
from retarget.runtime.state.rng import RngState


def save_rank_state(
    folder: Path,
    objects: CheckpointObjects,
    rng: RngState,
    *,
    rank: int,
    step: int,
    accumulation_step: int,
) -> None:
    """Write rank `rank`'s state, with `rng` captured before anything drew from a generator."""
    tree = {
        "rng": rng.to_tree(),
        "schedulers": [s.state_dict() for s in objects.schedulers],
        "scaler": None if objects.scaler is None else objects.scaler.state_dict(),
        "dataloaders": [d.state_dict() for d in objects.dataloaders],
        "custom_objects": [c.state_dict() for c in objects.custom],
        "step": step,
        "accumulation_step": accumulation_step,
    }
    write_tree(folder / f"rank_{rank}", tree, where=f"rank {rank} state")


def load_rank_state(
    folder: Path, objects: CheckpointObjects, *, rank: int, per_rank: bool = True
) -> dict[str, Any]:
    """Rank `rank`'s schedulers, scaler, loaders, registered objects and, last, RNG states.

    With `per_rank=False` (a checkpoint of another world size) what every rank holds alike
    (schedulers, scaler, registered objects, step) comes from rank 0's file, and the loaders'
    positions and the RNG states, which belong to the saved run's ranks, are left as they are.
    """
    saved = read_tree(folder / f"rank_{rank if per_rank else 0}")
    for obj, obj_state in zip(objects.schedulers, saved["schedulers"], strict=True):
        obj.load_state_dict(obj_state)
    if objects.scaler is not None:
        objects.scaler.load_state_dict(saved["scaler"])
    if per_rank:
        for obj, obj_state in zip(objects.dataloaders, saved["dataloaders"], strict=True):
            obj.load_state_dict(obj_state)
    for obj, obj_state in zip(objects.custom, saved["custom_objects"], strict=True):
        obj.load_state_dict(obj_state)
    if per_rank:
        RngState.from_tree(saved["rng"]).restore()
    return saved
