"""save_state / load_state: the whole training state, so a run can stop and continue exactly.

A checkpoint folder holds, for a run of N processes:

    manifest.json            written last: every file with its size, N, versions (the
                             folder is complete iff it is there; see checkpoint_folder)
    model/                   model and optimizer tensors through torch.distributed.checkpoint:
                             one file per rank; under FSDP each rank's shards, under DDP or a
                             single process the full tensors (written once)
    model_state.json         the rest of the model and optimizer state dicts (learning rates,
                             betas, parameter names), with references to the tensors in model/
    rank_<r>.json            per rank: RNG states (Python, NumPy, torch, device), LR schedulers,
    rank_<r>.safetensors     the loss scaler, data loader positions, registered objects,
                             step and accumulation step

Nothing in it is a pickle (JSON and safetensors; DCP's own index aside), so loading runs no code
from the file. The folder is written atomically (a staging folder renamed when complete): an
interrupted save leaves the previous checkpoint as it was.

    >>> project = ProjectConfig(project_dir="runs/llama", total_limit=3)
    >>> save_state(model=model, optimizers=[opt], schedulers=[sched], dataloaders=[loader],
    ...            step=step, project=project)          # runs/llama/checkpoints/checkpoint_<n>
    >>> resumed = load_state(model=model, optimizers=[opt], schedulers=[sched],
    ...                      dataloaders=[loader], project=project)   # the latest complete one
    >>> step = resumed.step

The same objects, in the same order, must be given to load_state as to save_state. A plain
DataLoader does not know its position: wrap it in `ResumableLoader`; a `ShardedDataLoader`
(runtime/data.py) keeps its own.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from retarget.runtime.process import ProcessState
from retarget.runtime.state.codec import decode, encode, read_tree, tensor_names, write_tree
from retarget.runtime.state.folder import (
    CheckpointError,
    Manifest,
    begin_save,
    commit_save,
    is_complete,
    verify_folder,
)
from retarget.runtime.state.rng import RngState

_NUMBERED = re.compile(r"checkpoint_(\d+)")


class NotCheckpointableError(CheckpointError, TypeError):
    """An object given to save_state has no state_dict()/load_state_dict() (or no position)."""


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


class CheckpointRegistry:
    """Objects saved and restored with every checkpoint beside the model (Accelerate's
    `register_for_checkpointing`): pass it as `custom_objects`.

        >>> registry = CheckpointRegistry()
        >>> registry.register_for_checkpointing(ema, curriculum)
        >>> save_state(dir, model=model, custom_objects=registry)
    """

    def __init__(self) -> None:
        self._objects: list[Any] = []

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Add objects that have `state_dict()` and `load_state_dict()`; others are refused."""
        _check_stateful(objects, "register_for_checkpointing", start=len(self._objects))
        self._objects.extend(objects)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._objects)

    def __len__(self) -> int:
        return len(self._objects)


def _check_stateful(objects: Iterable[Any], what: str, *, start: int = 0) -> list[Any]:
    objects = list(objects)
    for i, obj in enumerate(objects, start):
        missing = [
            m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))
        ]
        if missing:
            hint = (
                "wrap it: ResumableLoader(loader), or shard_dataloader(loader)"
                if isinstance(obj, torch.utils.data.DataLoader)
                else "give it both methods, or save it yourself"
            )
            raise NotCheckpointableError(
                f"{what}[{i}] (a {type(obj).__name__}) cannot be checkpointed: it has no "
                f"{' or '.join(m + '()' for m in missing)}; {hint}"
            )
    return objects


def _as_list(value: Any) -> list[Any]:
    # Only lists, tuples and registries are "several": loaders themselves are iterable.
    if value is None:
        return []
    if isinstance(value, (list, tuple, CheckpointRegistry)):
        return list(value)
    return [value]


@dataclass
class _Parts:
    """The objects of one save_state / load_state call, validated and grouped."""

    models: list[nn.Module]
    optimizers: list[list[torch.optim.Optimizer]]  # per model, in the order given
    schedulers: list[Any]
    scaler: Any
    dataloaders: list[Any]
    custom: list[Any]

    @classmethod
    def build(cls, model, optimizers, schedulers, scaler, dataloaders, custom) -> _Parts:
        models = _as_list(model)
        if not models or not all(isinstance(m, nn.Module) for m in models):
            raise TypeError("model must be an nn.Module or a sequence of them")
        if scaler is not None:
            _check_stateful([scaler], "scaler")
        return cls(
            models=models,
            optimizers=_group_optimizers(models, _as_list(optimizers)),
            schedulers=_check_stateful(_as_list(schedulers), "schedulers"),
            scaler=scaler,
            dataloaders=_check_stateful(_as_list(dataloaders), "dataloaders"),
            custom=_check_stateful(_as_list(custom), "custom_objects"),
        )

    def contents(self) -> dict[str, Any]:
        return {
            "models": len(self.models),
            "optimizers": [len(group) for group in self.optimizers],
            "schedulers": len(self.schedulers),
            "scaler": self.scaler is not None,
            "dataloaders": len(self.dataloaders),
            "custom_objects": len(self.custom),
        }


def _group_optimizers(models: list[nn.Module], optimizers: list[Any]) -> list[list[Any]]:
    """Each optimizer under the model whose parameters it updates."""
    owners = [{id(p) for p in m.parameters()} for m in models]
    groups: list[list[Any]] = [[] for _ in models]
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizers[{i}] is a {type(opt).__name__}, not a torch Optimizer")
        params = {id(p) for group in opt.param_groups for p in group["params"]}
        homes = [k for k, owned in enumerate(owners) if params <= owned]
        if not homes:
            raise ValueError(
                f"optimizers[{i}] updates parameters that are not all in one of the models "
                "given: pass the model it optimizes (build it on that model's parameters)"
            )
        groups[homes[0]].append(opt)
    return groups


def _model_trees(parts: _Parts, fresh: list[list[bool]]) -> list[dict[str, Any]]:
    """Per model: its state dict and its stepped optimizers' (keyed by parameter names).

    An optimizer that has not stepped yet has no state to save, and is left out: torch's
    get_state_dict would fill it with a zero-lr step (running the optimizer's step hooks).
    """
    trees = []
    for model, group, flags in zip(parts.models, parts.optimizers, fresh, strict=True):
        stepped = [opt for opt, was_fresh in zip(group, flags, strict=True) if not was_fresh]
        if stepped:
            model_sd, optim_sd = get_state_dict(model, stepped)
            trees.append({"model": model_sd, "optim": optim_sd})
        else:
            trees.append({"model": get_model_state_dict(model)})
    return trees


def _fresh_optimizers(parts: _Parts) -> list[list[bool]]:
    """Per model, per optimizer: it has not stepped yet (its state is empty)."""
    return [[not opt.state for opt in group] for group in parts.optimizers]


def _rank_tree(parts: _Parts, rng: RngState, step: int, accumulation_step: int) -> dict:
    return {
        "rng": rng.to_tree(),
        "schedulers": [s.state_dict() for s in parts.schedulers],
        "scaler": None if parts.scaler is None else parts.scaler.state_dict(),
        "dataloaders": [d.state_dict() for d in parts.dataloaders],
        "custom_objects": [c.state_dict() for c in parts.custom],
        "step": step,
        "accumulation_step": accumulation_step,
    }


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


def _load_dir(input_dir: str | Path | None, project: ProjectConfig | None) -> Path:
    if input_dir is not None:
        return Path(input_dir)
    if project is None or not project.automatic_checkpoint_naming:
        raise ValueError("load_state needs input_dir, or a ProjectConfig with automatic naming")
    existing = numbered_checkpoints(project)
    if not existing:
        raise CheckpointError(f"no complete checkpoint under {project.checkpoints_dir}")
    return existing[-1]


def _prune(project: ProjectConfig | None, state: ProcessState) -> None:
    if project is None or project.total_limit is None or not project.automatic_checkpoint_naming:
        return
    if state.is_main_process:
        for old in numbered_checkpoints(project)[: -project.total_limit]:
            shutil.rmtree(old)
    state.wait_for_everyone()


# ------------------------------------------------------------------------------ save / load


@contextlib.contextmanager
def _dcp_context(state: ProcessState) -> Iterator[None]:
    # DCP warns that it assumes a single process even when told so (no_dist=True).
    with warnings.catch_warnings():
        if not state.distributed:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


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
) -> Path:
    """Save everything needed to continue training exactly; returns the checkpoint folder.

    Call it on every rank. Schedulers, the scaler (LossScaler or GradScaler), data loaders and
    custom objects need `state_dict()`/`load_state_dict()` returning plain data and tensors.
    With `project` (automatic naming) the folder is the next `checkpoint_<n>`, and checkpoints
    beyond `total_limit` are removed, oldest first, once the new one is complete.
    """
    state = ProcessState.current()
    rng = RngState.capture()  # first: nothing below may have drawn from a generator yet
    parts = _Parts.build(model, optimizers, schedulers, scaler, dataloaders, custom_objects)
    final = _save_dir(output_dir, project, state)
    staging = begin_save(final, state)
    try:
        _write_state(staging, final, parts, rng, step, accumulation_step, state)
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
    parts: _Parts,
    rng: RngState,
    step: int,
    accumulation_step: int,
    state: ProcessState,
) -> None:
    fresh = _fresh_optimizers(parts)
    trees = _model_trees(parts, fresh)
    skeleton, tensors = encode({"models": trees}, where="model/optimizer state")
    sharded = any(isinstance(t, DTensor) for t in tensors.values())
    with _dcp_context(state):
        dcp.save(tensors, checkpoint_id=staging / "model", no_dist=not state.distributed)
    if state.is_main_process:
        with open(staging / "model_state.json", "w") as f:
            json.dump({"skeleton": skeleton, "fresh_optimizers": fresh}, f)
    write_tree(
        staging / f"rank_{state.rank}",
        _rank_tree(parts, rng, step, accumulation_step),
        where=f"rank {state.rank} state",
    )
    contents = parts.contents() | {"step": step, "accumulation_step": accumulation_step}
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
) -> ResumePoint:
    """Restore what save_state saved into the same kinds of objects, in the same order.

    Without `input_dir`, the project's latest complete checkpoint. The folder is checked first
    (complete, written by retarget, by as many processes as this run has); every generator's
    state is restored last, so the next random draw is the one the saved run made next.
    """
    state = ProcessState.current()
    parts = _Parts.build(model, optimizers, schedulers, scaler, dataloaders, custom_objects)
    folder = _load_dir(input_dir, project)
    manifest = verify_folder(folder, world_size=state.world_size)
    _check_contents(folder, manifest.contents, parts.contents())

    _load_models(folder, parts, state)
    rank = _load_rank_state(folder / f"rank_{state.rank}", parts)
    return ResumePoint(path=folder, step=rank["step"], accumulation_step=rank["accumulation_step"])


def _load_models(folder: Path, parts: _Parts, state: ProcessState) -> None:
    """Model and optimizer state through DCP, into templates built from the live objects."""
    saved = json.loads((folder / "model_state.json").read_text())
    fresh = saved["fresh_optimizers"]
    _, tensors = encode({"models": _model_trees(parts, fresh)}, where="model/optimizer state")
    _check_tensor_names(folder, tensor_names(saved["skeleton"]), set(tensors))
    with _dcp_context(state):
        dcp.load(tensors, checkpoint_id=folder / "model", no_dist=not state.distributed)
    trees = decode(saved["skeleton"], tensors)["models"]
    for model, group, flags, tree in zip(parts.models, parts.optimizers, fresh, trees, strict=True):
        stepped = [opt for opt, was_fresh in zip(group, flags, strict=True) if not was_fresh]
        if stepped:
            set_state_dict(
                model, stepped, model_state_dict=tree["model"], optim_state_dict=tree["optim"]
            )
        else:
            set_model_state_dict(model, tree["model"])
        for opt in group:
            if all(opt is not other for other in stepped):
                opt.state.clear()  # it had not stepped when saved


def _load_rank_state(stem: Path, parts: _Parts) -> dict[str, Any]:
    """This rank's schedulers, scaler, loaders, registered objects and, last, RNG states."""
    rank = read_tree(stem)
    for obj, obj_state in zip(parts.schedulers, rank["schedulers"], strict=True):
        obj.load_state_dict(obj_state)
    if parts.scaler is not None:
        parts.scaler.load_state_dict(rank["scaler"])
    for obj, obj_state in zip(parts.dataloaders, rank["dataloaders"], strict=True):
        obj.load_state_dict(obj_state)
    for obj, obj_state in zip(parts.custom, rank["custom_objects"], strict=True):
        obj.load_state_dict(obj_state)
    RngState.from_tree(rank["rng"]).restore()
    return rank


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
