"""Predict a training step's memory per rank: parameters, gradients, optimizer state, activations.

    >>> print(estimate_memory(compiled, world_size=8))          # a compiled model
    >>> estimate_for_target(model, "fsdp+bf16+ac", batch, world_size=8)   # retarget.driver.estimate

Parameters, gradients and optimizer state are counted, not modelled: the rewritten model's
parameters (tied ones once), gradients of the same dtype for those that require grad, and the
optimizer's state as torch creates it (Adam/AdamW: `exp_avg` and `exp_avg_sq` in the
parameter's dtype plus a 4-byte `step` per parameter; SGD with momentum: one buffer). Sharding
follows the strategy table (`retarget.targets.strategies`): FSDP2 shards every parameter along
dim 0 in chunks of ceil(dim0 / ranks), so the largest rank (rank 0) holds that many rows of
each; those are the per-rank figures. Activations come from one profiled forward
(`passes/memory/activation_profile.py`) of the rewritten
model on the example inputs, so precision is what the model really runs (bf16 autocast halves
the matmul outputs it keeps, fp8 modules keep what they keep), and the effect of `ac` is the
plan checkpoint_blocks chose. Activations are per rank as given: the example inputs are one
rank's batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from retarget.core.parallel_dims import ParallelDims
from retarget.core.world import World
from retarget.execution.module_call import own_forward
from retarget.passes.memory.activation_profile import GLUE, ActivationProfile, profile_activations
from retarget.passes.memory.measure import format_bytes
from retarget.passes.shard.stage_cuts import stage_parameters
from retarget.passes.shard.tp_params import fsdp_shapes
from retarget.targets.grammar import Target, parse_target
from retarget.targets.strategies import STRATEGY

#: Optimizer -> (state tensors per parameter shaped like it, whether it keeps a `step` tensor).
OPTIMIZERS: dict[str, tuple[int, bool]] = {
    "adam": (2, True),
    "adamw": (2, True),
    "sgd": (1, False),
    "none": (0, False),
}
_STEP_BYTES = 4  # torch keeps Adam's step as a float32 scalar tensor per parameter


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank, by component; activations by owner (glue and each block group)."""

    target: str
    world_size: int
    shards: int
    optimizer: str
    parameters: int
    gradients: int
    optimizer_state: int
    activations: dict[str, int] | None
    activations_without_ac: dict[str, int] | None
    recompute_transient: int = 0
    notes: tuple[str, ...] = field(default=())

    @property
    def total(self) -> int:
        """Parameters + gradients + optimizer state + activations after forward."""
        held = self.parameters + self.gradients + self.optimizer_state
        return held + sum((self.activations or {}).values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "world_size": self.world_size,
            "shards": self.shards,
            "optimizer": self.optimizer,
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer_state,
            "activations": self.activations,
            "activations_without_ac": self.activations_without_ac,
            "recompute_transient": self.recompute_transient,
            "total": self.total,
            "notes": list(self.notes),
        }

    def rows(self) -> list[tuple[str, str, str]]:
        """(component, bytes per rank, bytes without ac) rows of the table."""
        rows = [
            ("parameters", format_bytes(self.parameters), ""),
            ("gradients", format_bytes(self.gradients), ""),
            (f"optimizer state ({self.optimizer})", format_bytes(self.optimizer_state), ""),
        ]
        if self.activations is None:
            return [*rows, ("activations", "unknown", "see note")]
        before = self.activations_without_ac

        def without(owner: str | None = None) -> str:
            if before is None:
                return ""
            return format_bytes(sum(before.values()) if owner is None else before.get(owner, 0))

        rows.append(("activations", format_bytes(sum(self.activations.values())), without()))
        for owner, size in self.activations.items():
            rows.append((f"  {owner}", format_bytes(size), without(owner)))
        if self.recompute_transient:
            rows.append(("  + one block recomputed", format_bytes(self.recompute_transient), ""))
        rows.append(("total", format_bytes(self.total), ""))
        return rows

    def __str__(self) -> str:
        shard = f", sharded over {self.shards}" if self.shards > 1 else ""
        title = (
            f"memory per rank: target {self.target}, world size {self.world_size}{shard}, "
            f"optimizer {self.optimizer}"
        )
        header = ("component", "bytes", "without ac" if self.activations_without_ac else "")
        table = [header, *self.rows()]
        widths = [max(len(row[i]) for row in table) for i in range(3)]
        lines = [title]
        for row in table:
            cells = (row[0].ljust(widths[0]), row[1].rjust(widths[1]), row[2].rjust(widths[2]))
            lines.append("  " + "  ".join(cells).rstrip())
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    __repr__ = __str__


def estimate_memory(
    source: Any,
    *,
    target: str | Target | None = None,
    world_size: int | None = None,
    optimizer: str = "adam",
    run: bool = True,
) -> MemoryEstimate:
    """Estimate per-rank memory of a compiled model (or its Program).

    `target` defaults to the one it was compiled for; `world_size` to the world its plan was
    made for (`program.world`: stated, else the launcher's, else 1). Activations come from the
    profile that checkpoint_blocks made; without one and with `run=True` a profiled forward runs
    now (on example inputs; in a distributed run call it on every rank: the forward may
    communicate).
    """
    program = getattr(source, "program", source)
    target = parse_target(target if target is not None else program.target)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {tuple(OPTIMIZERS)}, not {optimizer!r}")
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    world = program.world if world_size in (None, program.world.size) else World.resolve(world_size)
    shards, notes = _shards(target, world)
    sharded = STRATEGY[target.strategy].shards
    params = _unique_parameters(program.module)
    tp = program.plan.tp
    split, whole = fsdp_shapes(program, tp, shards) if tp is not None else ({}, set())
    for kept in whole:  # each dp rank holds it all: one row, which no dim-0 chunking divides
        split[kept] = (1, math.prod(split[kept]))
    if tp is not None:
        notes.append(f"tp[size={tp.size}]: the split modules hold 1/{tp.size} of their weights")
    trained = [p for p in params if p.requires_grad]
    pp = program.plan.pp
    if pp is not None:
        # A rank holds (fsdp+pp: its shards of) its stage's weights only.
        stage = max(stage_parameters(program, pp), key=lambda ps: sum(p.numel() for p in ps))
        mine = {id(p) for p in stage}
        params = [p for p in params if id(p) in mine]
        trained = [p for p in params if p.requires_grad]
        notes.append(
            f"pp[size={pp.size}]: the rank of the largest stage ({len(params)} parameters)"
        )
    profile = program.analysis.activation_profile
    if profile is None and run and program.example is not None:
        # Kept: activation sizes follow the example inputs' shapes, not the weights, so the
        # report (which never runs the model) shows them from now on.
        profile = program.analysis.activation_profile = _profile_now(program)
    plan = (program.analysis.checkpoint or {}).get("plan", {})
    if profile is None and program.example is None:
        notes.append("activations unknown: no example inputs to profile a forward with")
    elif profile is None:
        notes.append(
            "activations not measured yet (a report never runs the model): "
            "estimate_memory(compiled) runs one profiled forward and keeps the figures"
        )
    if program.plan.cp is not None and profile is not None:
        cp = program.plan.cp
        notes.append(
            f"cp[size={cp.size}]: activations are one rank's share of the sequence "
            f"({cp.per_rank_sequence or '1/' + str(cp.size)} positions)"
        )
    if target.strategy == "ddp":
        notes.append(
            "DDP also keeps gradient buckets the size of the gradients, unless "
            "ddp[gradient_as_bucket_view=true]"
        )
    return MemoryEstimate(
        target=str(target),
        world_size=world.size,
        shards=shards,
        optimizer=optimizer,
        parameters=sum(_bytes(p, shards if sharded[0] else 1, split) for p in params),
        gradients=sum(_bytes(p, shards if sharded[1] else 1, split) for p in trained),
        optimizer_state=_optimizer_bytes(trained, optimizer, shards if sharded[2] else 1, split),
        activations=_by_group(program, profile, plan) if profile else None,
        activations_without_ac=_by_group(program, profile, {}) if profile and plan else None,
        recompute_transient=profile.transient(plan) if profile and plan else 0,
        notes=tuple(notes),
    )


def _shards(target: Target, world: World) -> tuple[int, list[str]]:
    """Processes one parameter is sharded over: FSDP2's dp x cp ranks (core.parallel_dims),
    1 for a strategy that does not shard; hsdp's shard group, with a note of its replicas."""
    dims = ParallelDims.resolve(target, world)
    if target.strategy == "hsdp":
        notes = [f"hsdp: {dims.dp_replicate} replica group(s) of {dims.dp_shard} processes"]
        return dims.dp_shard, notes
    return (dims.dp_shard * dims.cp if any(STRATEGY[target.strategy].shards) else 1), []


def _unique_parameters(module: nn.Module) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for parameter in module.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        seen.setdefault(id(local.untyped_storage()), parameter)
    return list(seen.values())


def _bytes(
    tensor: torch.Tensor, shards: int, split: dict[int, tuple[int, ...]] | None = None
) -> int:
    """Bytes of the largest rank's shard: ceil(dim0 / shards) rows (FSDP2's dim-0 chunks) of
    the tensor, or of the part tp leaves on a rank (`split`: id -> that shape)."""
    shape = (split or {}).get(id(tensor)) or tuple(tensor.shape) or (1,)  # DTensor: global
    rows = -(-shape[0] // shards)
    numel = rows
    for size in shape[1:]:
        numel *= size
    return numel * tensor.element_size()


def _optimizer_bytes(
    params: list[torch.Tensor], optimizer: str, shards: int, split: dict[int, tuple[int, ...]]
) -> int:
    states, step = OPTIMIZERS[optimizer]
    per_state = sum(_bytes(p, shards, split) for p in params)
    return states * per_state + (_STEP_BYTES * len(params) if step else 0)


def _profile_now(program) -> ActivationProfile:
    groups = {path: group.name for group in program.blocks for path in group.paths}
    example = program.example
    # Under cp the example is already a rank's share: the model's own forward takes it (its
    # outer call would cut the sequence again).
    call = partial(own_forward, program.module) if program.plan.cp is not None else None
    return profile_activations(program.module, groups, example.args, example.kwargs, call)


def _by_group(program, profile: ActivationProfile, plan: dict[str, str]) -> dict[str, int]:
    """Activation bytes by owner: the glue, then each block group (all its repeats)."""
    owners = profile.by_owner(plan)
    grouped = {GLUE: owners.pop(GLUE)}
    for path, size in owners.items():
        name = profile.blocks[path].group
        grouped[name] = grouped.get(name, 0) + size
    return grouped
