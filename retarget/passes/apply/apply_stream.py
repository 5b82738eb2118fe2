"""apply_stream: hook the offloaded blocks' weights in along plan_stream's device map.

Contract: requires stream | provides - | after plan_stream | numerics exact | options NoOptions

execution/stream.py places the compiled model and the user's model together along the map
and attaches the hooks that bring each offloaded block's weights in just before it runs
(`prefetch` blocks ahead), so both models drop them between calls.

    >>> compiled = retarget.compile_for(model, "bf16+stream[from=disk,max_memory=0.3]")
"""

from __future__ import annotations

from retarget.execution.stream import stream_weights
from retarget.ir.program import Program
from retarget.passes.base import Pass, PassResult
from retarget.targets.grammar import Target


class ApplyStream(Pass):
    name = "apply_stream"
    summary = "hook offloaded blocks' weights in per block, along the planned device map"
    requires = ("stream",)
    after = ("plan_stream",)
    applies = True

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """This stage when the target names `stream`."""
        return [cls()] if "stream" in target else []

    def run(self, program: Program) -> PassResult:
        if not stream_weights(program):
            return PassResult(changed=False, notes=("nothing offloaded",))
        return PassResult(changed=True, notes=(program.plan.stream.describe(),))
