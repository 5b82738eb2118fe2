"""shard_optimizer_state (`zero1`): shard the optimizer state over the DDP ranks (ZeRO stage 1).

Contract: requires ddp | provides zero1 | after - | numerics exact | options NoOptions

Parameters and gradients stay replicated (shard_ddp); each rank keeps the optimizer state (Adam's
two moments, ...) of its share of the parameters only, steps that share, and broadcasts the
updated parameters. The runtime realises it with torch's ZeroRedundancyOptimizer, built in
`runtime.prepare(optimizer)` from the user's optimizer class and hyperparameters. The optimizer
has to be prepared: a plain optimizer stepping the model under zero1 would keep the whole state
on every rank, so the runtime stops it at its first step with an error saying so.

The record, `program.plan.zero1` (a `Zero1Plan`), gives each rank's share, computed as
ZeroRedundancyOptimizer partitions (largest parameters first, each to the rank holding the
fewest elements so far), for the trainable parameters as one group.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from retarget.core.plans import Zero1Plan
from retarget.ir.program import Program
from retarget.passes.base import Pass, PassResult
from retarget.passes.shard.shard_ddp import trainable_parameters
from retarget.targets.grammar import Target

OPTIMIZER = "torch.distributed.optim.ZeroRedundancyOptimizer"


class ShardOptimizerState(Pass):
    name = "shard_optimizer_state"
    reads_graphs = False
    summary = "ZeRO-1: optimizer state sharded over the DDP ranks (applied by runtime.prepare)"
    requires = ("ddp",)
    provides = ("zero1",)

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """The pass for the target's zero1 part, on top of shard_ddp's replication; [] without."""
        return [cls()] if "zero1" in target else []

    def run(self, program: Program) -> PassResult:
        world = program.world
        params = [p for _, p in trainable_parameters(program.module)]
        shares = partition(params, world.size)
        before = program.plan.zero1
        program.plan.zero1 = Zero1Plan(optimizer=OPTIMIZER, world=world, per_rank=tuple(shares))
        notes = (
            f"optimizer state of {sum(shares):,} parameters sharded over {world.describe()}: "
            f"per rank {', '.join(f'{n:,}' for n in shares)}",
            "call runtime.prepare(optimizer): it becomes a ZeroRedundancyOptimizer of the same "
            "class and hyperparameters; an unprepared optimizer is refused at its first step",
        )
        changed = program.plan.zero1 != before
        return PassResult(changed=changed, stats={"per_rank": shares}, notes=notes)


def partition(params: list[nn.Parameter] | list[Any], world_size: int) -> list[int]:
    """Elements of optimizer state per rank, as ZeroRedundancyOptimizer assigns parameters."""
    sizes = [0] * world_size
    for param in sorted(params, key=lambda t: t.numel(), reverse=True):
        rank = sizes.index(min(sizes))
        sizes[rank] += param.numel()
    return sizes
