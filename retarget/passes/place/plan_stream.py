"""plan_stream (`stream[from=disk|cpu, prefetch=1, max_memory=...]`): weights brought in per block.

Contract: requires regions | provides stream | after insert_autocast, swap_fp8 | numerics exact
    | options StreamOptions

For inference on a model larger than the memory it may use: the repeated blocks that do not fit
`max_memory` live on disk (or on the CPU when the execution device is an accelerator) and are
brought to the execution device just before they run, `prefetch` blocks ahead on a background
thread. The pass records the request (`program.plan.stream`); after the plan is applied the
driver sizes the blocks against the budget (`bigmodel.stream_weights`), fills in the device map,
and hooks the compiled model and the user's model together, so both drop the offloaded tensors
between calls. Offloading moves weights, never values: outputs are bitwise those of the model
held in memory. It follows every rewrite of the graphs (the weights it moves are the final ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from retarget.core.plans import StreamPlan
from retarget.ir.program import Program
from retarget.passes.base import Numerics, Pass, PassResult
from retarget.target.grammar import Target


@dataclass(frozen=True, kw_only=True)
class StreamOptions:
    source: str = "disk"
    """disk | cpu: where the weights that do not fit live."""
    prefetch: int = 1
    """Blocks whose weights are read ahead while the current one computes."""
    max_memory: int | float | None = None
    """Bytes of weights kept resident, a share of the model's (0 < x <= 1), or None (free)."""

    def __post_init__(self) -> None:
        if self.source not in ("disk", "cpu"):
            raise ValueError(f"plan_stream: from must be disk or cpu, not {self.source!r}")
        if self.prefetch < 0:
            raise ValueError(f"plan_stream: prefetch={self.prefetch} must be >= 0")


class PlanStream(Pass):
    name = "plan_stream"
    summary = "inference: offloaded blocks' weights brought in per block, prefetched (plan)"
    requires = ("regions",)
    provides = ("stream",)
    after = ("insert_autocast", "swap_fp8")
    numerics = Numerics("exact")
    Options = StreamOptions

    @classmethod
    def stage(cls, target: Target, capture: Any) -> list[Pass]:
        """The pipeline's stream stage: this pass when the target names `stream`."""
        if "stream" not in target:
            return []
        part = target.get("stream")
        return [
            cls(
                StreamOptions(
                    source=part.get("from"),
                    prefetch=part.get("prefetch"),
                    max_memory=part.get("max_memory"),
                )
            )
        ]

    def run(self, program: Program) -> PassResult:
        plan = program.plan.stream = StreamPlan(
            source=self.options.source,
            prefetch=self.options.prefetch,
            max_memory=self.options.max_memory,
        )
        return PassResult(changed=True, stats={"from": plan.source}, notes=(plan.describe(),))
