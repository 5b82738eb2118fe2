"""Where pipeline stages begin and what each one holds: the planner split_stages runs (and
prepare_pippy calls for its auto split), and the per-stage membership fsdp+pp's units and the
memory estimate read.

`balance` is an exact minimax search over the cut points of a cost list; `cut_units` lists the
units stages are made of (whole blocks, or a block cut where one of its children begins, at the
points annotate_shapes' call timeline records); `best_stages` tries whole blocks first and
deeper units only while the imbalance is above IMBALANCE_GOAL. `module_stages` and
`stage_parameters` say which stage runs each module and holds each parameter.
"""

from __future__ import annotations

from torch import nn

from retarget.core.errors import TargetNotSupportedError
from retarget.core.plans import PpPlan, PpStage, stage_imbalance
from retarget.ir.program import Program


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


#: The imbalance (max / mean stage FLOPs) accepted before stages are cut inside blocks: at
#: block boundaries a head that weighs half a block (Llama-2-7B's) leaves 1.20 for 8 blocks on
#: 4 stages and 1.13 for 12, which a cut between a block's attention and its MLP brings to 1.14
#: and 1.09, and cuts between projections (DEPTHS) to 1.04 for 8.
IMBALANCE_GOAL = 1.10
#: How deep inside a block a stage may begin: at blocks, where one of its children begins
#: (between attention and MLP), or where a grandchild's call begins (inside an attention or an
#: MLP, between its projections): 1.14 -> 1.04 for 8 Llama-2-7B blocks on 4 stages. Values
#: crossing such a point may be strided (the query, transposed per head), which gloo cannot
#: receive: the pipeline sends them contiguous (execution/pipeline_split.py).
DEPTHS = (0, 1, 2)


def cut_units(program: Program, blocks: list[str], depth: int | None) -> list[tuple[str, str, int]]:
    """The model's blocks as units stages are made of, in call order: (module a unit begins
    at, its block, its FLOPs). depth 0: whole blocks; deeper: each block cut where a
    submodule's call begins (at most `depth` levels down, None: any), at each point where the
    FLOPs done so far grow (annotate_shapes' call timeline; the earliest call at a point: the
    fewest values cross it)."""
    units = []
    for block in blocks:
        total = block_flops(program, block)
        calls = call_timeline(program, block) if depth != 0 else []
        starts, last = [(block, 0)], 0
        for name, at in calls:
            deep = name.count(".") + 1
            if name and last < at < total and (depth is None or deep <= depth):
                starts.append((f"{block}.{name}", at))
                last = at
        ends = [at for _, at in starts[1:]] + [total]
        units += [(start, block, end - at) for (start, at), end in zip(starts, ends, strict=True)]
    return units


def best_stages(
    program: Program, blocks: list[str], count: int, size: int, cuts: str
) -> tuple[tuple[PpStage, ...], bool]:
    """Stages at block boundaries; with cuts=auto, also where a block's children begin when the
    imbalance exceeds IMBALANCE_GOAL and that lowers it; whether a stage begins inside a
    block. The glue after the blocks (the model's FLOPs less theirs) weighs on the last."""
    tail = max((program.analysis.flops or 0) - sum(block_flops(program, b) for b in blocks), 0)
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
    blocks = repeated_blocks(program, where)
    if len(blocks) < count:
        raise TargetNotSupportedError(
            f"{where}: the model has {len(blocks)} repeated blocks ({blocks[0]} ...), fewer "
            f"than the {count} stages"
        )
    stages, _ = best_stages(program, blocks, count, count, cuts)
    return [stage.start for stage in stages[1:]]


def module_stages(program: Program, plan: PpPlan) -> dict[str, int]:
    """The stage each module inside the cut blocks runs in: its block's, or under cuts inside
    blocks the stage whose span holds the start of its call."""
    starts = {stage.start: stage.index for stage in plan.stages[1:]}
    where: dict[str, int] = {}
    stage = 0
    for block in dict.fromkeys(b for s in plan.stages for b in s.blocks):
        stage = starts.get(block, stage)
        called = {name: at for name, at in call_timeline(program, block) if name}
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


def call_timeline(program: Program, block: str) -> list[tuple[str, int]]:
    """annotate_shapes' call timeline of the block's region (its first repeat's)."""
    for region in program.regions:
        if block in region.paths:
            entry = (program.analysis.regions or {}).get(region.name, {})
            return [(name, int(at)) for name, at in entry.get("calls") or ()]
    return []


def repeated_blocks(program: Program, where: str) -> list[str]:
    """The paths of the model's main repeated blocks (the largest group), in call order."""
    groups = sorted(program.blocks, key=lambda g: len(g.paths), reverse=True)
    if not groups or len(groups[0].paths) < 2:
        raise TargetNotSupportedError(
            f"{where}: {type(program.module).__name__} has no repeated blocks to cut into "
            "stages (find_blocks found none)"
        )
    return list(groups[0].paths)


def block_flops(program: Program, path: str) -> int:
    for region in program.regions:
        if path in region.paths:
            entry = (program.analysis.regions or {}).get(region.name, {})
            return int(entry.get("flops_per_repeat") or 1)
    return 1
