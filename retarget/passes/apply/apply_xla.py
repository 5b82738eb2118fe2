"""apply_xla: the model on its XLA devices, laid out as place_xla planned.

Contract: requires xla | provides - | after place_xla | numerics exact | options NoOptions

execution/xla_placement.py switches SPMD on when planned, moves the model to the XLA device,
annotates each sharded parameter with its spec and installs the step boundary at each call.

    >>> compiled = retarget.compile_for(model, "xla[spmd=true]", example_inputs=batch)
"""

from __future__ import annotations

from retarget.execution.xla_placement import apply_xla
from retarget.ir.program import Program
from retarget.passes.base import Pass, PassResult
from retarget.targets.grammar import Target


class ApplyXla(Pass):
    name = "apply_xla"
    summary = "move the model to its XLA devices and annotate the planned shards"
    requires = ("xla",)
    after = ("place_xla",)
    applies = True

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """This stage when the target names `xla`."""
        return [cls()] if "xla" in target else []

    def run(self, program: Program) -> PassResult:
        apply_xla(program)
        plan = program.plan.xla
        where = f"{plan.devices} {plan.platform} device(s)" + (", SPMD" if plan.spmd else "")
        return PassResult(changed=True, notes=(f"model on {where}",))
