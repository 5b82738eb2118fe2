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

Under tp on more than one process the regions holding split modules are captured again after
the split (execution/apply_tp.py). With example inputs this pass makes that first call itself
(one forward with grad, RNG and buffers restored), so the report shows each split region's
graph (and compile its compile) before the first step, and a split region no frontend
captures is refused under compile (TargetNotSupportedError naming the region and why) rather
than compiled as an eager form broken at the styles' hooks; without compile it runs its eager
form, warned by compile_for. Under capture="auto" a split region whose graphs nothing reads
(no rewrite, no compile) captures nothing and runs its own forward (execution/tp_regions.py).

    >>> compiled = retarget.compile_for(model, "fsdp+bf16", example_inputs=batch)
    >>> compiled.program.plan.applied     # world size, backend, what was wrapped
"""

from __future__ import annotations

import torch

from retarget.core.errors import TargetNotSupportedError
from retarget.execution.apply_plan import apply_plan
from retarget.execution.tp_regions import regions_holding_split_modules
from retarget.frontends.check import preserved_state
from retarget.ir.program import Program
from retarget.passes.base import Pass, PassResult
from retarget.targets.grammar import Target
from retarget.targets.strategies import STRATEGIES

#: Target parts whose decisions this stage carries out (fp16: the step guard for its scaler).
APPLIED_PARTS = frozenset({*STRATEGIES, "tp", "pp", "offload", "fp16"} - {"single"})


class ApplyPlan(Pass):
    name = "apply_plan"
    reads_graphs = False
    summary = "realise the distribution plan on the process group; install the step guard"
    provides = ("applied",)
    # Every pass that records a distribution decision comes first.
    after = ("shard_ddp", "shard_optimizer_state", "shard_tp", "shard_fsdp", "comm_hook")
    applies = True

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """This stage when the target has a part it carries out; [] otherwise."""
        return [cls()] if APPLIED_PARTS & set(target.names) else []

    def run(self, program: Program) -> PassResult:
        apply_plan(program)
        applied = program.plan.applied
        if applied is None:
            return PassResult(changed=False, notes=("nothing to distribute",))
        if not applied.applied:
            return PassResult(changed=False, notes=(f"not applied: {applied.reason}",))
        # (under tp+pp the stages run, not the regions: pipeline_tp splits their blocks)
        if program.plan.tp is not None and program.plan.pp is None and program.example is not None:
            capture_split_regions(program)
        stats = {"world_size": applied.world_size, "backend": applied.backend}
        return PassResult(changed=True, stats=stats, notes=(applied.wrapped,))


def capture_split_regions(program: Program) -> None:
    """One forward on the example inputs, as training calls it, so that every region tp split
    captures (and compiles) its split graph now; under compile a split region left without a
    graph is refused."""
    example = program.example
    split = regions_holding_split_modules(program, program.plan.tp)
    if all(region.deferred for region in split):
        return  # capture="auto" and nothing reads their graphs: nothing to capture
    for region in split:
        region.captured_by_compile_for()
    with preserved_state(program.module), torch.enable_grad():
        program.module(*example.args, **example.kwargs)
    compiled = any(region.runner is not None for region in split)  # compile_regions ran
    if not compiled or program.plan.tp.sequence_parallel:
        return  # under sequence parallelism compile compiles the eager form (apply_tp)
    for region in split:
        if region.eager_only:
            raise TargetNotSupportedError(
                f"tp+compile: region {region.name} ({region.paths[0]}) holds modules tp splits "
                f"and could not be captured after the split ({region.reason}); compiling its "
                "eager form would break the graph at every split module. Drop compile, or "
                f"keep {region.paths[0]}'s modules whole in the tp plan"
            )
