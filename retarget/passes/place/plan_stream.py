"""plan_stream (`stream[from=disk|cpu, prefetch=1, max_memory=...]`): weights brought in per block.

Contract: requires regions | provides stream | after insert_autocast, swap_fp8 | numerics exact
    | options StreamOptions

For inference on a model larger than the memory it may use: the repeated blocks that do not fit
`max_memory` live on disk (or on the CPU when the execution device is an accelerator) and are
brought to the execution device just before they run, `prefetch` blocks ahead on a background
thread. The pass sizes the blocks against the budget (`max_memory`: bytes, a share of the model's
weights, or the free memory) with `infer_auto_device_map` on the user's model (no-split units are
find_blocks' repeats) and records the device map in `program.plan.stream`; the apply_stream stage
(execution/stream.py) then hooks the compiled model and the user's model together along it, so both
drop the offloaded tensors between calls. Offloading moves weights, never values: outputs are
bitwise those of the model held in memory. It follows every rewrite of the graphs (the weights it
moves are the final ones).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from retarget.core.placement import CPU, DISK
from retarget.core.plans import StreamPlan
from retarget.ir.program import Program
from retarget.passes.base import Numerics, Pass, PassResult
from retarget.passes.place.device_map import (
    available_memory,
    infer_auto_device_map,
    no_split_paths,
    tensor_sizes,
)
from retarget.targets.grammar import Target


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
    def stage(cls, target: Target) -> list[Pass]:
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
        options = self.options
        plan = StreamPlan(
            source=options.source, prefetch=options.prefetch, max_memory=options.max_memory
        )
        model = program.original
        main = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device(CPU)
        if options.source == CPU and main.type == CPU:
            warnings.warn(
                "stream[from=cpu]: the execution device is the cpu, so weights kept on the cpu "
                "are already where they run; nothing is offloaded (use stream[from=disk])",
                stacklevel=2,
            )
            entries = {"": CPU}
        else:
            budget = _budget(model, options.max_memory, main)
            planned = infer_auto_device_map(
                model, max_memory={str(main): budget}, mode="sequential"
            )
            entries = {k: (options.source if v == DISK else v) for k, v in planned.items()}
        before = program.plan.stream
        program.plan.stream = plan = dataclasses.replace(
            plan,
            device_map=entries,
            main_device=str(main),
            blocks=tuple(sorted(no_split_paths(model, None))),
        )
        notes = (plan.describe(),)
        return PassResult(changed=plan != before, stats={"from": plan.source}, notes=notes)


def _budget(model: nn.Module, max_memory: int | float | None, main: torch.device) -> int:
    if isinstance(max_memory, float):
        return int(max_memory * sum(tensor_sizes(model, None).values()))
    if isinstance(max_memory, int):
        return max_memory
    return available_memory()[str(main)]
