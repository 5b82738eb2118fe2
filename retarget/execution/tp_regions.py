"""Which regions tensor parallelism splits, and what becomes of their graphs.

A region holding a module the tp plan splits captured its graphs before the split (whole
shapes, no layouts): after the split it captures again with dynamo, which traces the parallel
styles' hooks, or under sequence parallelism runs its eager form. Apart from apply_tp so that
the passes can ask which regions those are without importing DTensor (0.7 s at start-up).
"""

from __future__ import annotations

from retarget.core.plans import TpPlan
from retarget.ir.program import Program
from retarget.ir.region import Region

#: Why a region holding split modules is captured again, and with what.
RECAPTURE_REASON = (
    "tp: captured after the split, so its graph holds the DTensor layouts torch's parallel "
    "styles install (dynamo: export and fx do not trace those hooks)"
)
RECAPTURE_FRONTENDS = ("dynamo",)
#: Why a region runs its eager form under sequence parallelism.
SEQUENCE_EAGER_REASON = (
    "tp[sequence_parallel=true]: the block takes the stream as a DTensor split on the "
    "sequence, which dynamo's export does not take as a graph input (torch 2.13); it runs its "
    "eager form (compile compiles that form, as torchtitan compiles its blocks)"
)


def regions_holding_split_modules(program: Program, plan: TpPlan) -> list[Region]:
    """The regions with a module the plan splits (or at a sequence boundary) inside."""
    split = [
        p
        for p, r in plan.rules.items()
        if r.style not in ("replicate", "replicate_grad_allreduce") or r.sequence
    ]
    return [
        region
        for region in program.regions
        if any(_inside(path, root) for path in split for root in region.paths)
    ]


def recapture_split_regions(program: Program, plan: TpPlan) -> list[str]:
    """After the split: every region holding a split module forgets the graphs captured before
    it (whole shapes, no layouts) and captures again at its next call, with dynamo, which
    traces the styles' hooks into the graph; the rewrites recorded on the region are replayed
    on the new graphs. Under sequence parallelism they run their eager form instead (the
    block's input is a DTensor, which dynamo's export refuses). The regions' names."""
    regions = regions_holding_split_modules(program, plan)
    for region in regions:
        if plan.sequence_parallel:
            region.run_eager_form(SEQUENCE_EAGER_REASON)
        else:
            region.recapture(RECAPTURE_FRONTENDS, RECAPTURE_REASON)
    return [region.name for region in regions]


def _inside(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")
