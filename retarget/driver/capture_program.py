"""capture_program: the Program compile_for hands its first rewrite, to run a pass on alone.

    from retarget.driver.capture_program import capture_program

    program = capture_program(model, example_inputs=batch)
    (autocast,) = InsertAutocast.stage(retarget.Target.parse("bf16"), None)
    result = autocast.run(program)          # the graphs it rewrote: program.regions
    assert not autocast.run(program).changed

Only the stages before the first rewrite run: the repeated blocks are found, cp's attention is
routed to the split op when the target has cp (it must precede capture), the regions are
captured and the shapes annotated. No rewrite, plan or applier runs, and the user's model is not
edited (the Program holds a structural copy, as compile_for's does). `target` sets those
stages' options and what the plan will be for; `world_size` the world a planning pass plans
for (one process by default, whatever the environment says). A pass run this way meets the
Program exactly as it would inside compile_for after the passes before it in STAGES: a pass
that requires another's facts (shard_tp's "regions", zero1's "ddp") needs that one run first.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from retarget.driver.compile import new_program
from retarget.ir.hooks import users_hooks_set_aside
from retarget.ir.program import Program
from retarget.passes.analysis.annotate_shapes import AnnotateShapes
from retarget.passes.analysis.find_blocks import FindBlocks
from retarget.passes.capture.capture_regions import CaptureRegions
from retarget.passes.manager import PassManager
from retarget.passes.pipeline import build_pipeline
from retarget.passes.shard.split_context import SplitContext
from retarget.targets.grammar import Target, parse_target

#: The stages before the first rewrite (passes/pipeline.py's STAGES begins with them).
CAPTURE_STAGES = (FindBlocks, SplitContext, CaptureRegions, AnnotateShapes)


def capture_program(
    model: nn.Module,
    target: str | Target = "single",
    *,
    example_inputs: Any = None,
    capture: str = "regions",
    frontends: tuple[str, ...] | None = None,
    world_size: int = 1,
) -> Program:
    """The Program of `model` with its regions captured (module docstring)."""
    target = parse_target(target) if isinstance(target, str) else target
    passes = [
        p
        for p in build_pipeline(target, capture=capture, frontends=frontends)
        if isinstance(p, CAPTURE_STAGES)
    ]
    program = new_program(model, target, example_inputs, capture, world_size)
    with users_hooks_set_aside(model, program.module) as program.parked_hooks:
        PassManager(passes).run(program)
    return program
