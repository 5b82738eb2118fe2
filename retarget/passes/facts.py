"""What each `provides` token means, as a check on the Program: the one table of them.

After a pass runs, the PassManager checks every token the pass provides with the predicate
here and raises VerificationError naming the pass and the token when it does not hold. Each
predicate also holds when the pass legitimately had nothing to do (no repeated blocks, no
eligible Linear, no matmul to lower): a token says the decision was made and what it decided
is in place, not that something changed. A new token needs its predicate here first.
"""

from __future__ import annotations

from collections.abc import Callable

from retarget.core.module_record import record_of
from retarget.execution.checkpoint import NONE
from retarget.execution.module_call import RetargetedModule
from retarget.ir.program import Program

Fact = Callable[[Program], bool]


def module_tree_built(p: Program) -> bool:
    """the module tree has its root node"""
    return "" in p.tree


def blocks_in_tree(p: Program) -> bool:
    """every repeat of every repeated block is a module of the tree"""
    return "" in p.tree and all(path in p.tree for g in p.blocks for path in g.paths)


def regions_installed(p: Program) -> bool:
    """regions exist (unless capture is eager) and every repeat of each runs its region's
    calls (a RetargetedModule whose record names the region)"""
    return (p.capture == "eager" or bool(p.regions)) and all(
        _runs(p.submodule(path), "region", r) for r in p.regions for path in r.paths
    )


def shapes_recorded(p: Program) -> bool:
    """analysis holds the per-module entries and one entry per region"""
    return p.analysis.modules is not None and {r.name for r in p.regions} == set(
        p.analysis.regions or ()
    )


def autocast_applied(p: Program) -> bool:
    """every graph of a region that takes the insert_autocast rewrite records it"""
    rewritten = [r for r in p.regions if "insert_autocast" in dict(r.transforms)]
    return all("autocast" in g.gm.meta for r in rewritten for g in r.graphs.values())


def fp8_decided(p: Program) -> bool:
    """the fp8 decision for every Linear is recorded in analysis.fp8"""
    return "linears" in (p.analysis.fp8 or {})


def quant_decided(p: Program) -> bool:
    """the quant decision for every Linear is recorded in analysis.quant"""
    return "linears" in (p.analysis.quant or {})


def checkpoints_installed(p: Program) -> bool:
    """every repeat the checkpoint plan gives a policy runs under a checkpoint"""
    plan = (p.analysis.checkpoint or {}).get("plan", {})
    return all(_runs(p.submodule(q), "checkpoint", None) for q, how in plan.items() if how != NONE)


def _runs(module, field: str, expected) -> bool:
    """`module` is a RetargetedModule whose record's `field` is `expected` (None: any value)."""
    value = getattr(record_of(module), field)
    found = value is expected if expected is not None else value is not None
    return isinstance(module, RetargetedModule) and found


def ddp_planned(p: Program) -> bool:
    """plan.ddp holds the DDP record"""
    return p.plan.ddp is not None


def zero1_planned(p: Program) -> bool:
    """plan.zero1 holds the optimizer-state shares"""
    return p.plan.zero1 is not None


def fsdp_planned(p: Program) -> bool:
    """plan.fsdp holds the FSDP2 units"""
    return p.plan.fsdp is not None


def tp_planned(p: Program) -> bool:
    """plan.tp holds the tensor-parallel rules"""
    return p.plan.tp is not None


def context_planned(p: Program) -> bool:
    """plan.cp holds the context-parallel layout and the example is this rank's share"""
    return p.plan.cp is not None


def pipeline_planned(p: Program) -> bool:
    """plan.pp holds the stages, each a contiguous run of the repeated blocks"""
    return p.plan.pp is not None and all(s.blocks for s in p.plan.pp.stages)


def comm_hook_planned(p: Program) -> bool:
    """plan.comm_hook holds the hook DDP installs"""
    return p.plan.comm_hook is not None


def regions_compiled(p: Program) -> bool:
    """every region the compile scope covers runs through its compiled runner"""
    part = p.target.get("compile")
    whole = part is not None and part.get("scope") == "whole"
    covered = [r for r in p.regions if not whole or r.paths == [""]]
    return bool(covered) and all(r.runner is not None for r in covered)


def plan_applied(p: Program) -> bool:
    """a distribution plan (ddp, fsdp, tp, pp) has its applied record: applied, or why not"""
    nothing = p.plan.distribution is None and p.plan.tp is None and p.plan.pp is None
    return nothing or p.plan.applied is not None


def stream_planned(p: Program) -> bool:
    """plan.stream holds the device map apply_stream offloads along"""
    return p.plan.stream is not None


def xla_planned(p: Program) -> bool:
    """plan.xla says where every parameter goes (sharded or replicated) on the XLA devices"""
    plan = p.plan.xla
    names = {n for n, _ in p.module.named_parameters()}
    return plan is not None and set(plan.shards) | set(plan.replicated) == names


#: provides token -> the predicate that must hold once a pass providing it has run.
FACTS: dict[str, Fact] = {
    "applied": plan_applied,
    "tree": module_tree_built,
    "blocks": blocks_in_tree,
    "regions": regions_installed,
    "shapes": shapes_recorded,
    "autocast": autocast_applied,
    "fp8": fp8_decided,
    "quant": quant_decided,
    "ac": checkpoints_installed,
    "ddp": ddp_planned,
    "zero1": zero1_planned,
    "fsdp": fsdp_planned,
    "tp": tp_planned,
    "context": context_planned,
    "pipeline": pipeline_planned,
    "comm_hook": comm_hook_planned,
    "compiled": regions_compiled,
    "stream": stream_planned,
    "xla": xla_planned,
}
