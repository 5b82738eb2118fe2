"""Derive the tensor-parallel plan (`tp[plan=auto]`) from the regions' graphs.

Per region, that is per distinct block type, once: `tp_chains.find_chains` walks its graph and
groups the Linears into chains (column-wise Linears, the ops that act per feature or per head,
row-wise Linears that close them with one all-reduce); `tp_widths.WidthCheck` runs the block's
own code on one rank's share to find the attributes that hold a full width (a head count) and
must be divided. The block's result, in paths relative to the block, is then expanded to every
repeat's module paths: the cost grows with the number of distinct blocks, not with depth.

A Linear that no complete chain covers is listed as "replicate" with the reason (the node where
its chain broke, a head count that does not divide, a region left eager), never dropped.
Outside the regions, the input embedding and the LM head are replicated, or vocab-parallel with
`loss_parallel` (embedding `rowwise_rep`, head `colwise`: the loss reads the logits split over
the vocabulary); any other Linear there is replicated. With `sequence_parallel`, the norms on
the replicated residual stream are `sequence_parallel`, and the rules at the stream's
boundaries say so (`passes/shard/tp_sequence.py`: a block's colwise Linears gather the sequence,
its rowwise Linears and the embedding scatter onto it, the head gathers it), after a run of the
example checks that nothing but the blocks and the final norm computes on the stream.

    >>> plan = derive_tp_plan(compiled.program, 2)
    >>> print(plan.describe())  # tp[size=2] (auto): 6 colwise, 4 rowwise, 5 replicate; ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from retarget.core.plans import TpPlan, TpRule
from retarget.ir.program import Program
from retarget.ir.region import Region
from retarget.passes.capture.capture_regions import record_inputs
from retarget.passes.shard.tp_chains import Chain, ChainAnalysis, HandPlanConflict, find_chains
from retarget.passes.shard.tp_layout import tensor_shape
from retarget.passes.shard.tp_params import fused_rows, is_linear_like, is_norm, plan_numel
from retarget.passes.shard.tp_sequence import linears_in_blocks, sequence_rules, stream_boundaries
from retarget.passes.shard.tp_widths import WidthCheck


@dataclass
class BlockPlan:
    """One region's result, in module paths relative to the block."""

    rules: dict[str, TpRule] = field(default_factory=dict)
    fixes: dict[str, dict[str, int]] = field(default_factory=dict)
    fused: dict[str, int] = field(default_factory=dict)
    fused_widths: dict[str, tuple[int, ...]] = field(default_factory=dict)
    fused_whole: dict[str, tuple[int, ...]] = field(default_factory=dict)


def derive_tp_plan(
    program: Program,
    size: int,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    whole_parts: bool = True,
) -> TpPlan:
    """The auto plan for a degree of `size` (module path -> style, with the reason).
    `whole_parts=False`: no fused part kept whole beside split ones (under fsdp+tp)."""
    if size < 1:
        raise ValueError(f"tp size must be at least 1, got {size}")
    rules: dict[str, TpRule] = {}
    fixes: dict[str, dict[str, int]] = {}
    fused: dict[str, int] = {}
    fused_widths: dict[str, tuple[int, ...]] = {}
    fused_whole: dict[str, tuple[int, ...]] = {}
    inputs = block_inputs(program)
    for region in program.regions:
        block = plan_block(
            program,
            region,
            size,
            inputs.get(region.paths[0]),
            sequence_parallel,
            whole_parts=whole_parts,
        )
        for base in region.paths:
            rules.update({join_path(base, p): rule for p, rule in block.rules.items()})
            fixes.update({join_path(base, p): dict(f) for p, f in block.fixes.items()})
            fused.update({join_path(base, p): n for p, n in block.fused.items()})
            fused_widths.update({join_path(base, p): w for p, w in block.fused_widths.items()})
            fused_whole.update({join_path(base, p): w for p, w in block.fused_whole.items()})
    blocks = {path for region in program.regions for path in region.paths}
    named = list(program.module.named_modules())
    rules.update(outside_rules(named, rules, blocks, sequence_parallel))
    rules.update(vocab_rules(program.module, size, loss_parallel, named))
    rules = {path: rules[path] for path, _ in named if path in rules}
    if sequence_parallel:
        rules = split_sequence(program, rules, named)

    def colwise(by_path: dict[str, Any]) -> dict[str, Any]:  # fused parts of the split ones
        return {p: v for p, v in by_path.items() if p in rules and rules[p].style == "colwise"}

    widths, whole = colwise(fused_widths), colwise(fused_whole)
    per_rank, total = plan_numel(program.module, rules, size, fused_rows(widths, whole, size))
    return TpPlan(
        size=size,
        source="auto",
        rules=rules,
        attribute_fixes=fixes,
        fused=colwise(fused),
        fused_widths=widths,
        fused_whole=whole,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        per_rank_numel=per_rank,
        total_numel=total,
    )


def split_sequence(
    program: Program, rules: dict[str, TpRule], named: list[tuple[str, nn.Module]]
) -> dict[str, TpRule]:
    """The rules with sequence parallelism's boundaries, after checking the model's code
    between the embedding, the blocks and the head (`tp_sequence.stream_boundaries`)."""
    paths = {id(m): p for p, m in named}
    embedding, head = (
        paths.get(id(_hf_module(program.module, g)))
        for g in ("get_input_embeddings", "get_output_embeddings")
    )
    blocks = [path for region in program.regions for path in region.paths]
    order = {path: i for i, (path, _) in enumerate(named)}
    blocks.sort(key=order.__getitem__)
    norms = [
        p
        for p, r in rules.items()
        if r.style == "sequence_parallel" and _enclosing(p, set(blocks)) is None
    ]
    bounds = stream_boundaries(program, embedding, blocks, norms, head)
    return sequence_rules(rules, linears_in_blocks(program.module, blocks), embedding, head, bounds)


def block_inputs(program: Program) -> dict:
    if program.example is None:
        return {}
    firsts = [r.paths[:1] for r in program.regions if r.representative() is not None]
    return record_inputs(program.module, firsts, program.example)


def analyse_region(program: Program, region: Region, size: int, **kwargs) -> ChainAnalysis | None:
    """find_chains on the region's representative graph (None: the region has no graph)."""
    graph = region.representative()
    if graph is None:
        return None
    root = program.submodule(region.paths[0])
    return find_chains(graph.gm, root, size, state_outputs=state_outputs(graph), **kwargs)


def state_outputs(graph) -> int:
    """How many trailing flat outputs of a graph are a KV cache's tensors."""
    if graph.state is None:
        return 0
    return graph.gm._out_spec.child(1).num_leaves


def graph_output_shape(graph) -> tuple[int, ...] | None:
    """The shape of the graph's first output tensor, as the frontend recorded it."""
    output = next(n for n in graph.gm.graph.nodes if n.op == "output")
    first = next(iter(output.all_input_nodes), None)
    return tensor_shape(first) if first is not None else None


def plan_block(
    program: Program,
    region: Region,
    size: int,
    inputs,
    sequence_parallel: bool,
    forced: dict[str, str] | None = None,
    *,
    whole_parts: bool = True,
) -> BlockPlan:
    """One region's rules; with `forced` (a hand plan's styles, relative paths) a chain the
    block cannot run split is a HandPlanConflict instead of a replicated chain."""
    block = program.submodule(region.paths[0])
    plan = BlockPlan()
    analysis = analyse_region(program, region, size, forced=forced, whole_parts=whole_parts)
    if analysis is None:
        why = region.reason or "not captured yet (no example inputs)"
        for path, module in block.named_modules():
            if is_linear_like(module):
                plan.rules[path] = TpRule(
                    style="replicate", reason=f"region {region.name} has no graph ({why})"
                )
        return plan
    complete = [c for c in analysis.chains if c.complete]
    if inputs is not None and complete:
        _check_widths(region, block, inputs, analysis, complete, plan, size, forced)
    for chain in analysis.chains:
        chain_rules(chain, plan)
    for path, module in block.named_modules():
        if path not in plan.rules and is_linear_like(module):
            plan.rules[path] = TpRule(
                style="replicate", reason=f"not computed as a Linear in {region.name}'s graph"
            )
        elif sequence_parallel and path not in plan.rules and is_norm(module):
            plan.rules[path] = TpRule(
                style="sequence_parallel",
                reason="norm on the replicated residual stream: split on the sequence dim",
            )
    if inputs is None and complete:
        for path, rule in plan.rules.items():
            if rule.style != "replicate":
                plan.rules[path] = TpRule(
                    style=rule.style,
                    reason=rule.reason + "; widths not checked (no example inputs)",
                )
    return plan


def _check_widths(region, block, inputs, analysis, complete, plan, size, forced) -> None:
    """Run the block's code on one rank's share of each complete chain: a chain whose code
    cannot run split breaks (or, under a hand plan, is a HandPlanConflict); the attribute
    fixes it needs go into `plan.fixes`."""
    expected = graph_output_shape(region.representative())
    check = WidthCheck(block, *inputs, analysis.linears, size, expected)
    for chain, (found, why) in zip(complete, check.all_fixes(complete).values(), strict=True):
        if why and forced is not None:
            raise HandPlanConflict(
                f"the hand plan splits {', '.join(chain.members)} in {region.name}, but {why}"
            )
        if why:
            chain.breaks.append(why)
        for path, name, value in found:
            plan.fixes.setdefault(path, {})[name] = value


def chain_rules(chain: Chain, plan: BlockPlan) -> None:
    if chain.complete:
        closed = ", ".join(chain.rowwise)
        for path in chain.colwise:
            parts = chain.fused.get(path, 1)
            reason = f"starts a chain closed row-wise by {closed}"
            if parts > 1:
                plan.fused[path] = parts
                reason += f"; its output is {parts} fused parts, each split on its own"
            if path in chain.parts:
                plan.fused_widths[path] = chain.parts[path]
                reason += (
                    f"; its output is fused parts of {list(chain.parts[path])} features, each "
                    "split on its own"
                )
            if path in chain.whole_parts:
                plan.fused_whole[path] = chain.whole_parts[path]
                reason += (
                    f" but parts {list(chain.whole_parts[path])}, kept whole on every rank "
                    "(their heads do not divide; their gradients are summed over the ranks)"
                )
            plan.rules[path] = TpRule(style="colwise", reason=reason)
        for path in chain.rowwise:
            plan.rules[path] = TpRule(
                style="rowwise",
                reason=f"closes the chain from {', '.join(chain.colwise)} (one all-reduce)",
            )
        for name in chain.per_shard_params:
            plan.rules[name.rpartition(".")[0]] = TpRule(
                style="replicate_grad_allreduce",
                reason="reads each rank's own heads: its gradient is partial on each rank and "
                "must be all-reduced over the tp ranks",
            )
        return
    why = chain.breaks[0] if chain.breaks else "no row-wise Linear closes the chain"
    for path in chain.members:
        plan.rules[path] = TpRule(
            style="replicate",
            reason=f"chain {', '.join(chain.colwise)} cannot be split: {why}",
        )


def outside_rules(
    named: list[tuple[str, nn.Module]],
    covered: dict[str, TpRule],
    blocks: set[str],
    sequence_parallel: bool,
) -> dict[str, TpRule]:
    """Linears and embeddings no chain covers are replicated; with sequence parallelism the
    norms outside the blocks are split on the sequence dim."""
    rules = {}
    for path, module in named:
        if path in covered:
            continue
        inside = _enclosing(path, blocks)
        if is_linear_like(module) or isinstance(module, nn.Embedding):
            where = (
                f"in block {inside or '<model>'}" if inside is not None else "outside the blocks"
            )
            rules[path] = TpRule(style="replicate", reason=f"{where}: on no chain")
        elif sequence_parallel and inside is None and is_norm(module):
            rules[path] = TpRule(
                style="sequence_parallel",
                reason="norm on the replicated residual stream: split on the sequence dim",
            )
    return rules


def vocab_rules(
    model: nn.Module, size: int, loss_parallel: bool, named: list | None = None
) -> dict[str, TpRule]:
    """The input embedding and the LM head: replicated, or split over the vocabulary."""
    paths = {id(m): p for p, m in (named if named is not None else model.named_modules())}
    embedding, head = (
        _hf_module(model, "get_input_embeddings"),
        _hf_module(model, "get_output_embeddings"),
    )
    if loss_parallel and head is None:
        raise ValueError(
            "tp loss_parallel=true needs an LM head (the model's get_output_embeddings()); "
            f"{type(model).__name__} has none: drop loss_parallel"
        )
    rules = {}
    for module, split, what in ((embedding, "rowwise_rep", "input"), (head, "colwise", "head")):
        if module is None or id(module) not in paths:
            continue
        vocab = module.weight.shape[0]
        if loss_parallel and vocab % size:
            raise ValueError(
                f"tp loss_parallel=true splits the vocabulary ({vocab}) of {paths[id(module)]} "
                f"over {size} ranks, which does not divide it: pad the vocabulary or drop "
                "loss_parallel"
            )
        name = "input embedding" if what == "input" else "LM head"
        rules[paths[id(module)]] = (
            TpRule(
                style=split,
                reason=f"{name}: split over the vocabulary (loss_parallel)",
                vocab_output=what == "head",
            )
            if loss_parallel
            else TpRule(style="replicate", reason=f"{name}: replicated (loss_parallel is off)")
        )
    return rules


def _enclosing(path: str, blocks: set[str]) -> str | None:
    """The block path that contains `path` (its nearest ancestor among `blocks`)."""
    parts = path.split(".")
    for end in range(len(parts) - 1, -1, -1):
        candidate = ".".join(parts[:end])
        if candidate in blocks:
            return candidate
    return None


def _hf_module(model: nn.Module, method: str) -> nn.Module | None:
    getter = getattr(model, method, None)
    if getter is None:
        return None
    try:
        module = getter()
    except (NotImplementedError, AttributeError):
        return None
    return module if isinstance(module, nn.Module) and hasattr(module, "weight") else None


def join_path(base: str, relative: str) -> str:
    return ".".join(p for p in (base, relative) if p)
