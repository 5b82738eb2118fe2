"""Hand tensor-parallel plans (`tp[plan=PKG.MODULE:NAME]`, `tp[plan=hf]`), checked on the graph.

A hand plan is a dict: module path or glob -> style. Styles are ours (`TP_STYLES`) or Hugging
Face's (`config.base_model_tp_plan`: colwise, rowwise, packed_colwise, colwise_gather_output,
rowwise_split_input, embedding_rowwise, replicated_with_grad_allreduce, sequence_parallel...),
mapped by `HF_STYLES`; a style with no counterpart is refused, naming the module. `plan=hf` reads
the model's own `config.base_model_tp_plan`, whose paths are relative to the base model (the
`base_model_prefix` submodule) and use `*` for layer indices.

Every glob must name at least one module, and a module two patterns name must get one style.
The plan is then checked the way the auto plan is derived: each region's graph is walked with
the hand's styles forced (`tp_chains.find_chains(forced=...)`), and the block's code is run on
one rank's share (`tp_widths`). A split the graph cannot run is refused with the module and
the reason: a row-wise Linear whose input is not the output of a column-wise chain, a chain that
leaves the block sharded, a norm over the sharded dim, heads that do not divide, a fused
projection split as if it were one, a region without a graph. Modules the plan leaves out are
replicated, and say so.

    >>> plan = read_hand_plan("hf", compiled.program, 2)
    >>> plan.source
    'config.base_model_tp_plan'
"""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Mapping

from torch import nn

from retarget.core.plans import TP_STYLES, TpPlan, TpRule
from retarget.ir.program import Program
from retarget.passes.shard.tp_chains import HandPlanConflict
from retarget.passes.shard.tp_derive import block_inputs, join_path, plan_block, vocab_rules
from retarget.passes.shard.tp_params import is_linear_like, plan_numel

#: Hugging Face's tp_plan styles -> (our style, fused parts along the split dim).
HF_STYLES: dict[str, tuple[str, int]] = {
    **{style: (style, 1) for style in TP_STYLES},
    "packed_colwise": ("colwise", 2),
    "colwise_gather_output": ("colwise_rep", 1),
    "rowwise_split_input": ("rowwise_rep", 1),
    "embedding_rowwise": ("rowwise_rep", 1),
    "replicated_with_grad_allreduce": ("replicate_grad_allreduce", 1),
    "replicated": ("replicate", 1),
}
#: Styles the graph walk checks (the others keep every activation whole).
CHAIN_STYLES = ("colwise", "rowwise")
SOURCE_HF = "config.base_model_tp_plan"


def read_hand_plan(
    spec: str | Mapping[str, str],
    program: Program,
    size: int,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> TpPlan:
    """The hand plan `spec` for a degree of `size`, expanded to module paths and checked."""
    entries, prefix, source = _load(spec, program.module)
    styles, fused = expand(entries, program.module, prefix)
    rules: dict[str, TpRule] = {}
    fixes: dict[str, dict[str, int]] = {}
    inputs = block_inputs(program)
    for region in program.regions:
        by_styles: dict[tuple, list[str]] = {}
        for base in region.paths:  # repeats the plan styles alike are checked once
            forced = {_relative(p, base): s for p, s in styles.items() if _within(p, base)}
            by_styles.setdefault(tuple(sorted(forced.items())), []).append(base)
        for key, bases in by_styles.items():
            forced = dict(key)
            chained = any(s in CHAIN_STYLES for s in forced.values())
            if not chained or region.representative() is None:
                continue
            block = plan_block(
                program, region, size, inputs.get(region.paths[0]), sequence_parallel, forced
            )
            _check_fused(block.fused, fused, bases[0])
            if block.fused_widths:
                path, widths = next(iter(block.fused_widths.items()))
                raise HandPlanConflict(
                    f"the hand plan splits {join_path(bases[0], path)}, whose output the graph "
                    f"cuts into fused parts of unequal widths {list(widths)}: a hand plan cannot "
                    "declare those; use plan=auto, which splits each part on its own"
                )
            for base in bases:
                for relative, rule in block.rules.items():
                    if rule.style == "replicate" and relative not in forced:
                        rules.setdefault(join_path(base, relative), rule)
                fixes.update({join_path(base, p): dict(f) for p, f in block.fixes.items()})
    _refuse_unchecked(program, styles)
    for path, style in styles.items():
        rules[path] = TpRule(style=style, reason=f"{source}: {entries_reason(path, entries)}")
    if loss_parallel:
        for path, rule in vocab_rules(program.module, size, loss_parallel).items():
            rules.setdefault(path, rule)
    for path, module in program.module.named_modules():
        if path not in rules and (is_linear_like(module) or isinstance(module, nn.Embedding)):
            rules[path] = TpRule(style="replicate", reason=f"not in the hand plan ({source})")
    order = [path for path, _ in program.module.named_modules()]
    rules = {path: rules[path] for path in order if path in rules}
    per_rank, total = plan_numel(program.module, rules, size)
    return TpPlan(
        size=size,
        source=source,
        rules=rules,
        attribute_fixes=fixes,
        fused={p: n for p, n in fused.items() if n > 1},
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        per_rank_numel=per_rank,
        total_numel=total,
    )


def _check_fused(found: dict[str, int], declared: dict[str, int], base: str) -> None:
    """The graph's fused parts (relative to `base`) must be the ones the plan declares."""
    for relative, parts in found.items():
        path = join_path(base, relative)
        if declared.get(path, 1) != parts:
            raise HandPlanConflict(
                f"the hand plan splits {path} as {declared.get(path, 1)} part(s), but the graph "
                f"splits its output into {parts} fused parts along the features: each part must "
                "be split on its own (packed_colwise for 2)"
            )


def _load(spec: str | Mapping[str, str], model: nn.Module) -> tuple[Mapping, str, str]:
    """(entries, the prefix their paths are relative to, the plan's source name)."""
    if isinstance(spec, Mapping):
        return spec, "", "hand plan"
    if spec == "hf":
        config = getattr(model, "config", None)
        entries = getattr(config, "base_model_tp_plan", None)
        if not entries:
            raise ValueError(
                f"tp plan=hf: {type(model).__name__}'s config has no base_model_tp_plan; use "
                "plan=auto or a hand plan plan=PKG.MODULE:NAME"
            )
        prefix = getattr(model, "base_model_prefix", "")
        prefix = prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
        return entries, prefix, SOURCE_HF
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"tp plan={spec!r}: expected auto, hf or PKG.MODULE:NAME")
    try:
        entries = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"tp plan={spec!r}: cannot load it ({exc})") from None
    if not isinstance(entries, Mapping):
        raise ValueError(
            f"tp plan={spec!r} is a {type(entries).__name__}; a hand plan is a dict of module "
            "path or glob -> style"
        )
    return entries, "", spec


def expand(
    entries: Mapping[str, str], model: nn.Module, prefix: str = ""
) -> tuple[dict[str, str], dict[str, int]]:
    """Globs -> module paths, HF styles -> ours: ({path: style}, {path: fused parts})."""
    paths = [p for p, _ in model.named_modules() if p]
    styles: dict[str, str] = {}
    fused: dict[str, int] = {}
    for pattern, given in entries.items():
        full = join_path(prefix, pattern)
        matched = [p for p in paths if fnmatch.fnmatchcase(p, full)]
        if not matched:
            raise ValueError(f"tp hand plan: {pattern!r} names no module of {type(model).__name__}")
        if given not in HF_STYLES:
            raise ValueError(
                f"tp hand plan: {matched[0]} has style {given!r}, which retarget cannot apply; "
                f"styles: {', '.join(HF_STYLES)}"
            )
        style, parts = HF_STYLES[given]
        for path in matched:
            if styles.get(path, style) != style:
                raise ValueError(
                    f"tp hand plan: {path} is named twice, as {styles[path]} and {style}"
                )
            styles[path] = style
            if parts > 1:
                fused[path] = parts
    return styles, fused


def entries_reason(path: str, entries: Mapping[str, str]) -> str:
    keys = [k for k in entries if fnmatch.fnmatchcase(path, f"*{k}")]
    return f"{keys[0]} -> {entries[keys[0]]}" if keys else "named by the hand plan"


def _refuse_unchecked(program: Program, styles: dict[str, str]) -> None:
    """A chain style in a region without a graph cannot be checked: refused, not trusted."""
    for region in program.regions:
        if region.representative() is not None:
            continue
        for path, style in styles.items():
            if style in CHAIN_STYLES and any(_within(path, base) for base in region.paths):
                raise HandPlanConflict(
                    f"the hand plan makes {path} {style}, but region {region.name} has no "
                    f"graph to check it against ({region.reason or 'not captured yet'})"
                )


def _within(path: str, base: str) -> bool:
    return base == "" or path.startswith(base + ".")


def _relative(path: str, base: str) -> str:
    return path if base == "" else path[len(base) + 1 :]
