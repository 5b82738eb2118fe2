"""apply_plan: realise the distribution plan (DDP, FSDP2, tp) on the process group.

Contract: requires - | provides applied
    | after shard_ddp, shard_optimizer_state, shard_tp, shard_fsdp, comm_hook
    | numerics exact | options NoOptions

The plan records that shard_ddp, shard_fsdp, shard_tp and comm_hook wrote are realised by the
execution layer (execution/apply_plan.py): in a world of one nothing is applied and the report
says so; otherwise DDP wraps the model, or fully_shard shards each unit, or torch's parallel
styles split the planned modules (then fully_shard over dp for fsdp+tp), and the comm hook is
registered. Last, the optimizer step guard is installed where a plain optimizer step would be
wrong (FSDP-replaced parameters, zero1, fp16's loss scale).

    >>> compiled = retarget.compile_for(model, "fsdp+bf16", example_inputs=batch)
    >>> compiled.program.plan.applied     # world size, backend, what was wrapped
"""

from __future__ import annotations

from typing import Any

from retarget.execution.apply_plan import apply_plan
from retarget.ir.program import Program
from retarget.passes.base import Pass, PassResult
from retarget.spec.grammar import Target
from retarget.spec.strategies import STRATEGIES

#: Target parts whose decisions this stage carries out (fp16: the step guard for its scaler).
APPLIED_PARTS = frozenset({*STRATEGIES, "tp", "pp", "offload", "fp16"} - {"single"})


class ApplyPlan(Pass):
    name = "apply_plan"
    summary = "realise the distribution plan on the process group; install the step guard"
    provides = ("applied",)
    # Every pass that records a distribution decision comes first.
    after = ("shard_ddp", "shard_optimizer_state", "shard_tp", "shard_fsdp", "comm_hook")
    applies = True

    @classmethod
    def stage(cls, target: Target, capture: Any) -> list[Pass]:
        """This stage when the target has a part it carries out; [] otherwise."""
        return [cls()] if APPLIED_PARTS & set(target.names) else []

    def run(self, program: Program) -> PassResult:
        apply_plan(program)
        applied = program.plan.applied
        if applied is None:
            return PassResult(changed=False, notes=("nothing to distribute",))
        if not applied.applied:
            return PassResult(changed=False, notes=(f"not applied: {applied.reason}",))
        stats = {"world_size": applied.world_size, "backend": applied.backend}
        return PassResult(changed=True, stats=stats, notes=(applied.wrapped,))
