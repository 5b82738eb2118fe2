"""shard_tp (`tp[size=N, plan=auto|hf|PKG.MODULE:NAME]`): split modules across a tp group.

Contract: requires regions | provides tp
    | after swap_fp8, insert_autocast, checkpoint_blocks, compile_regions | numerics exact
    | options TpOptions

Where the plan comes from (`plan=`):
- auto: derived from the regions' graphs (`passes.shard.tp_derive.derive_tp_plan`);
- hf: the model config's `base_model_tp_plan` (`passes.shard.tp_hand_plan.read_hand_plan`);
- PKG.MODULE:NAME: a TpPlan record, used as given, or a dict of module path or glob -> style
  (read by read_hand_plan).
Both readers are imported when asked for: a build without them refuses `plan=` by name.

The pass checks the plan against the model, refusing (TargetNotSupportedError, naming the
module and why) a rule on a missing module, a style no splitter implements for that kind of
module (core.tp_split_dims: nn.Linear, nn.Embedding, GPT-2's Conv1D), a split dim the degree does
not divide (a fused q|k|v dim: each part), and sequence_parallel/loss_parallel with plan=hf or
a dict (derived only: the stream's boundaries come from the graph walk and a run of the example;
`passes.shard.tp_sequence`). It records the plan with its per-rank parameter counts
(`program.plan.tp`, a TpPlan); the runtime applies it with torch's parallel styles over the
"tp" dim of the mesh (`execution.apply_tp`), after which FSDP2 (fsdp+tp) shards over "dp".

Regions: torch's styles convert each split module's inputs and outputs in module hooks, which
a graph captured before the split does not have, so every region holding a split module forgets
its graphs and captures again at its first call after the split (dynamo traces the hooks into
the graph: DTensor from_local / redistribute / to_local around each split Linear); the rewrites
recorded on the region (autocast islands, checkpointing) are replayed on the new graph and
compile compiles it, once per block type. The report says which regions.

Mesh: tp alone fills the world (size = processes); with fsdp/zero2/zero3 the mesh is
(dp, tp) = (world / size, size), tp innermost, as torchtitan lays it out. The degree is read from
`program.parallel_dims()` (core/parallel_dims.py checks it against the world).
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn

from retarget.core.errors import TargetNotSupportedError
from retarget.core.plans import TP_STYLES, TpPlan, TpRule
from retarget.core.tp_split_dims import (
    COLWISE_STYLES,
    get_width,
    module_kind,
    split_dims,
)
from retarget.execution.tp_regions import regions_holding_split_modules
from retarget.ir.program import Program
from retarget.kernels.quant.linear import QuantizedLinear
from retarget.passes.base import Pass, PassResult
from retarget.passes.shard.tp_beside_pp import blocks_only, refuse_beside_pp
from retarget.passes.shard.tp_params import per_rank_of
from retarget.targets.grammar import Target
from retarget.targets.strategies import FSDP_STRATEGIES


@dataclass(frozen=True, kw_only=True)
class TpOptions:
    """What `tp[...]` asks for, and whether a data-parallel strategy shares the world."""

    size: int = 0
    """The tensor-parallel degree; 0: the whole world (tp alone)."""
    plan: str = "auto"
    """auto | hf | PKG.MODULE:NAME (see the module docstring)."""
    sequence_parallel: bool = False
    """Split the residual stream between blocks on the sequence (plan=auto; derived by
    passes.shard.tp_sequence, applied with torch's SequenceParallel and Shard(1) layouts)."""
    loss_parallel: bool = False
    """Keep the LM head's logits split over the vocabulary; the loss runs under torch's
    loss_parallel() (plan=auto)."""
    async_tp: bool = False
    """torch's async TP (inductor's micro-pipelined all-gather/reduce-scatter matmuls over
    symmetric memory): CUDA, compile[backend=inductor] and sequence_parallel only."""
    data_parallel: str = ""
    """The fsdp-family part beside tp ("" when tp runs alone)."""
    pipeline: bool = False
    """pp beside tp: each pipeline stage runs on a tp group (execution/pipeline_tp.py)."""
    compile_backend: str = ""
    """The backend of the compile part beside tp ("" without one): async_tp needs inductor."""

    @classmethod
    def from_target(cls, target: Target) -> TpOptions:
        values = target.get("tp").as_dict()
        dp = next((n for n in FSDP_STRATEGIES if n in target), "")
        return cls(
            size=values["size"],
            plan=values["plan"],
            sequence_parallel=values["sequence_parallel"],
            loss_parallel=values["loss_parallel"],
            async_tp=values["async_tp"],
            data_parallel=dp,
            pipeline="pp" in target,
            compile_backend=target.get("compile").get("backend") if "compile" in target else "",
        )


class ShardTp(Pass):
    name = "shard_tp"
    summary = "tensor parallelism: module path -> colwise/rowwise style over the tp mesh (plan)"
    requires = ("regions",)
    provides = ("tp",)
    # The split modules are the final ones (fp8 is refused beside tp); each block recomputes
    # (ac) and casts (autocast) around the DTensor ops torch's styles install.
    after = ("swap_fp8", "insert_autocast", "checkpoint_blocks", "compile_regions")
    Options = TpOptions

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        if "tp" not in target:
            return []
        return [cls(TpOptions.from_target(target))]

    def run(self, program: Program) -> PassResult:
        options = self.options
        _refuse_unimplemented(options)
        if options.async_tp:
            refuse_async_tp_where_it_cannot_run(program, options)
        quantized = [p for p, m in program.module.named_modules() if isinstance(m, QuantizedLinear)]
        if quantized:
            raise TargetNotSupportedError(
                f"tp: {quantized[0]} (and {len(quantized) - 1} more) is a quantized Linear (a "
                "model loaded with load_and_quantize_model): splitting its packed weight is not "
                "implemented; shard it with fsdp instead"
            )
        if options.pipeline:
            refuse_beside_pp(options)
        size = program.parallel_dims().tp  # dividing the world, filling it unless dp or pp
        plan = resolve_plan(program, options, size)
        plan = _with_counts(check_plan(program, plan), program)
        plan = dataclasses.replace(plan, async_tp=options.async_tp)
        whole: list[str] = []
        if options.pipeline:
            plan, whole = blocks_only(program, plan)
        changed, program.plan.tp = program.plan.tp != plan, plan
        split_regions = [] if options.pipeline else regions_holding_split_modules(program, plan)
        recaptured = [region.name for region in split_regions]
        notes = [plan.describe()]
        if whole:
            warning = (
                f"tp+pp: {', '.join(whole)} kept whole on every tp rank: inside a pipeline "
                "stage tp splits the repeated blocks only"
            )
            warnings.warn(warning, stacklevel=2)
            notes.append(warning)
        notes += [f"{path}: {rule.style} ({rule.reason})" for path, rule in plan.rules.items()]
        notes += [f"{p}: each of {n} fused parts split on its own" for p, n in plan.fused.items()]
        notes += [
            f"{p}: each of its fused parts of {list(w)} split on its own (stored in rank order)"
            for p, w in plan.fused_widths.items()
        ]
        notes += [f"{p}: per rank {fixes}" for p, fixes in plan.attribute_fixes.items()]
        again = "captured again once split"
        if program.capture == "auto":  # execution/tp_regions.py: only if its graphs are read
            again += " if a rewrite or compile reads its graphs, else runs its own forward"
        notes += [f"region {name}: {again}" for name in recaptured]
        # beside pp the rest is (pp x dp): split_stages says how it divides
        beside = options.data_parallel or options.pipeline
        mesh = [program.parallel_dims().world_size // size, size] if beside else [size]
        stats = {"size": size, "rules": len(plan.rules), "mesh": mesh}
        return PassResult(changed=changed, stats=stats, notes=tuple(notes))


def _refuse_unimplemented(options: TpOptions) -> None:
    """Sequence and loss parallelism are derived with the plan (their boundary rules need the
    graph walk and a run of the example); a hand plan carries only styles."""
    for option in ("sequence_parallel", "loss_parallel"):
        if getattr(options, option) and options.plan == "hf":
            raise TargetNotSupportedError(
                f"tp[{option}=true, plan=hf]: the config's base_model_tp_plan says nothing of "
                f"where the stream is split; use plan=auto, which derives the {option} rules"
            )


def refuse_async_tp_where_it_cannot_run(program: Program, options: TpOptions) -> None:
    """Async TP is inductor's rewrite of the sequence-parallel all-gather + matmul (and matmul +
    reduce-scatter) pairs into micro-pipelined kernels over CUDA symmetric memory: without CUDA
    parameters, inductor or sequence parallelism there is nothing it can do, so it is refused
    by name rather than silently ignored."""
    devices = {p.device.type for p in program.module.parameters()}
    why = ""
    if devices != {"cuda"}:
        why = f"it needs CUDA (symmetric memory); the model's parameters are on {sorted(devices)}"
    elif options.compile_backend.lower() != "inductor":
        why = "inductor does the overlap: add compile[backend=inductor]"
    elif not options.sequence_parallel:
        why = "it overlaps the sequence all-gathers: add sequence_parallel=true"
    if why:
        raise TargetNotSupportedError(f"tp[async_tp=true]: {why}; or drop async_tp")


def resolve_plan(program: Program, options: TpOptions, size: int) -> TpPlan:
    """The TpPlan `plan=` names: derived, read from a hand plan, or a TpPlan object as given."""
    if options.plan == "auto":
        derive = _reader("retarget.passes.shard.tp_derive", "derive_tp_plan", "tp[plan=auto]")
        return derive(
            program,
            size,
            sequence_parallel=options.sequence_parallel,
            loss_parallel=options.loss_parallel,
            # Parts kept whole sum their gradient with a hook on the parameter, which FSDP2
            # replaces; their stream input under sequence parallelism is not tested.
            whole_parts=not options.data_parallel and not options.sequence_parallel,
        )
    if options.plan != "hf":
        given = _referenced(options.plan)
        if isinstance(given, TpPlan):
            if given.size != size:
                raise TargetNotSupportedError(
                    f"tp[plan={options.plan}]: the plan is for size {given.size}, the target "
                    f"asks for size {size}"
                )
            for option in ("sequence_parallel", "loss_parallel"):
                if getattr(options, option) != getattr(given, option):
                    raise TargetNotSupportedError(
                        f"tp[plan={options.plan}]: the target says {option}="
                        f"{str(getattr(options, option)).lower()}, the plan record "
                        f"{option}={getattr(given, option)}; make them agree"
                    )
            return given
        if options.sequence_parallel or options.loss_parallel:
            raise TargetNotSupportedError(
                f"tp[plan={options.plan}]: a dict of styles says nothing of where the stream "
                "is split; use plan=auto with sequence_parallel/loss_parallel, or name a TpPlan "
                "record that sets them"
            )
    read = _reader(
        "retarget.passes.shard.tp_hand_plan", "read_hand_plan", f"tp[plan={options.plan}]"
    )
    return read(options.plan, program, size)


def _reader(module: str, name: str, asked: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise TargetNotSupportedError(
            f"{asked}: this build has no {module}.{name} ({exc}); name a TpPlan record instead, "
            "tp[plan=PKG.MODULE:NAME]"
        ) from exc


def _referenced(spec: str) -> Any:
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise TargetNotSupportedError(f"tp[plan={spec}]: cannot import it ({exc})") from exc


def check_plan(program: Program, plan: TpPlan) -> TpPlan:
    """The plan, if every rule can be applied to the model; TargetNotSupportedError if not."""
    for path, rule in plan.rules.items():
        _check_rule(program, plan, path, rule)
    if plan.loss_parallel and not any(r.vocab_output for r in plan.rules.values()):
        raise TargetNotSupportedError(
            f"tp plan {plan.source}: loss_parallel but no rule keeps logits split over the "
            "vocabulary (vocab_output): the loss would read one rank's columns as the whole"
        )
    for path, fixes in plan.attribute_fixes.items():
        try:
            module = program.submodule(path)
        except AttributeError:
            raise TargetNotSupportedError(
                f"tp plan {plan.source}: attribute fix on {path!r}: no such module"
            ) from None
        missing = [a for a in fixes if not _has_width(module, a)]
        if missing:
            raise TargetNotSupportedError(
                f"tp plan {plan.source}: module {path!r} has no attribute {missing[0]!r} to set"
            )
        rule = plan.rules.get(path)
        if rule is not None and rule.style not in ("replicate", "replicate_grad_allreduce"):
            raise TargetNotSupportedError(
                f"tp plan {plan.source}: attribute fix on {path!r}, which the plan splits "
                f"{rule.style}: a split module runs on whole-size DTensors, so its own widths "
                "stay; drop the fix"
            )
    return plan


def _has_width(module: nn.Module, name: str) -> bool:
    try:
        get_width(module, name)
    except AttributeError:
        return False
    return True


def _check_rule(program: Program, plan: TpPlan, path: str, rule: TpRule) -> None:
    """One rule of the plan: its style, its module, its options, and widths that divide."""
    size = plan.size
    where = f"tp plan {plan.source}: module {path!r}"
    if rule.style not in TP_STYLES:
        raise TargetNotSupportedError(
            f"{where}: unknown style {rule.style!r} (styles: {', '.join(TP_STYLES)})"
        )
    try:
        module = program.submodule(path)
    except AttributeError:
        raise TargetNotSupportedError(f"{where}: the model has no such module") from None
    if (rule.style == "sequence_parallel" or rule.sequence) and not plan.sequence_parallel:
        raise TargetNotSupportedError(
            f"{where}: splits the sequence ({rule.style}, {rule.sequence or 'norm'}) but "
            "the plan is not sequence_parallel: its neighbours would read a split stream"
        )
    if rule.vocab_output and not plan.loss_parallel:
        raise TargetNotSupportedError(
            f"{where}: logits split over the vocabulary but the plan is not loss_parallel"
        )
    if rule.style in ("replicate", "replicate_grad_allreduce", "sequence_parallel"):
        return  # nothing split: SequenceParallel replicates any module's parameters
    kind = module_kind(module)
    if kind is None:
        raise TargetNotSupportedError(
            f"{where}: a {type(module).__name__} cannot be split {rule.style}; torch's "
            "styles here split nn.Linear, nn.Embedding and GPT-2's Conv1D"
        )
    parts = plan.fused.get(path, 1)
    if parts > 1 and rule.style not in COLWISE_STYLES:
        raise TargetNotSupportedError(
            f"{where}: fused parts split {rule.style}; only a colwise split keeps each "
            "part's slice on its rank"
        )
    widths = plan.fused_widths.get(path)
    whole = plan.fused_whole.get(path, ())
    split = [w for i, w in enumerate(widths or ()) if i not in whole]
    if widths and (rule.style != "colwise" or any(w % size for w in split)):
        raise TargetNotSupportedError(
            f"{where}: fused parts of widths {list(widths)} split {rule.style} over {size}: "
            "each part must divide by the degree, and only colwise splits them"
        )
    for name, dim in split_dims(kind, rule.style).items():
        param = getattr(module, name, None)
        if param is None or dim is None:
            continue
        width = param.shape[dim]
        if widths and sum(widths) != width:
            raise TargetNotSupportedError(
                f"{where}: {name} dim {dim} has {width}, not the {sum(widths)} of its fused "
                f"parts {list(widths)}"
            )
        if width % (size * parts):
            what = f"{parts} fused parts of {width // parts}" if parts > 1 else f"{width}"
            raise TargetNotSupportedError(
                f"{where}: {name} dim {dim} ({what}) does not split evenly into {size}"
            )


def _with_counts(plan: TpPlan, program: Program) -> TpPlan:
    """The plan with its per-rank counts: the whole model's and each repeated block's."""
    mine, total = per_rank_of(program, plan, program.module)
    blocks = {
        path: per_rank_of(program, plan, program.submodule(path))
        for group in program.blocks
        for path in group.paths
    }
    return dataclasses.replace(plan, per_rank_numel=mine, total_numel=total, blocks=blocks)
