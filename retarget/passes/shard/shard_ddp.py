"""shard_ddp (`ddp`, `zero1`): replicate the model, all-reduce gradients in buckets (DDP).

Contract: requires regions | provides ddp
    | after swap_fp8, quantize_linears, insert_autocast, checkpoint_blocks, compile_regions
    | numerics exact
    | options DdpOptions

The pass decides and records; `retarget.execution.apply_plan` wraps the compiled model in torch's
DistributedDataParallel when a process group of more than one process exists. The record,
`program.plan.ddp` (a `DdpPlan`), holds DDP's settings (the `ddp[...]` options) and the
gradient buckets DDP will all-reduce, computed the way DDP computes them:

- default (`find_unused_parameters=false`): the first backward all-reduces one bucket; DDP then
  rebuilds buckets in the order gradients became ready, which for a model that runs its modules
  in definition order is the reverse of that order, with a 1 MiB first bucket and
  `bucket_cap_mb` for the others. The plan shows those steady-state buckets.
- `find_unused_parameters=true`: DDP keeps its initial buckets (definition order, same caps,
  reversed) and never rebuilds them.

Numerics: DDP averages gradients over ranks, so N ranks on N shards of a batch compute what one
process computes on the whole batch (to float32 rounding of the all-reduce sum).

    >>> compiled = retarget.compile_for(model, "ddp[bucket_cap_mb=5]", example_inputs=batch)
    >>> compiled.report.to_dict()["plan"]["ddp"]["buckets"]
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from retarget.core.plans import DdpBucket, DdpPlan
from retarget.ir.program import Program
from retarget.passes.base import Pass, PassResult
from retarget.targets.grammar import PARTS, Target

_SCHEMA = PARTS["ddp"].options
_MIB = 1024 * 1024
#: DDP's small first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES): early gradients go out early.
FIRST_BUCKET_BYTES = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", _MIB)


@dataclass(frozen=True, kw_only=True)
class DdpOptions:
    """The options of `ddp[...]` / `zero1[...]`; defaults come from the target schema."""

    bucket_cap_mb: int = _SCHEMA["bucket_cap_mb"].default
    """Gradient bucket size in MiB for the all-reduce."""
    find_unused_parameters: bool = _SCHEMA["find_unused_parameters"].default
    """Tolerate parameters that get no gradient in a step (costs a graph traversal per step)."""
    static_graph: bool = _SCHEMA["static_graph"].default
    """The set of used parameters never changes between steps."""
    gradient_as_bucket_view: bool = _SCHEMA["gradient_as_bucket_view"].default
    """Gradients are views into the buckets (saves one gradient-sized copy)."""
    broadcast_buffers: bool = _SCHEMA["broadcast_buffers"].default
    """Broadcast buffers (BatchNorm statistics) from rank 0 at every forward."""
    strategy: str = "ddp"
    """ddp or zero1: the part these options came from (zero1 shards the optimizer state too)."""

    def ddp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of torch's DistributedDataParallel these options stand for.

        torch 2.13 renamed broadcast_buffers to forward_sync_buffers (same meaning: buffers
        are broadcast from rank 0 at every forward; init always syncs them).
        """
        kwargs = asdict(self)
        kwargs.pop("strategy")
        sync = kwargs.pop("broadcast_buffers")
        accepted = inspect.signature(DistributedDataParallel.__init__).parameters
        key = "forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers"
        return {**kwargs, key: sync}


class ShardDdp(Pass):
    name = "shard_ddp"
    reads_graphs = False
    summary = "replicate with DDP: gradients all-reduced in buckets (plan; applied by the runtime)"
    requires = ("regions",)
    provides = ("ddp",)
    # DDP registers the modules and parameters as every rewriting pass left them.
    after = (
        "swap_fp8",
        "quantize_linears",
        "insert_autocast",
        "checkpoint_blocks",
        "compile_regions",
    )
    Options = DdpOptions

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """The pass for the target's ddp or zero1 part (zero1 replicates with DDP); [] without."""
        part = target.get("ddp") or target.get("zero1")
        return [] if part is None else [cls(DdpOptions(**part.as_dict(), strategy=target.strategy))]

    def run(self, program: Program) -> PassResult:
        world = program.world
        params = trainable_parameters(program.module)
        buckets = plan_buckets(params, self.options)
        total = sum(p.numel() for _, p in params)
        before = program.plan.ddp
        program.plan.ddp = DdpPlan(
            strategy=self.options.strategy,
            world=world,
            options=self.options.ddp_kwargs(),
            parameters=total,
            buckets=tuple(buckets),
        )
        notes = [
            f"DDP over {world.describe()}: every rank holds all {total:,} parameters; "
            f"gradients are averaged by all-reduce in {len(buckets)} bucket(s)",
            bucket_note(self.options),
        ]
        stats = {"world_size": world.size, "buckets": len(buckets), "parameters": total}
        return PassResult(changed=program.plan.ddp != before, stats=stats, notes=tuple(notes))


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters DDP reduces: requires_grad ones, each once, in definition order."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def plan_buckets(params: list[tuple[str, nn.Parameter]], options: DdpOptions) -> list[DdpBucket]:
    """The buckets DDP all-reduces in steady state, in the order it launches them."""
    if not params:
        return []
    caps = [FIRST_BUCKET_BYTES, options.bucket_cap_mb * _MIB]
    if options.find_unused_parameters:
        # DDP's initial assignment (definition order), launched last bucket first; never rebuilt.
        order = list(params)
        indices, _ = dist._compute_bucket_assignment_by_size([p for _, p in order], caps)
        indices = list(reversed(indices))
    else:
        # The rebuild after the first step: gradient-ready order, assumed reverse definition.
        order = list(reversed(params))
        indices, _ = dist._compute_bucket_assignment_by_size([p for _, p in order], caps)
    return [_bucket([order[i] for i in bucket]) for bucket in indices]


def _bucket(members: list[tuple[str, nn.Parameter]]) -> DdpBucket:
    numel = sum(p.numel() for _, p in members)
    nbytes = sum(p.numel() * p.element_size() for _, p in members)
    return DdpBucket(
        parameters=tuple(name for name, _ in members), numel=numel, mib=round(nbytes / _MIB, 3)
    )


def bucket_note(options: DdpOptions) -> str:
    if options.find_unused_parameters:
        return (
            "find_unused_parameters: buckets are DDP's initial ones (definition order), never "
            "rebuilt; each step also walks the graph for unused parameters"
        )
    if options.static_graph:
        return "static_graph: buckets rebuilt once after the first step, graph assumed fixed"
    return (
        f"buckets: 1 MiB first, then {options.bucket_cap_mb} MiB, in reverse definition order "
        "(DDP rebuilds them so after the first step, which reduces one bucket)"
    )
