"""split_stages (`pp[size=, schedule=, microbatches=, stages_per_rank=]`): the repeated blocks
cut into pipeline stages, one per rank (K per rank, looped, under interleaved-1f1b and
zero-bubble), balanced by the FLOPs annotate_shapes counted.

Contract: requires regions, shapes | provides pipeline | after -
    | numerics approx(rtol=1e-05, atol=1e-06) | options SplitStagesOptions

The cut needs no help from the user: find_blocks knows where the model repeats, and the stages
are contiguous runs of those blocks, the glue before them (embeddings) with the first stage
and the glue after them (final norm, head, loss) with the last. `balance` chooses the runs
that minimise the largest stage's FLOPs (an exact search over the cut points), counting the
head's FLOPs on the last stage. The record (`plan.pp`, a `PpPlan`) holds the stages, their
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

from retarget.core.errors import TargetNotSupportedError
from retarget.core.plans import PpPlan, PpStage
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
        sharded = program.plan.fsdp is not None or any(n in program.target for n in FSDP_STRATEGIES)
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
        costs = [_flops(program, path) for path in blocks]
        tail = max((program.analysis.flops or 0) - sum(costs), 0)
        runs = balance(costs, tail, count)
        stages = tuple(
            PpStage(
                index=i,
                blocks=tuple(blocks[a:b]),
                cost=sum(costs[a:b]) + (tail if i == count - 1 else 0),
                rank=i % size,
            )
            for i, (a, b) in enumerate(runs)
        )
        plan = program.plan.pp = PpPlan(
            size=size,
            schedule=options.schedule,
            microbatches=microbatches,
            stages=stages,
            stages_per_rank=per_rank,
            split_points=tuple(s.blocks[0] for s in stages[1:]),
            microbatch_rows=rows // microbatches,
            tied=tied,
            dp=world // size,
        )
        stats = {"stages": count, "imbalance": round(plan.imbalance, 3), "bubble": plan.bubble}
        return PassResult(changed=True, stats=stats, notes=(plan.describe(),))


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
