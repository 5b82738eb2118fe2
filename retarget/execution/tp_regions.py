"""Which regions tensor parallelism splits, and what becomes of their graphs.

A region holding a module the tp plan splits captured its graphs before the split (whole
shapes, no layouts): after the split it captures again with dynamo, which traces the parallel
styles' hooks, or under sequence parallelism runs its eager form. Under capture="auto" a region
whose graphs nothing would read after the split (no rewrite recorded on it, no compiled runner)
captures nothing: its repeats run their own forward with the styles' hooks, which is what the
dynamo graph computes, without the capture (seconds a region on each rank: DTensor's dispatch
traced op by op). Apart from apply_tp so that
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
#: Why a region that nothing reads after the split runs its own forward (capture="auto").
DEFERRED_REASON = (
    "tp, capture=auto: split after capture and no rewrite or compile reads its graph, so its "
    "repeats run their own forward (with the parallel styles' hooks) instead of a dynamo "
    "capture; a rewrite added later captures it"
)
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
    block's input is a DTensor, which dynamo's export refuses); under capture="auto" a region
    no rewrite or runner reads runs its own forward (`DEFERRED_REASON`). The regions' names."""
    regions = regions_holding_split_modules(program, plan)
    for region in regions:
        if plan.sequence_parallel:
            region.run_eager_form(SEQUENCE_EAGER_REASON)
            continue
        region.recapture(RECAPTURE_FRONTENDS, RECAPTURE_REASON)
        if program.capture == "auto" and not read_after_the_split(region):
            region.defer(DEFERRED_REASON)
    return [region.name for region in regions]


def read_after_the_split(region: Region) -> bool:
    """Whether a split region's graphs would be read: a rewrite to replay on them (or its
    module-level form), or a runner (compile) that compiles them."""
    return bool(region.transforms or region.eager_forms) or region.runner is not None


def _inside(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")
