"""The objects one save_state / load_state call checkpoints, checked and grouped.

Models, their optimizers (each under the model whose parameters it updates), and the objects
saved beside them: schedulers, the loss scaler, data loaders and registered objects, each of
which must have `state_dict()` and `load_state_dict()`.

    >>> objects = CheckpointObjects.build(model, [opt], [sched], None, [loader], registry)
    >>> objects.contents()   # what the manifest records, and load_state compares
    {'models': 1, 'optimizers': [1], 'schedulers': 1, 'scaler': False, ...}
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from retarget.runtime.state.folder import CheckpointError


class NotCheckpointableError(CheckpointError, TypeError):
    """An object given to save_state has no state_dict()/load_state_dict() (or no position)."""


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
class CheckpointObjects:
    """The objects of one save_state / load_state call, validated and grouped."""

    models: list[nn.Module]
    optimizers: list[list[torch.optim.Optimizer]]  # per model, in the order given
    schedulers: list[Any]
    scaler: Any
    dataloaders: list[Any]
    custom: list[Any]

    @classmethod
    def build(cls, model, optimizers, schedulers, scaler, dataloaders, custom) -> CheckpointObjects:
        """Check and group save_state's arguments: TypeError / NotCheckpointableError on misuse."""
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
        """How many objects of each kind: recorded by save_state, compared by load_state."""
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
