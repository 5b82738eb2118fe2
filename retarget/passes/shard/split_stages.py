"""split_stages (`pp[size=, schedule=, microbatches=, stages_per_rank=, cuts=]`): the repeated
blocks cut into pipeline stages, one per rank (K per rank, looped, under interleaved-1f1b and
zero-bubble), balanced by the FLOPs annotate_shapes counted.

Contract: requires regions, shapes | provides pipeline | after -
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

Refused before anything runs, naming the value: a degree that is not the world (pp alone) or
does not divide it (fsdp+pp), fewer blocks than stages, no repeated blocks, a microbatch count
that does not divide the example's rows, stages_per_rank=1 with a looped schedule and K > 1
with gpipe or 1f1b, a looped schedule's microbatch count that torch's rounds do not divide, no
example inputs (the stages are traced on a microbatch of it).

Numerics: torch's schedules average the microbatches' gradients; with equal token counts per
microbatch that is the whole batch's mean to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from retarget.core.errors import TargetNotSupportedError
from retarget.core.plans import PpPlan, PpStage, stage_imbalance
from retarget.ir.program import Program
from retarget.passes.base import Numerics, Pass, PassResult, coerce_options
from retarget.spec.grammar import PARTS, Target
from retarget.spec.strategies import FSDP_STRATEGIES

_SCHEMA = PARTS["pp"].options
#: Schedules that loop over several stages per rank (stages_per_rank defaults to 2 for them):
#: torch's ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble.
LOOPED = ("interleaved-1f1b", "zero-bubble")


@dataclass(frozen=True, kw_only=True)
class SplitStagesOptions:
    """The options of `pp[...]`; defaults come from the target schema."""

    size: int = _SCHEMA["size"].default
    schedule: str = _SCHEMA["schedule"].default
    microbatches: int = _SCHEMA["microbatches"].default
    stages_per_rank: int = _SCHEMA["stages_per_rank"].default
    cuts: str = _SCHEMA["cuts"].default

    def __post_init__(self) -> None:
        coerce_options(self, _SCHEMA, "pp")


def balance(costs: list[int], tail: int, stages: int) -> list[tuple[int, int]]:
    """Cut `costs` (one per block, in order) into `stages` contiguous runs, `tail` added to the
    last, minimising the largest run's cost; the runs as (start, end) index pairs."""
    n = len(costs)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[s][i]: the smallest largest cost cutting blocks[:i] into s runs; cut[s][i]: where
    # the last of those runs starts.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            extra = tail if (s == stages and i == n) else 0
            for j in range(s - 1, i):
                worst = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    runs, end = [], n
    for s in range(stages, 0, -1):
        start = cut[s][end]
        runs.append((start, end))
        end = start
    return runs[::-1]


class SplitStages(Pass):
    name = "split_stages"
    summary = "pipeline parallelism: the repeated blocks cut into balanced stages over the ranks"
    requires = ("regions", "shapes")
    provides = ("pipeline",)
    numerics = Numerics("approx", rtol=1e-5, atol=1e-6)
    Options = SplitStagesOptions

    @classmethod
    def stage(cls, target: Target, capture: Any) -> list[Pass]:
        part = target.get("pp")
        return [] if part is None else [cls(SplitStagesOptions(**part.as_dict()))]

    def run(self, program: Program) -> PassResult:
        options, world = self.options, program.world.size
        size = options.size or world
        where = f"pp[size={size}]"
        sharded = any(n in program.target for n in FSDP_STRATEGIES)
        if size < 2 or world % size or (size != world and not sharded):
            beside = (
                f"a divisor of the {program.world.describe()} (fsdp shards each stage over the "
                "rest)"
                if sharded
                else f"the {program.world.describe()} (or add fsdp: fsdp+pp[size=N] shards "
                "each stage over world / N ranks)"
            )
            raise TargetNotSupportedError(
                f"{where}: the pipeline degree must be at least 2 and {beside}"
            )
        per_rank = _stages_per_rank(options, where)
        count = size * per_rank
        blocks = _blocks(program, where)
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
        stages, inside = _best_stages(program, blocks, count, size, options.cuts)
        plan = program.plan.pp = PpPlan(
            size=size,
            schedule=options.schedule,
            microbatches=microbatches,
            stages=stages,
            stages_per_rank=per_rank,
            split_points=tuple(s.start for s in stages[1:]),
            microbatch_rows=rows // microbatches,
            tied=tied,
            dp=world // size,
            inside_blocks=inside,
        )
        stats = {"stages": count, "imbalance": round(plan.imbalance, 3), "bubble": plan.bubble}
        return PassResult(changed=True, stats=stats, notes=(plan.describe(),))


#: The imbalance (max / mean stage FLOPs) accepted before stages are cut inside blocks: at
#: block boundaries a head that weighs half a block (Llama-2-7B's) leaves 1.20 for 8 blocks on
#: 4 stages and 1.13 for 12, which a cut between a block's attention and its MLP brings to 1.14
#: and 1.09.
IMBALANCE_GOAL = 1.10
#: How deep inside a block a stage may begin: at blocks, or where one of its children begins
#: (between attention and MLP). Deeper points (inside an attention) hand the next stage values
#: laid out as the graph left them (a transposed query), which torch's stages receive into
#: buffers of the same strides and gloo refuses: not offered (cut_units can list them).
DEPTHS = (0, 1)


def cut_units(program: Program, blocks: list[str], depth: int | None) -> list[tuple[str, str, int]]:
    """The model's blocks as units stages are made of, in call order: (module a unit begins
    at, its block, its FLOPs). depth 0: whole blocks; deeper: each block cut where a
    submodule's call begins (at most `depth` levels down, None: any), at each point where the
    FLOPs done so far grow (annotate_shapes' call timeline; the earliest call at a point: the
    fewest values cross it)."""
    units = []
    for block in blocks:
        total = _flops(program, block)
        calls = _calls(program, block) if depth != 0 else []
        starts, last = [(block, 0)], 0
        for name, at in calls:
            deep = name.count(".") + 1
            if name and last < at < total and (depth is None or deep <= depth):
                starts.append((f"{block}.{name}", at))
                last = at
        ends = [at for _, at in starts[1:]] + [total]
        units += [(start, block, end - at) for (start, at), end in zip(starts, ends, strict=True)]
    return units


def _best_stages(
    program: Program, blocks: list[str], count: int, size: int, cuts: str
) -> tuple[tuple[PpStage, ...], bool]:
    """Stages at block boundaries; with cuts=auto, also where a block's children begin when the
    imbalance exceeds IMBALANCE_GOAL and that lowers it; whether a stage begins inside a
    block. The glue after the blocks (the model's FLOPs less theirs) weighs on the last."""
    tail = max((program.analysis.flops or 0) - sum(_flops(program, b) for b in blocks), 0)
    best: tuple[float, tuple[PpStage, ...], bool] | None = None
    for depth in DEPTHS if cuts == "auto" else (0,):
        units = cut_units(program, blocks, depth)
        if len(units) < count:
            continue
        costs = [cost for _, _, cost in units]
        stages = tuple(
            PpStage(
                index=i,
                start="" if i == 0 else units[a][0],
                blocks=tuple(dict.fromkeys(block for _, block, _ in units[a:b])),
                cost=sum(costs[a:b]) + (tail if i == count - 1 else 0),
                rank=i % size,
            )
            for i, (a, b) in enumerate(balance(costs, tail, count))
        )
        imbalance = stage_imbalance(stages)
        if best is None or imbalance < best[0]:
            best = (imbalance, stages, depth != 0)
        if best[0] <= IMBALANCE_GOAL:
            break
    assert best is not None  # depth 0 has a unit per block, and blocks >= count
    return best[1], best[2]


def stage_starts(program: Program, count: int, cuts: str = "auto") -> list[str]:
    """Where `count` stages of the program's model begin, balanced as the pass balances them
    (its planner, for callers that pipeline a model themselves: prepare_pippy); the first
    stage begins at the model's start and is not listed."""
    where = f"{count} pipeline stages"
    blocks = _blocks(program, where)
    if len(blocks) < count:
        raise TargetNotSupportedError(
            f"{where}: the model has {len(blocks)} repeated blocks ({blocks[0]} ...), fewer "
            f"than the {count} stages"
        )
    stages, _ = _best_stages(program, blocks, count, count, cuts)
    return [stage.start for stage in stages[1:]]


def module_stages(program: Program, plan: PpPlan) -> dict[str, int]:
    """The stage each module inside the cut blocks runs in: its block's, or under cuts inside
    blocks the stage whose span holds the start of its call."""
    starts = {stage.start: stage.index for stage in plan.stages[1:]}
    where: dict[str, int] = {}
    stage = 0
    for block in dict.fromkeys(b for s in plan.stages for b in s.blocks):
        stage = starts.get(block, stage)
        called = {name: at for name, at in _calls(program, block) if name}
        for name, _ in program.submodule(block).named_modules():
            if name and name not in called:
                where[f"{block}.{name}"] = stage
        where[block] = stage
        for name in called:
            stage = starts.get(f"{block}.{name}", stage)
            where[f"{block}.{name}"] = stage
    return where


def stage_parameters(program: Program, plan: PpPlan) -> list[list[nn.Parameter]]:
    """Per stage, the parameters of the modules it runs (a block cut inside is shared between
    two stages, module by module); the first stage also those registered before the first
    block (embeddings), the last those after the blocks (final norm, head). A weight tied
    across stages is in each."""
    inside = module_stages(program, plan)
    params: list[list[nn.Parameter]] = [[] for _ in plan.stages]
    seen_block = False
    for name, param in program.module.named_parameters(remove_duplicate=False):
        index = inside.get(name.rpartition(".")[0])
        seen_block = seen_block or index is not None
        if index is None:
            index = len(plan.stages) - 1 if seen_block else 0
        if all(p is not param for p in params[index]):
            params[index].append(param)
    return params


def _calls(program: Program, block: str) -> list[tuple[str, int]]:
    """annotate_shapes' call timeline of the block's region (its first repeat's)."""
    for region in program.regions:
        if block in region.paths:
            entry = (program.analysis.regions or {}).get(region.name, {})
            return [(name, int(at)) for name, at in entry.get("calls") or ()]
    return []


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


def _blocks(program: Program, where: str) -> list[str]:
    """The paths of the model's main repeated blocks (the largest group), in call order."""
    groups = sorted(program.blocks, key=lambda g: len(g.paths), reverse=True)
    if not groups or len(groups[0].paths) < 2:
        raise TargetNotSupportedError(
            f"{where}: {type(program.module).__name__} has no repeated blocks to cut into "
            "stages (find_blocks found none)"
        )
    return list(groups[0].paths)


def _flops(program: Program, path: str) -> int:
    for region in program.regions:
        if path in region.paths:
            entry = (program.analysis.regions or {}).get(region.name, {})
            return int(entry.get("flops_per_repeat") or 1)
    return 1


def _tied(program: Program) -> tuple[tuple[str, ...], ...]:
    """The names of each parameter shared by several modules (an LM head tied to the input
    embedding sits on the first and the last stage)."""
    owners: dict[int, list[str]] = {}
    for name, module in program.original.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(f"{name}.{pname}" if name else pname)
    return tuple(tuple(names) for names in owners.values() if len(names) > 1)
