"""Target -> pass list. One line per stage, in the order they run, with why it sits there.

This list IS the order, and the whole pipeline: the analyses, the rewrites and plans, then the
appliers that carry the plans out (passes/apply/); compile_for runs nothing else. Every stage is a
pass class whose `stage(target)` builds the passes that realise the target parts the line
names ([] when the target has none of them); compile_for's capture options go to capture_regions
alone. The PassManager runs them exactly as listed and refuses
(check_order) a list that breaks a pass's declared `requires` or `after`, so each reason below is
also a declaration it enforces. A target part that no stage realises is refused
(TargetNotSupportedError), never silently ignored.
"""

from __future__ import annotations

import dataclasses

from retarget.core.errors import TargetNotSupportedError
from retarget.passes.analysis.annotate_shapes import AnnotateShapes
from retarget.passes.analysis.find_blocks import FindBlocks
from retarget.passes.apply.apply_plan import APPLIED_PARTS, ApplyPlan
from retarget.passes.apply.apply_stream import ApplyStream
from retarget.passes.apply.apply_xla import ApplyXla
from retarget.passes.base import Pass
from retarget.passes.capture.capture_regions import CaptureOptions, CaptureRegions
from retarget.passes.comm.install_comm_hook import InstallCommHook
from retarget.passes.compile.compile_regions import CompileRegions
from retarget.passes.memory.checkpoint_blocks import CheckpointBlocks
from retarget.passes.place.place_xla import PlaceXla
from retarget.passes.place.plan_stream import PlanStream
from retarget.passes.precision.insert_autocast import InsertAutocast
from retarget.passes.precision.quantize_linears import QuantizeLinears
from retarget.passes.precision.swap_fp8 import SwapFp8
from retarget.passes.shard.shard_ddp import ShardDdp
from retarget.passes.shard.shard_fsdp import ShardFsdp
from retarget.passes.shard.shard_tp import ShardTp
from retarget.passes.shard.split_context import SplitContext
from retarget.passes.shard.split_stages import SplitStages
from retarget.passes.shard.zero1 import ShardOptimizerState
from retarget.targets.grammar import Target
from retarget.targets.strategies import DDP_STRATEGIES, FSDP_STRATEGIES

#: (target parts the stage realises, the pass class that builds it), in run order.
STAGES: tuple[tuple[frozenset[str], type[Pass]], ...] = (
    # The tree and the repeated blocks decide what becomes a region.
    (frozenset(), FindBlocks),
    # cp: the model's attention routed to the split op and the example cut to this rank's share
    # of the sequence. Before capture (declared after it by capture_regions), so every region
    # graph holds the split attention and is captured at the shapes the rank runs.
    (frozenset({"cp"}), SplitContext),
    # One graph per block type, before any graph rewrite (requires blocks).
    (frozenset(), CaptureRegions),
    # Shapes and FLOPs of the model as given, for the report and for later decisions.
    (frozenset(), AnnotateShapes),
    # fp8: eligible Linears become FP8 modules, decided on the shapes (requires shapes). First
    # of the rewrites: autocast leaves FP8 Linears alone and FSDP shards the swapped modules'
    # Parameters (insert_autocast, checkpoint_blocks, shard_* are declared after swap_fp8).
    (frozenset({"fp8"}), SwapFp8),
    # quant: eligible Linears become frozen 4/8-bit ones, at the same place and for the same
    # reasons as fp8 (the two do not combine): autocast leaves the quantized modules alone,
    # checkpointing recomputes them, FSDP shards their packed weights (declared after it).
    (frozenset({"quant"}), QuantizeLinears),
    # bf16/fp16: matmuls in low precision, fp32 islands. Before checkpointing and sharding,
    # which recompute and shard the casts with the blocks (declared after insert_autocast);
    # fp16 also records the loss scaler in the plan.
    (frozenset({"bf16", "fp16"}), InsertAutocast),
    # ac: recompute repeated blocks in backward, running them as the precision stages left
    # them; before sharding, so each FSDP unit recomputes inside its own all-gather.
    (frozenset({"ac"}), CheckpointBlocks),
    # compile: torch.compile each region's final graph, once per block type. After every
    # rewrite of the blocks' computation (precision casts, checkpoint wrappers; declared after
    # them), before sharding: torchtitan's order, compile each block then shard it (shard_*
    # are declared after compile_regions).
    (frozenset({"compile"}), CompileRegions),
    # ddp/zero1: replicate, all-reduce gradients in buckets. After every pass that changes
    # modules or parameters: DDP registers the final ones.
    (frozenset(DDP_STRATEGIES), ShardDdp),
    # zero1: optimizer state sharded over the ranks DDP replicates on (requires ddp).
    (frozenset({"zero1"}), ShardOptimizerState),
    # tp: modules split across the tp group with torch's parallel styles. After every pass
    # that changes the blocks' modules (the split ones are the final ones), before FSDP:
    # torchtitan's order, parallelize first, then fully_shard over the dp mesh dim.
    (frozenset({"tp"}), ShardTp),
    # pp: the repeated blocks cut into stages, balanced by FLOPs (requires shapes). Before
    # FSDP: under fsdp+pp each stage is one FSDP unit, planned from the stages.
    (frozenset({"pp"}), SplitStages),
    # fsdp/zero2/zero3/hsdp(+offload): FSDP2 units per repeated block plus the root, mixed
    # precision policy from bf16/fp16. Last rewrite of modules, like ddp, for the same reason.
    (frozenset({*FSDP_STRATEGIES, "offload"}), ShardFsdp),
    # fp16-comm/bf16-comm/powersgd: DDP communication hook, on the DDP wrap (requires ddp).
    (frozenset({"fp16-comm", "bf16-comm", "powersgd"}), InstallCommHook),
    # xla: where each parameter lives on the XLA devices (SPMD shards or one device). After
    # the rewrites, which it moves as they left the model; XLA compiles the whole step itself,
    # so no graph rewrite follows (the target admits only bf16 beside it).
    (frozenset({"xla"}), PlaceXla),
    # stream: inference with weights brought in per block. Last of the decisions: the weights
    # it moves are the final ones every rewrite left (the target refuses it next to training
    # strategies).
    (frozenset({"stream"}), PlanStream),
    # -- appliers (passes/apply/): carry out what the passes above recorded, decide nothing --
    # DDP, FSDP2, tp on the process group, and the optimizer step guard. After every decision:
    # DDP and fully_shard take the modules and parameters as the passes left them.
    (APPLIED_PARTS, ApplyPlan),
    # xla: the model moved to the XLA device(s) and laid out as planned, a step boundary per
    # call. After the rewrites it moves (xla admits no strategy beside it).
    (frozenset({"xla"}), ApplyXla),
    # stream: the blocks that do not fit leave both models, after every other decision.
    (frozenset({"stream"}), ApplyStream),
)

#: Parts no pass realises because there is nothing to do: one process, nothing to distribute.
NOTHING_TO_DO = frozenset({"single"})


def build_pipeline(
    target: Target, *, capture: str = "regions", frontends: tuple[str, ...] | None = None
) -> list[Pass]:
    """The passes that realise `target`, in run order; refuses parts no stage handles."""
    handled = NOTHING_TO_DO.union(*(parts for parts, _ in STAGES))
    unsupported = [name for name in target.names if name not in handled]
    if unsupported:
        missing = ", ".join(repr(n) for n in unsupported)
        raise TargetNotSupportedError(
            f"target '{target}': no pass implements {missing} yet; refusing rather than "
            f"silently ignoring it (the parts a pass implements: {', '.join(sorted(handled))})"
        )
    part = target.get("compile")
    if part is not None and part.get("scope") == "whole" and capture in ("auto", "regions"):
        capture = "whole"  # compile[scope=whole] compiles the model as one captured graph
    options = CaptureOptions(
        mode=capture, target=str(target), **({"frontends": frontends} if frontends else {})
    )
    passes = [p for _, pass_class in STAGES for p in pass_class.stage(target)]
    # compile_for's capture options reach capture_regions only
    return [CaptureRegions(options) if isinstance(p, CaptureRegions) else p for p in passes]


def place_extra(passes: list[Pass], extra: list[Pass]) -> list[Pass]:
    """`passes` with each of `extra` placed by its contract: right after the last pass it
    `requires` (a pass name, or a pass providing the token) or is declared `after`, else after
    the analyses (find_blocks, capture_regions, annotate_shapes); never after the appliers
    unless it names one. The result is checked by the PassManager like any list."""
    placed = list(passes)
    analyses = {"find_blocks", "capture_regions", "annotate_shapes"}
    for pass_ in extra:
        if not isinstance(pass_, Pass):
            raise TypeError(f"extra_passes takes Pass instances, got {type(pass_).__name__}")
        needs = set(pass_.requires) | set(pass_.after)
        anchors = [
            i
            for i, p in enumerate(placed)
            if p.name in needs or needs & set(p.provides) or (not needs and p.name in analyses)
        ]
        index = max(anchors) + 1 if anchors else 0
        appliers = [i for i, p in enumerate(placed) if p.applies]
        if appliers and index > appliers[0] and not any(placed[i].name in needs for i in appliers):
            index = appliers[0]
        placed.insert(index, pass_)
    return placed


def settle_capture(passes: list[Pass], *, graphs_wanted: bool = False) -> list[Pass]:
    """`passes` with capture="auto" settled: capture_regions captures nothing (its regions run
    their own forward) when no other pass reads or rewrites a graph (`Pass.reads_graphs`) and
    the caller does not want graphs (`graphs_wanted`: verify, print_before/after)."""
    if graphs_wanted or any(p.reads_graphs for p in passes):
        return passes
    return [
        CaptureRegions(dataclasses.replace(p.options, deferred=True))
        if isinstance(p, CaptureRegions) and p.options.mode == "auto"
        else p
        for p in passes
    ]
