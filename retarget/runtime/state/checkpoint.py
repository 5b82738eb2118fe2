"""save_state / load_state: the whole training state, so a run can stop and continue exactly.

A checkpoint folder holds, for a run of N processes:

    manifest.json            written last: every file with its size, N, versions (the
                             folder is complete iff it is there; see folder.py)
    model/                   model and optimizer tensors through torch.distributed.checkpoint:
                             one file per rank; under FSDP each rank's shards, under DDP or a
                             single process the full tensors (written once; dcp_state.py)
    model_state.json         the rest of the model and optimizer state dicts (learning rates,
                             betas, parameter names), with references to the tensors in model/
    rank_<r>.json            per rank: RNG states (Python, NumPy, torch, device), LR schedulers,
    rank_<r>.safetensors     the loss scaler, data loader positions, registered objects,
                             step and accumulation step (rank_state.py)

Nothing in it is a pickle (JSON and safetensors; DCP's own index aside), so loading runs no code
from the file. The folder is written atomically (a staging folder renamed when complete): an
interrupted save leaves the previous checkpoint as it was.

    >>> project = ProjectConfig(project_dir="runs/llama", total_limit=3)
    >>> save_state(model=model, optimizers=[opt], schedulers=[sched], dataloaders=[loader],
    ...            step=step, project=project)          # runs/llama/checkpoints/checkpoint_<n>
    >>> resumed = load_state(model=model, optimizers=[opt], schedulers=[sched],
    ...                      dataloaders=[loader], project=project)   # the latest complete one
    >>> step = resumed.step

The same objects, in the same order, must be given to load_state as to save_state
(checkpoint_objects.py checks and groups them). A plain
DataLoader does not know its position: wrap it in `ResumableLoader`; a `ShardedDataLoader`
(runtime/data/sharded_loader.py) keeps its own.
"""

from __future__ import annotations

import re
import shutil
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from retarget.execution import xla_device as xla
from retarget.execution.process import ProcessState
from retarget.runtime.state.checkpoint_objects import (
    CheckpointObjects,
    CheckpointRegistry,
    NotCheckpointableError,
)
from retarget.runtime.state.folder import (
    CheckpointError,
    DamagedCheckpointError,
    Manifest,
    begin_save,
    commit_save,
    is_complete,
    verify_folder,
)
from retarget.runtime.state.rank_state import load_rank_state, save_rank_state
from retarget.runtime.state.rng import RngState

# The checkpointing API: the registry and its error are given to, and raised by, save_state.
__all__ = [
    "CheckpointRegistry",
    "NotCheckpointableError",
    "ProjectConfig",
    "ResumePoint",
    "load_state",
    "numbered_checkpoints",
    "save_state",
]

_NUMBERED = re.compile(r"checkpoint_(\d+)")


@dataclass(frozen=True, kw_only=True)
class ProjectConfig:
    """Where numbered checkpoints go, as Accelerate's ProjectConfiguration."""

    project_dir: str | Path
    """Checkpoints are `<project_dir>/checkpoints/checkpoint_<n>`."""
    automatic_checkpoint_naming: bool = True
    """Number checkpoints (0, 1, ...) instead of taking a folder from each call."""
    total_limit: int | None = None
    """Keep at most this many numbered checkpoints; the oldest go once a new one is complete."""

    def __post_init__(self) -> None:
        if self.total_limit is not None and self.total_limit < 1:
            raise ValueError(f"total_limit={self.total_limit}: keep at least 1 checkpoint")

    @property
    def checkpoints_dir(self) -> Path:
        return Path(self.project_dir) / "checkpoints"


@dataclass(frozen=True, kw_only=True)
class ResumePoint:
    """What load_state restored beyond the objects it was given."""

    path: Path
    """The checkpoint folder that was loaded."""
    step: int
    """The `step` given to save_state (e.g. optimizer steps taken)."""
    accumulation_step: int
    """Micro-batches already accumulated towards the next optimizer step."""


# ------------------------------------------------------------------------------ folders


def numbered_checkpoints(project: ProjectConfig) -> list[Path]:
    """The complete numbered checkpoints of a project, oldest first."""
    root = project.checkpoints_dir
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NUMBERED.fullmatch(p.name))]
    return [p for _, p in sorted(found) if is_complete(p)]


def _save_dir(output_dir: str | Path | None, project: ProjectConfig | None, state) -> Path:
    if project is not None and project.automatic_checkpoint_naming:
        if output_dir is not None:
            raise ValueError(
                f"output_dir={str(output_dir)!r} and automatic checkpoint naming both choose the "
                "folder: pass one of them"
            )
        existing = numbered_checkpoints(project)
        index = int(_NUMBERED.fullmatch(existing[-1].name).group(1)) + 1 if existing else 0
        path = [str(project.checkpoints_dir / f"checkpoint_{index}")]
        if state.distributed:  # every rank must write into the folder rank 0 chose
            dist.broadcast_object_list(path, src=0)
        return Path(path[0])
    if output_dir is None:
        raise ValueError("save_state needs output_dir, or a ProjectConfig with automatic naming")
    return Path(output_dir)


def _load_dirs(input_dir: str | Path | None, project: ProjectConfig | None) -> list[Path]:
    """The folders to try, in order: the one given, else the project's newest first."""
    if input_dir is not None:
        return [Path(input_dir)]
    if project is None or not project.automatic_checkpoint_naming:
        raise ValueError("load_state needs input_dir, or a ProjectConfig with automatic naming")
    existing = numbered_checkpoints(project)
    if not existing:
        raise CheckpointError(f"no complete checkpoint under {project.checkpoints_dir}")
    return existing[::-1]


def _verified(folders: list[Path], world_size: int | None) -> tuple[Path, Manifest]:
    """The first folder that verifies; a damaged one is skipped with a warning when an older
    one remains (every rank reads the same files, so every rank skips the same ones)."""
    for index, folder in enumerate(folders):
        try:
            return folder, verify_folder(folder, world_size=world_size)
        except DamagedCheckpointError as error:
            if index == len(folders) - 1:
                raise
            warnings.warn(
                f"{error} Skipping it: resuming from the previous checkpoint, {folders[index + 1]}",
                stacklevel=3,
            )
    raise AssertionError("unreachable: folders is never empty")


def _prune(project: ProjectConfig | None, state: ProcessState) -> None:
    if project is None or project.total_limit is None or not project.automatic_checkpoint_naming:
        return
    if state.is_main_process:
        for old in numbered_checkpoints(project)[: -project.total_limit]:
            shutil.rmtree(old)
    state.wait_for_everyone()


# ------------------------------------------------------------------------------ save / load


def save_state(
    output_dir: str | Path | None = None,
    *,
    model: nn.Module | Sequence[nn.Module],
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    schedulers: Any = (),
    scaler: Any = None,
    dataloaders: Any = (),
    custom_objects: Iterable[Any] = (),
    step: int = 0,
    accumulation_step: int = 0,
    project: ProjectConfig | None = None,
    overwrite: bool = False,
) -> Path:
    """Save everything needed to continue training exactly; returns the checkpoint folder.

    Call it on every rank. Schedulers, the scaler (LossScaler or GradScaler), data loaders and
    custom objects need `state_dict()`/`load_state_dict()` returning plain data and tensors.
    With `project` (automatic naming) the folder is the next `checkpoint_<n>`, and checkpoints
    beyond `total_limit` are removed, oldest first, once the new one is complete. The folder
    may be new, empty or an earlier checkpoint; one holding other files is refused (naming
    them) unless `overwrite=True`, which writes the checkpoint beside them.
    """
    state = ProcessState.current()
    rng = RngState.capture()  # first: nothing below may have drawn from a generator yet
    objects = CheckpointObjects.build(
        model, optimizers, schedulers, scaler, dataloaders, custom_objects
    )
    xla.settle(objects.models)  # under xla: one sync, not a graph per tensor read out
    final = _save_dir(output_dir, project, state)
    staging = begin_save(final, state, overwrite=overwrite)
    try:
        _write_state(staging, final, objects, rng, step, accumulation_step, state)
    except BaseException:
        # An error (not a kill) in a world of one: leave nothing behind. With peers, the
        # staging folder stays until the next save; it is never loaded either way.
        if not state.distributed:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    _prune(project, state)
    return final


def _write_state(
    staging: Path,
    final: Path,
    objects: CheckpointObjects,
    rng: RngState,
    step: int,
    accumulation_step: int,
    state: ProcessState,
) -> None:
    from retarget.runtime.state.dcp_state import save_model_state  # DCP: 0.7 s to import

    sharded = save_model_state(staging, objects, state)
    save_rank_state(
        staging, objects, rng, rank=state.rank, step=step, accumulation_step=accumulation_step
    )
    contents = objects.contents() | {"step": step, "accumulation_step": accumulation_step}
    manifest = Manifest(world_size=state.world_size, sharded=sharded, contents=contents)
    commit_save(final, manifest, state)


def load_state(
    input_dir: str | Path | None = None,
    *,
    model: nn.Module | Sequence[nn.Module],
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    schedulers: Any = (),
    scaler: Any = None,
    dataloaders: Any = (),
    custom_objects: Iterable[Any] = (),
    project: ProjectConfig | None = None,
    reshard: bool = False,
) -> ResumePoint:
    """Restore what save_state saved into the same kinds of objects, in the same order.

    Without `input_dir`, the project's latest complete checkpoint; a damaged one (a file
    missing, resized or altered since the save) is skipped with a warning for the one before.
    The folder is checked first (complete, intact, written by retarget, by as many processes
    as this run has); every generator's state is restored last, so the next random draw is the
    one the saved run made next.

    `reshard=True` loads a checkpoint of another number of processes: DCP reshards the model
    and optimizer state onto this run's (FSDP shards or full tensors alike), schedulers, scaler
    and registered objects come from rank 0, and the RNG states and data loader positions,
    which belonged to the saved run's ranks, start afresh (warned).
    """
    state = ProcessState.current()
    objects = CheckpointObjects.build(
        model, optimizers, schedulers, scaler, dataloaders, custom_objects
    )
    world_size = None if reshard else state.world_size
    folder, manifest = _verified(_load_dirs(input_dir, project), world_size)
    _check_contents(folder, manifest.contents, objects.contents())
    per_rank = manifest.world_size == state.world_size
    if not per_rank:
        warnings.warn(
            f"{folder} was saved by {manifest.world_size} processes and this run has "
            f"{state.world_size}: the model and optimizer are resharded, RNG states and data "
            "loader positions start afresh",
            stacklevel=2,
        )

    from retarget.runtime.state.dcp_state import load_model_state  # DCP: 0.7 s to import

    load_model_state(folder, objects, state)
    saved = load_rank_state(folder, objects, rank=state.rank, per_rank=per_rank)
    return ResumePoint(
        path=folder, step=saved["step"], accumulation_step=saved["accumulation_step"]
    )


def resume_from_latest(project: ProjectConfig | str | Path, **objects: Any) -> ResumePoint | None:
    """After a restart: load the project's newest intact checkpoint into `objects` (the
    keyword arguments of load_state), or return None when there is none yet (a fresh start).

        >>> point = resume_from_latest("runs/llama", model=model, optimizers=[opt])
        >>> start = point.step if point else 0
    """
    if not isinstance(project, ProjectConfig):
        project = ProjectConfig(project_dir=project)
    if not numbered_checkpoints(project):
        return None
    return load_state(project=project, **objects)


def _check_contents(folder: Path, saved: dict[str, Any], given: dict[str, Any]) -> None:
    differ = [
        f"{key}: saved {saved.get(key)!r}, given {value!r}"
        for key, value in given.items()
        if saved.get(key) != value
    ]
    if differ:
        raise CheckpointError(
            f"{folder} holds other objects than load_state was given ({'; '.join(differ)}): "
            "pass the same models, optimizers, schedulers, scaler, data loaders and custom "
            "objects, in the same order, as to save_state"
        )
