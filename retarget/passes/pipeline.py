"""Target -> ordered pass list. One line per stage, in the order they run, with why.

Each stage looks at the target and contributes zero or more passes. The PassManager re-derives
the order from each pass's `requires`; this list is the default order where the declarations
leave a choice, and the place to read what a target turns into. A target part that no stage
handles is refused (TargetNotSupportedError), never silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable

from retarget.core.errors import TargetNotSupportedError
from retarget.passes.analysis.annotate_shapes import AnnotateShapes
from retarget.passes.analysis.find_blocks import FindBlocks
from retarget.passes.base import Pass
from retarget.passes.capture.capture_regions import CaptureOptions, CaptureRegions
from retarget.passes.comm.install_comm_hook import InstallCommHook
from retarget.passes.memory.checkpoint_blocks import CheckpointBlocks
from retarget.passes.precision.insert_autocast import autocast_passes
from retarget.passes.precision.swap_fp8 import SwapFp8
from retarget.passes.shard.shard_ddp import ShardDdp
from retarget.passes.shard.shard_fsdp import ShardFsdp
from retarget.target.grammar import Target

Stage = Callable[[Target, CaptureOptions], list[Pass]]

#: (parts the stage realises, stage), in pipeline order.
STAGES: list[tuple[frozenset[str], Stage]] = [
    # The tree and the repeated blocks decide what becomes a region.
    (frozenset(), lambda target, capture: [FindBlocks()]),
    # One graph per block type, before any graph rewrite.
    (frozenset(), lambda target, capture: [CaptureRegions(capture)]),
    # Shapes and FLOPs of the model as given, for the report and for later decisions.
    (frozenset(), lambda target, capture: [AnnotateShapes()]),
    # fp8: eligible Linears become FP8 modules. Before autocast (which leaves FP8 Linears alone)
    # and before sharding (FSDP then shards the swapped modules' Parameters, the original ones).
    (frozenset({"fp8"}), lambda target, capture: SwapFp8.stage(target)),
    # bf16/fp16: matmuls in low precision, fp32 islands. After any fp8 swap (fp8 Linears keep
    # their own precision) and before checkpointing and sharding (they recompute and shard the
    # casts with the blocks); fp16 also records the loss scaler in the plan.
    (frozenset({"bf16", "fp16"}), lambda target, capture: autocast_passes(target)),
    # ac: recompute repeated blocks in backward. After the precision stages (the recompute runs
    # the blocks as they now compute, casts and fp8 modules included) and before sharding (each
    # FSDP unit then recomputes inside its own all-gather).
    (frozenset({"ac"}), lambda target, capture: CheckpointBlocks.stage(target)),
    # ddp/zero1: replicate, all-reduce gradients in buckets (zero1 also shards optimizer
    # state). After every pass that changes modules or parameters: DDP registers the final ones.
    (frozenset({"ddp", "zero1"}), lambda target, capture: ShardDdp.stage(target)),
    # fsdp/zero2/zero3/hsdp(+offload): FSDP2 units per repeated block plus the root, mixed
    # precision policy from bf16/fp16. After fp8 swap (it shards the swapped modules'
    # parameters) and ac (each unit recomputes inside its own all-gather).
    (
        frozenset({"fsdp", "zero2", "zero3", "hsdp", "offload"}),
        lambda target, capture: ShardFsdp.stage(target),
    ),
    # fp16-comm/bf16-comm/powersgd: DDP communication hook, after the DDP wrap that owns it.
    (
        frozenset({"fp16-comm", "bf16-comm", "powersgd"}),
        lambda target, capture: InstallCommHook.stage(target),
    ),
    # One process, nothing to distribute: the parts above are the whole pipeline.
    (frozenset({"single"}), lambda target, capture: []),
]


def build_pipeline(
    target: Target, *, capture: str = "regions", frontends: tuple[str, ...] | None = None
) -> list[Pass]:
    """The passes that realise `target`, in default order; refuses parts no stage handles."""
    handled = frozenset().union(*(parts for parts, _ in STAGES))
    unsupported = [name for name in target.names if name not in handled]
    if unsupported:
        missing = ", ".join(repr(n) for n in unsupported)
        raise TargetNotSupportedError(
            f"target '{target}': no pass implements {missing} yet; refusing rather than "
            f"silently ignoring it (the parts a pass implements: {', '.join(sorted(handled))})"
        )
    options = CaptureOptions(mode=capture, **({"frontends": frontends} if frontends else {}))
    return [p for _, stage in STAGES for p in stage(target, options)]
