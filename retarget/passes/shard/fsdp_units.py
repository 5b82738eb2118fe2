"""FSDP2 units: which modules `fully_shard` is called on and what each rank holds of them.

`plan_units`: every repeated block find_blocks found is a unit and the root the last one
(holding everything else); a block sharing parameters with modules outside it, or smaller than
`min_params`, stays in the root; with `capture="whole"` the root is the only unit (its graph
reads the blocks' parameters itself). `stage_units`: under fsdp+pp one unit per pipeline stage
(PP_UNITS says why). `Unit.per_rank` counts the elements each rank holds (FSDP2 chunks dim 0 of
every parameter in torch.chunk pieces; under fsdp+tp what tp left on a rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from retarget.ir.program import Program
from retarget.passes.shard.stage_cuts import stage_parameters
from retarget.passes.shard.tp_params import fsdp_shapes

ROOT_UNIT = ""


@dataclass(frozen=True)
class Unit:
    """One fully_shard call: the module at `path` ("" is the root) and what it holds."""

    path: str
    block_type: str
    parameters: int
    shapes: tuple[tuple[int, ...], ...]
    """The shapes FSDP2 chunks on dim 0 (under fsdp+tp: what tp left on a rank)."""
    whole: tuple[tuple[int, ...], ...] = ()
    """Shapes every rank keeps whole (fsdp+tp's fused parts that no dim lets dp divide)."""

    def per_rank(self, mesh: tuple[int, ...]) -> list[int]:
        """Elements each rank holds, in rank order (mesh rows are replica groups)."""
        shards = mesh[-1]
        kept = sum(math.prod(shape) for shape in self.whole)
        return [
            kept + sum(local_numel(shape, shards, rank % shards) for shape in self.shapes)
            for rank in range(math.prod(mesh))
        ]


def plan_units(program: Program, min_params: int, dp: int = 1) -> tuple[list[Unit], list[str]]:
    """The repeated blocks that become units, then the root unit; notes on blocks kept out.
    `dp`: the ranks a unit is sharded over (under fsdp+tp, fused parts may be kept whole)."""
    root = program.module
    owners: dict[int, set[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), set()).add(name)
    units: list[Unit] = []
    taken: set[int] = set()
    notes: list[str] = []
    # fsdp+tp: FSDP shards what tp left on each rank (tp's plan runs first).
    tp = program.plan.tp
    split, kept_whole = fsdp_shapes(program, tp, dp) if tp is not None else ({}, set())

    def unit(path: str, block_type: str, params: list[nn.Parameter]) -> Unit:
        return Unit(
            path,
            block_type,
            sum(p.numel() for p in params),
            tuple(split.get(id(p), tuple(p.shape)) for p in params if id(p) not in kept_whole),
            tuple(split[id(p)] for p in params if id(p) in kept_whole),
        )

    whole = next((r for r in program.regions if "" in r.paths and not r.eager_only), None)
    if whole is not None and program.blocks:
        # The root's graph reads the blocks' parameters itself instead of calling the blocks,
        # so a block's FSDP hooks would never gather them: the root is the only unit.
        notes.append(
            "the whole model runs as one captured graph (capture='whole'): blocks are not "
            "called as modules, so the root is the only FSDP unit"
        )
    for group in program.blocks if whole is None else ():
        for path in group.paths:
            params = _unique(program.submodule(path))
            count = sum(p.numel() for p in params)
            shared = any(not n.startswith(path + ".") for p in params for n in owners[id(p)])
            if shared or count < min_params:
                why = (
                    "shares parameters with modules outside it"
                    if shared
                    else (f"{count:,} parameters < min_params={min_params:,}")
                )
                notes.append(f"{path}: stays in the root unit ({why})")
                continue
            units.append(unit(path, group.block_type, params))
            taken.update(id(p) for p in params)
    rest = [p for p in _unique(root) if id(p) not in taken]
    units.append(unit(ROOT_UNIT, type(program.original).__name__, rest))
    return units, notes


#: Why fsdp+pp shards each stage as one unit.
PP_UNITS = (
    "fsdp+pp: each pipeline stage is one fully_shard unit over the dp ranks of its stage "
    "(torch's pipeline split runs a stage as one graph that reads its blocks' parameters "
    "itself, so a block's own FSDP hooks would never run); a rank gathers its stage's "
    "parameters at once"
)


def stage_units(program: Program) -> list[Unit]:
    """Under fsdp+pp, one unit per pipeline stage: the parameters of what it runs
    (stage_cuts.stage_parameters; a weight tied across stages is in both)."""
    pp = program.plan.pp
    return [
        Unit(
            f"{stage.start or stage.blocks[0]} .. {stage.blocks[-1]}",
            f"pipeline stage {stage.index}",
            sum(p.numel() for p in params),
            tuple(tuple(p.shape) for p in params),
        )
        for stage, params in zip(pp.stages, stage_parameters(program, pp), strict=True)
    ]


def _unique(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters())


def local_numel(shape: tuple[int, ...], shards: int, index: int) -> int:
    """Elements of a parameter of `shape` that shard `index` of `shards` holds (dim-0 chunks)."""
    if not shape:
        return 1 if index == 0 else 0
    rows = shape[0]
    chunk = math.ceil(rows / shards)
    start = index * chunk
    return max(0, min(rows, start + chunk) - start) * math.prod(shape[1:])


def unit_note(unit: Unit, mesh: tuple[int, ...]) -> str:
    per_rank = unit.per_rank(mesh)
    shown = ", ".join(f"{n:,}" for n in per_rank[:8]) + (" ..." if len(per_rank) > 8 else "")
    where = unit.path or "<root>"
    return f"unit {where} ({unit.block_type}): {unit.parameters:,} parameters; per rank {shown}"
