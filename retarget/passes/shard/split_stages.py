"""split_stages (`pp[size=, schedule=, microbatches=, stages_per_rank=, cuts=]`): the repeated
blocks cut into pipeline stages, one per rank (K per rank, looped, under interleaved-1f1b and
zero-bubble), balanced by the FLOPs annotate_shapes counted.

Contract: requires regions, shapes | provides pipeline | after shard_tp
    | numerics approx(rtol=1e-05, atol=1e-06) | options SplitStagesOptions

The cut needs no help from the user: find_blocks knows where the model repeats, and the stages
are contiguous runs of those blocks, the glue before them (embeddings) with the first stage
and the glue after them (final norm, head, loss) with the last. `balance` chooses the runs
that minimise the largest stage's FLOPs (an exact search over the cut points), counting the
head's FLOPs on the last stage. Whole blocks are coarse when few blocks share a stage and the
head is heavy (Llama-2-7B's weighs half a block: 8 blocks on 4 stages balance 1.20 at best), so
with cuts=auto, when the best cut at block boundaries is worse than IMBALANCE_GOAL, stages may
begin inside a block, where one of its children begins (between attention and MLP), at the
points annotate_shapes' call timeline gives (`cut_units`), if that balances better. torch's
split takes a SplitPoint at any module; the values live there (the residual stream) travel to
the next stage like any other. cuts=blocks keeps block
boundaries only. The record (`plan.pp`, a `PpPlan`) holds the stages, their
estimated cost and rank (stage i on rank i mod p), the imbalance (max / mean) and the
schedule's bubble (p-1)/(K m+p-1) with K stages per rank; the report
and `retarget inspect --target "pp[size=4]" --world-size 4` print it in one process. Weights
shared by several modules (an LM head tied to the embedding) are recorded (`PpPlan.tied`):
every stage that uses one holds it and their gradients are summed (execution/pipeline_stages).

Beside fsdp (fsdp+pp[size=N]) the world is a (pp, dp) mesh, pp outermost as torchtitan lays
it out: N stages, each run by world / N ranks that FSDP2 shards it over, each of those reading
its own batches (the loader divides over dp).

Beside bf16, ac and compile the stages are what runs, not the region graphs (torch's split
exports the model anew), so this pass decides those parts under pp instead of insert_autocast,
checkpoint_blocks and compile_regions (which stand aside): each of a rank's stages runs its
forward under
torch.autocast(bfloat16) (its float outputs cast back to the dtypes traced, the float32 its
neighbour's receive buffers hold), and each repeated block in a stage (the n-th, 2n-th, ...
with ac[every=n]) is recomputed in backward by torch's non-reentrant checkpoint, and with
compile each repeated block is torch.compile'd, checkpoint inside (torchtitan's order)
(`plan.pp.autocast`, `checkpoint_every`, `compile`; execution/stage_forward.py). What those
passes offer on the graphs only is refused by name: bf16[keep_fp32=...] other than the
default (torch.autocast's own op lists decide), ac[policy=selective|budget],
compile[scope=whole], and compile with schedule=zero-bubble (its split backward); compile's
options are checked as compile_regions checks them.

Refused before anything runs, naming the value: a degree that is not the world (pp alone) or
does not divide it (fsdp+pp; `program.parallel_dims()` checks both), fewer blocks than stages,
no repeated blocks, a microbatch count that does not divide the example's rows,
stages_per_rank=1 with a looped schedule and K > 1 with gpipe or 1f1b, a looped schedule's
microbatch count that torch's rounds do not divide, no example inputs (the stages are traced on
a microbatch of it).

Numerics: torch's schedules average the microbatches' gradients; with equal token counts per
microbatch that is the whole batch's mean to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

from retarget.core.errors import TargetNotSupportedError
from retarget.core.plans import PpPlan
from retarget.execution.compiled_calls import CompileOptions
from retarget.ir.program import Program
from retarget.passes.base import Numerics, Pass, PassResult, coerce_options
from retarget.passes.compile.compile_regions import checked_options, refuse_cuda_graphs_off_cuda
from retarget.passes.shard.stage_cuts import best_stages, repeated_blocks
from retarget.targets.grammar import PARTS, Target

_SCHEMA = PARTS["pp"].options
#: Schedules that loop over several stages per rank (stages_per_rank defaults to 2 for them):
#: torch's ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble.
LOOPED = ("interleaved-1f1b", "zero-bubble")
#: Schedules that split each backward into input and weight gradients (torch refuses them for
#: compiled stage modules).
SPLIT_BACKWARD = ("zero-bubble",)


@dataclass(frozen=True, kw_only=True)
class SplitStagesOptions:
    """The options of `pp[...]`; defaults come from the target schema."""

    size: int = _SCHEMA["size"].default
    schedule: str = _SCHEMA["schedule"].default
    microbatches: int = _SCHEMA["microbatches"].default
    stages_per_rank: int = _SCHEMA["stages_per_rank"].default
    cuts: str = _SCHEMA["cuts"].default
    autocast: str | None = None
    """bf16 beside pp: the dtype each stage's forward runs under torch.autocast in."""
    checkpoint_every: int = 0
    """ac beside pp: every n-th repeated block recomputed in backward (0: none)."""
    compile: CompileOptions | None = None
    """compile beside pp: torch.compile's options for each repeated block of a stage."""
    beside_tp: bool = False
    """tp beside pp: each stage's blocks split over a tp group."""

    def __post_init__(self) -> None:
        coerce_options(self, _SCHEMA, "pp")


class SplitStages(Pass):
    name = "split_stages"
    summary = "pipeline parallelism: the repeated blocks cut into balanced stages over the ranks"
    requires = ("regions", "shapes")
    provides = ("pipeline",)
    # tp+pp: the stages span the processes / tp[size]
    after = ("shard_tp",)
    numerics = Numerics("approx", rtol=1e-5, atol=1e-6)
    Options = SplitStagesOptions

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        part = target.get("pp")
        if part is None:
            return []
        autocast, every, compile_part = _inside_stages(target)
        options = SplitStagesOptions(
            **part.as_dict(),
            autocast=autocast,
            checkpoint_every=every,
            compile=compile_part,
            beside_tp="tp" in target,
        )
        return [cls(options)]

    def run(self, program: Program) -> PassResult:
        options, dims = self.options, program.parallel_dims()
        size = dims.pp  # at least 2, the processes over tp unless fsdp shards each stage
        where = f"pp[size={size}]"
        per_rank = _stages_per_rank(options, where)
        count = size * per_rank
        blocks = repeated_blocks(program, where)
        if len(blocks) < count:
            fewer = (
                f"pp[size={len(blocks)}] or fewer"
                if per_rank == 1
                else f"fewer ranks or stages_per_rank ({size} x {per_rank} stages here)"
            )
            raise TargetNotSupportedError(
                f"{where}: the model has {len(blocks)} repeated blocks ({blocks[0]} ...), fewer "
                f"than the {count} stages; use {fewer}"
            )
        tied = _tied(program)
        if not hasattr(program.original, "loss_function"):
            raise TargetNotSupportedError(
                f"{where}: {type(program.original).__name__} has no loss_function; the last "
                "stage computes transformers' loss from the logits and labels, so pp takes "
                "transformers' causal LMs so far"
            )
        example = program.example
        ids = None
        if example is not None:
            ids = example.kwargs.get("input_ids", example.args[0] if example.args else None)
        if ids is None or not hasattr(ids, "shape"):
            raise TargetNotSupportedError(
                f"{where}: the stages are traced on a microbatch of the example: give "
                "example_inputs={'input_ids': ..., 'labels': ...}"
            )
        microbatches = options.microbatches or 2 * size
        rows = ids.shape[0]
        if rows % microbatches:
            raise TargetNotSupportedError(
                f"{where}: microbatches={microbatches} does not divide the example's {rows} "
                f"rows; every batch is cut into {microbatches} equal microbatches: use a batch "
                f"of a multiple of {microbatches} rows or set pp[microbatches=...]"
            )
        rounds = max(1, microbatches // size)
        if options.schedule in LOOPED and microbatches % rounds:
            raise TargetNotSupportedError(
                f"{where}: schedule={options.schedule} runs microbatches in rounds (one per "
                f"rank): microbatches={microbatches} makes {rounds} rounds that do not divide "
                f"it; use a multiple of {size} (pp[microbatches=...])"
            )
        autocast, checkpoint_every, compile_kwargs = (
            options.autocast,
            options.checkpoint_every,
            None,
        )
        if options.compile is not None:
            refuse_cuda_graphs_off_cuda(program, options.compile)
            compile_kwargs = options.compile.torch_kwargs()
        if options.beside_tp and checkpoint_every and compile_kwargs:
            raise TargetNotSupportedError(
                f"tp+{where}+ac+compile: a compiled block that recomputes DTensor ops fails in "
                "torch's AOT autograd (it saves the device mesh as a tensor, torch 2.13); drop "
                "ac or compile"
            )
        if compile_kwargs and options.schedule in SPLIT_BACKWARD:
            raise TargetNotSupportedError(
                f"{where}: schedule={options.schedule} splits each backward into the input's "
                "and the weights' gradients, which torch's schedules do not do for compiled "
                "stages; drop compile or use schedule=interleaved-1f1b"
            )
        stages, inside = best_stages(program, blocks, count, size, options.cuts)
        before = program.plan.pp
        plan = program.plan.pp = PpPlan(
            size=size,
            schedule=options.schedule,
            microbatches=microbatches,
            stages=stages,
            stages_per_rank=per_rank,
            split_points=tuple(s.start for s in stages[1:]),
            microbatch_rows=rows // microbatches,
            tied=tied,
            dp=dims.dp_shard,
            inside_blocks=inside,
            autocast=autocast,
            checkpoint_every=checkpoint_every,
            compile=compile_kwargs,
        )
        stats = {"stages": count, "imbalance": round(plan.imbalance, 3), "bubble": plan.bubble}
        return PassResult(changed=plan != before, stats=stats, notes=(plan.describe(),))


def _inside_stages(target: Target) -> tuple[str | None, int, CompileOptions | None]:
    """What the stages run under: the autocast dtype (bf16), which blocks are recomputed (ac's
    every; 0 without ac) and torch.compile's options for each block (compile). Refused: the
    options only the graph passes implement, and what compile_regions refuses."""
    autocast, every = None, 0
    bf16 = target.get("bf16")
    if bf16 is not None:
        default = PARTS["bf16"].options["keep_fp32"].default
        if sorted(bf16.get("keep_fp32")) != sorted(default):
            raise TargetNotSupportedError(
                f"'{bf16}' with pp: each stage runs under torch.autocast, whose own op lists "
                "decide what stays in float32 there; keep_fp32 applies to the region graphs, "
                "which pp's stages do not run: drop bf16[keep_fp32=...]"
            )
        autocast = "bfloat16"
    ac = target.get("ac")
    if ac is not None:
        if ac.get("policy") != "full":
            raise TargetNotSupportedError(
                f"'{ac}' with pp: a stage recomputes whole blocks (ac[policy=full], with "
                "every=N); the selective and budget policies rewrite the region graphs, which "
                "pp's stages do not run: use ac or ac[every=N]"
            )
        every = ac.get("every")
    return autocast, every, compile_options(target)


def compile_options(target: Target) -> CompileOptions | None:
    """The target's compile options for the stages' blocks, checked as compile_regions checks
    them (None without compile); compile[scope=whole] is refused."""
    part = target.get("compile")
    if part is None:
        return None
    if part.get("scope") == "whole":
        raise TargetNotSupportedError(
            f"'{part}' with pp: pp splits the model into stages, so no rank runs the whole "
            "forward to compile; use compile (scope=regions: each block of a stage compiled)"
        )
    keys = ("backend", "mode", "dynamic", "fullgraph")
    return checked_options(CompileOptions(**{key: part.get(key) for key in keys}))


def _stages_per_rank(options: SplitStagesOptions, where: str) -> int:
    """K: stages_per_rank as set, else 2 for a looped schedule and 1 for the others; refused
    where the schedule cannot run it."""
    schedule, asked = options.schedule, options.stages_per_rank
    if schedule in LOOPED:
        if asked == 1:
            raise TargetNotSupportedError(
                f"{where}: schedule={schedule} loops over several stages per rank; "
                "stages_per_rank=1 leaves nothing to interleave: set it to 2 or more (the "
                "default), or use schedule=1f1b"
            )
        return asked or 2
    if asked > 1:
        raise TargetNotSupportedError(
            f"{where}: stages_per_rank={asked} needs a looped schedule; schedule={schedule} "
            "runs one stage per rank: use schedule=interleaved-1f1b"
        )
    return 1


def _tied(program: Program) -> tuple[tuple[str, ...], ...]:
    """The names of each parameter shared by several modules (an LM head tied to the input
    embedding sits on the first and the last stage)."""
    owners: dict[int, list[str]] = {}
    for name, module in program.original.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(f"{name}.{pname}" if name else pname)
    return tuple(tuple(names) for names in owners.values() if len(names) > 1)
