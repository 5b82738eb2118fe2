"""The Accelerator's arguments beyond the target: read, or refused with the reason.

Accelerate takes many constructor arguments; each one here is mapped (gradient accumulation,
data sharding, the project folders; dynamo arguments in dynamo.py), or refused when it
asks for something retarget does not do.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from retarget.compat.accelerate.data_order import AccelerateDraws
from retarget.compat.accelerate.kwargs_base import KwargsHandlerError
from retarget.core.world import ACCUMULATION_ENV
from retarget.runtime.state.checkpoint import ProjectConfig
from retarget.targets.grammar import Target
from retarget.targets.strategies import FSDP_STRATEGIES

__all__ = ["DistributedType", "ProjectConfiguration"]


class DistributedType(str, enum.Enum):
    """Accelerate's names for how training is distributed (`accelerator.distributed_type`)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"
    XLA = "XLA"
    TP = "TP"


def distributed_type(target: Target, world_size: int, device: torch.device) -> DistributedType:
    """Accelerate's name for the target's distribution (NO in a world of one, but XLA: one
    process drives every XLA device, as under Accelerate)."""
    strategy = target.strategy
    if strategy == "xla":
        return DistributedType.XLA
    if world_size == 1:
        return DistributedType.NO
    if strategy in FSDP_STRATEGIES:
        return DistributedType.FSDP
    if strategy == "single":
        return DistributedType.TP if "tp" in target else DistributedType.NO
    return DistributedType.MULTI_GPU if device.type == "cuda" else DistributedType.MULTI_CPU


#: Accelerate arguments with no counterpart: (accepted when, why others are refused).
_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "device_placement": (
        lambda v: v is True,
        "the runtime places the model and every batch on the process's device",
    ),
    "rng_types": (
        lambda v: v is None or list(v) == ["generator"],
        "prepared loaders draw as with Accelerate's default, rng_types=['generator'] (the "
        "sampler's generator kept in sync); torch's global RNG is left to the script",
    ),
    "megatron_lm_plugin": (lambda v: v is None, "Megatron-LM is not supported"),
    "deepspeed_plugins": (lambda v: v is None, "pass one deepspeed_plugin"),
    "gradient_accumulation_plugin": (
        lambda v: v is None,
        "pass gradient_accumulation_steps=; accumulation always ends at the end of a dataloader",
    ),
}


def refuse_unsupported(**arguments: Any) -> None:
    """Raise for an argument Accelerate takes and retarget cannot honour (or does not know)."""
    for name, value in arguments.items():
        if name not in _REFUSED:
            raise TypeError(f"Accelerator got an unexpected argument {name!r}")
        accepted, why = _REFUSED[name]
        if not accepted(value):
            raise KwargsHandlerError(f"Accelerator({name}={value!r}) cannot be honoured: {why}")


def accumulation_steps(given: int, from_plugin: int | None) -> int:
    """gradient_accumulation_steps=, or a DeepSpeed plugin's when only that one is set.

    Left at 1 in code, it is $ACCELERATE_GRADIENT_ACCUMULATION_STEPS when set (as Accelerate:
    `retarget launch --gradient_accumulation_steps N` exports it).
    """
    from_env = os.environ.get(ACCUMULATION_ENV, "").strip()
    if given == 1 and from_env:
        if not from_env.isdigit() or int(from_env) < 1:
            raise ValueError(f"${ACCUMULATION_ENV}={from_env!r} must be an integer >= 1")
        given = int(from_env)
    if not isinstance(given, int) or isinstance(given, bool) or given < 1:
        raise ValueError(f"gradient_accumulation_steps={given!r} must be an integer >= 1")
    if from_plugin is None or from_plugin == given:
        return given
    if given == 1:
        return from_plugin
    raise ValueError(
        f"gradient_accumulation_steps={given} but deepspeed_plugin.gradient_accumulation_steps="
        f"{from_plugin}: keep one of them"
    )


#: DataLoaderConfiguration fields: read into the shard options, or accepted as what we do.
_SHARD_FIELDS = ("split_batches", "even_batches", "dispatch_batches")
_DATALOADER_REFUSED = {
    "use_stateful_dataloader": "a restored loader starts its saved epoch again and the script "
    "skips what it trained on (skip_first_batches), as with Accelerate's default",
    "custom_sampler": "the loader's own sampler is sharded; give it to the DataLoader",
}
# use_seedable_sampler picks retarget's seeded order (seed + epoch); batches are copied as torch
# copies them (non_blocking is accepted as a hint).
_DATALOADER_ACCEPTED = ("use_seedable_sampler", "non_blocking", "data_seed")


def shard_options(config: Any, split: bool, even: bool, dispatch: bool) -> dict[str, Any]:
    """How prepared loaders are sharded: the arguments, or a DataLoaderConfiguration's fields."""
    options: dict[str, Any] = {
        "split_batches": split,
        "even_batches": even,
        "dispatch_batches": dispatch,
        "order": AccelerateDraws,  # Accelerate's default: no seedable sampler
    }
    if config is None:
        return options
    for name, value in vars(config).items():
        if name in _SHARD_FIELDS:
            options[name] = bool(value)
        elif name in _DATALOADER_REFUSED:
            if value not in (None, False):
                raise KwargsHandlerError(
                    f"DataLoaderConfiguration({name}={value!r}) cannot be honoured: "
                    f"{_DATALOADER_REFUSED[name]}"
                )
        elif name not in _DATALOADER_ACCEPTED:
            raise KwargsHandlerError(f"DataLoaderConfiguration has an unknown field {name!r}")
    if getattr(config, "use_seedable_sampler", False):
        options["order"] = "seeded"
    if getattr(config, "data_seed", None) is not None:
        options["seed"] = int(config.data_seed)
    return options


@dataclass(frozen=True, kw_only=True)
class ProjectConfiguration:
    """Where an Accelerator writes: checkpoints and tracker logs (Accelerate's fields).

    With `automatic_checkpoint_naming`, `save_state()` writes
    `<project_dir>/checkpoints/checkpoint_<n>`, numbered on from the latest complete one, and
    keeps at most `total_limit` of them.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    """Tracker logs; defaults to project_dir."""
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    """Refused unless 0: numbering continues after the latest complete checkpoint on disk."""
    save_on_each_node: bool = False
    """Refused when True: checkpoints are written once, to a folder every node can reach."""

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            object.__setattr__(self, "logging_dir", self.project_dir)
        if self.iteration:
            raise KwargsHandlerError(
                f"ProjectConfiguration(iteration={self.iteration}) cannot be honoured: checkpoint "
                "numbers continue after the latest complete checkpoint in the project"
            )
        if self.save_on_each_node:
            raise KwargsHandlerError(
                "ProjectConfiguration(save_on_each_node=True) cannot be honoured: checkpoints "
                "are written once, into a folder every node reaches"
            )

    def checkpoints(self) -> ProjectConfig | None:
        """The checkpoint numbering for save_state/load_state (None without automatic naming)."""
        if not self.automatic_checkpoint_naming:
            return None
        if self.project_dir is None:
            raise ValueError("automatic_checkpoint_naming needs a project_dir")
        return ProjectConfig(project_dir=self.project_dir, total_limit=self.total_limit)


_PROJECT_FIELDS = (
    "project_dir",
    "logging_dir",
    "automatic_checkpoint_naming",
    "total_limit",
    "iteration",
    "save_on_each_node",
)


def project_configuration(project_dir: Any, config: Any) -> ProjectConfiguration:
    """project_dir= and project_config= (ours or Accelerate's) as one ProjectConfiguration."""
    if config is None:
        return ProjectConfiguration(project_dir=None if project_dir is None else str(project_dir))
    fields = {name: getattr(config, name) for name in _PROJECT_FIELDS}
    if project_dir is not None:  # Accelerate: project_dir= overrides the configuration's
        fields["project_dir"] = str(project_dir)
        fields["logging_dir"] = fields["logging_dir"] or str(project_dir)
    return ProjectConfiguration(**fields)
