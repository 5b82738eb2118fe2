"""tp beside pp (tp+pp, fsdp+tp+pp): what shard_tp decides differently when each pipeline
stage runs on a tp group.

- `refuse_beside_pp`: the tp degree must be given (the pipeline spans the processes / T, so
  it cannot default to the world), and the options whose layouts only the region graphs' tp
  implements (sequence_parallel, loss_parallel, async_tp) are refused by name;
- `blocks_only`: the stages' blocks are split by execution/pipeline_tp (DTensor parameters
  inside the block graphs); the plan keeps only the rules of the repeated blocks' modules,
  and the split modules outside them (embedding, head) are named, kept whole on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from retarget.core.errors import TargetNotSupportedError
from retarget.core.plans import TpPlan
from retarget.ir.program import Program
from retarget.passes.shard.stage_cuts import repeated_blocks


def refuse_beside_pp(options: Any) -> None:
    """tp+pp: a stage's blocks are split by DTensor's rules, which have no sequence, vocabulary
    or async layouts (those are the region graphs' tp). The degree is ParallelDims' to check:
    tp needs its size beside pp."""
    for option in ("sequence_parallel", "loss_parallel", "async_tp"):
        if getattr(options, option):
            raise TargetNotSupportedError(
                f"tp[{option}=true]+pp: inside a pipeline stage tp splits the blocks' "
                f"Linears only; drop {option} (or pp)"
            )


def blocks_only(program: Program, plan: TpPlan) -> tuple[TpPlan, list[str]]:
    """tp+pp: the plan's rules for the repeated blocks' modules (what execution/pipeline_tp
    splits inside the stages), and the paths of the split modules outside them, kept whole."""
    blocks = repeated_blocks(program, "tp+pp")

    def inside(path: str) -> bool:
        return any(path == b or path.startswith(b + ".") for b in blocks)

    rules = {path: rule for path, rule in plan.rules.items() if inside(path)}
    whole = [p for p, r in plan.rules.items() if not inside(p) and r.style != "replicate"]
    return dataclasses.replace(plan, rules=rules), whole
