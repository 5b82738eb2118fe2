"""swap_fp8: swap eligible nn.Linear modules for FP8 ones (native, torchao, te or msamp).

Contract: requires regions, shapes | provides fp8 | after - | numerics approx(rtol=0.05, atol=0.08)
    | options SwapFp8Options

1. Decide per Linear with the eligibility table (`fp8_rules.py`, beside this pass): swapped,
   or the rule that kept it and why. The report lists every Linear (`program.analysis.fp8`).
2. Pick and check the backend (`retarget.kernels.fp8.backends`) before touching anything.
3. Swap at module level in the structural copy (`program.module`): native re-classes each Linear
   in place as a Float8Linear; torchao and te put their module at the Linear's path. The weight
   and bias stay the same Parameter objects (except msamp) and state_dict keys do not change.
4. Route region graphs through the swapped modules. An exported region graph reads the weight
   with `get_attr` and calls `aten.linear` itself, which would bypass the swap, so each
   `linear(x, <get_attr P.weight>, <get_attr P.bias>)` of a swapped path P becomes a `call_module`
   of P (relative to the region root). Graph code resolves `self.P` from the live module at every
   call, so the FP8 module runs, and in a block shared by repeats each repeat runs its own module
   (a Linear kept in one repeat, the first layer's say, runs as a plain Linear). fx graphs already
   call modules. The rewrite is a region transform, so graphs captured later get it too.

    compile_for(model, "fp8[backend=native,scaling=current,min_size=4096]", example_inputs=...)
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

from torch import fx, nn
from torch.fx.graph_module import _copy_attr

from retarget.core.plans import Fp8Plan
from retarget.ir.nodes import LINEAR_CALLS
from retarget.ir.program import Program
from retarget.ir.region import Region
from retarget.kernels.fp8.backends import Environment, select_backend
from retarget.kernels.fp8.recipe import Fp8Recipe
from retarget.passes.base import Numerics, Pass, PassResult, coerce_options
from retarget.passes.precision.fp8_rules import (
    Decision,
    EligibilityOptions,
    decide_all,
    unused_patterns,
)
from retarget.targets.grammar import PARTS, Target

_SCHEMA = PARTS["fp8"].options


def _default(key: str) -> Any:
    return _SCHEMA[key].default


@dataclass(frozen=True, kw_only=True)
class SwapFp8Options:
    """The options of `fp8[...]`; defaults come from the target schema."""

    backend: str = _default("backend")
    """auto | native | torchao | te | msamp (see retarget.kernels.fp8.backends)."""
    format: str = _default("format")
    """hybrid (E4M3 forward, E5M2 gradients) | e4m3."""
    scaling: str = _default("scaling")
    """delayed | current | rowwise (see retarget.kernels.fp8.recipe)."""
    amax_history: int = _default("amax_history")
    """Length of the amax history (delayed scaling)."""
    amax_algo: str = _default("amax_algo")
    """max | most_recent: the amax a delayed scale is computed from."""
    margin: int = _default("margin")
    """Scales are divided by 2**margin."""
    interval: int = _default("interval")
    """Steps between delayed-scale recomputations."""
    min_size: int = _default("min_size")
    """Linears whose weight has fewer elements stay in high precision."""
    include: tuple[str, ...] = _default("include")
    """Swap only Linears matching one of these fnmatch patterns (overrides first/last/size/tied)."""
    exclude: tuple[str, ...] = _default("exclude")
    """Never swap Linears matching one of these patterns."""
    override_linear_precision: tuple[bool, bool, bool] = _default("override_linear_precision")
    """(fprop, dgrad, wgrad) GEMMs in high precision."""
    autocast_eval: bool = _default("autocast_eval")
    """Use FP8 in eval mode too."""
    opt_level: str = _default("opt_level")
    """MS-AMP optimisation level (o1 | o2)."""

    def __post_init__(self) -> None:
        coerce_options(self, _SCHEMA, "swap_fp8")

    @classmethod
    def from_target(cls, target: Target) -> SwapFp8Options:
        part = target.get("fp8")
        return cls(**part.as_dict()) if part is not None else cls()

    def recipe(self) -> Fp8Recipe:
        return Fp8Recipe(
            format=self.format,
            scaling=self.scaling,
            amax_history_len=self.amax_history,
            amax_compute_algo=self.amax_algo,
            margin=self.margin,
            interval=self.interval,
            override_linear_precision=self.override_linear_precision,
            autocast_eval=self.autocast_eval,
        )

    def eligibility(self) -> EligibilityOptions:
        return EligibilityOptions(
            min_size=self.min_size, include=self.include, exclude=self.exclude
        )


class SwapFp8(Pass):
    name = "swap_fp8"
    summary = "swap eligible nn.Linear modules for FP8 ones (native, torchao, te or msamp)"
    requires = ("regions", "shapes")
    provides = ("fp8",)
    # Measured on every zoo model with min_size=16 (native delayed and rowwise, torchao current):
    # at rtol=0.05 the outputs need at most atol=0.040 (tiny Llama logits, control-flow MLP);
    # the tiny Llama's loss moves by < 0.04%. Declared with 2x headroom.
    numerics = Numerics("approx", rtol=0.05, atol=0.08)
    Options = SwapFp8Options
    environment: ClassVar[Environment] = Environment()

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """The pipeline's fp8 stage: this pass when the target has an fp8 part."""
        return [cls(SwapFp8Options.from_target(target))] if "fp8" in target else []

    def run(self, program: Program) -> PassResult:
        options = self.options
        recipe = options.recipe()
        backend, why = select_backend(options.backend, recipe, self.environment)
        decisions = decide_all(program.module, options.eligibility(), called_paths(program))
        chosen = [d.path for d in decisions if d.swapped]
        devices = {program.submodule(path).weight.device for path in chosen}
        backend.check(recipe, self.environment, devices)  # refuse before touching anything
        decided = program.analysis.fp8  # a second run finds the swapped modules (already_fp8)
        report = program.analysis.fp8 = {
            "backend": backend.name,
            "why": why,
            "recipe": dataclasses.asdict(recipe),
            "linears": {d.path: d.to_dict() for d in decisions},
            "graph_module_calls": {},
        }
        stats = {"backend": backend.name, "linears": len(decisions), "swapped": len(chosen)}
        stats["kept"] = dict(Counter(d.rule for d in decisions if not d.swapped))
        kept_notes = _kept_notes(decisions, options.eligibility())
        if not chosen:
            if decided is not None:  # the first run's decisions stay the record
                program.analysis.fp8 = decided
            what = "no eligible Linear" if decisions else "the model has no nn.Linear"
            return PassResult(False, stats, (f"{what}: nothing swapped", *kept_notes))
        kept = tuple(d.path for d in decisions if not d.swapped)
        swapped = backend.swap(
            program.module, chosen, recipe, opt_level=options.opt_level, kept=kept
        )
        for path, class_name in swapped.classes.items():
            report["linears"][path]["class"] = class_name
        if swapped.optimizer is not None:
            program.plan.fp8 = Fp8Plan(backend=backend.name, optimizer=swapped.optimizer)
        calls = report["graph_module_calls"] = route_regions(self.name, program, set(chosen))
        stats["graph_module_calls"] = sum(calls.values())
        notes = (
            f"{why}; {recipe.format} format, {recipe.scaling} scaling",
            f"swapped {len(chosen)} of {len(decisions)} Linears: {compress_paths(chosen)}",
            *kept_notes,
            *(f"region {name}: {n} calls now run the swapped modules" for name, n in calls.items()),
            *swapped.notes,
        )
        return PassResult(True, stats, notes)


def called_paths(program: Program) -> set[str] | None:
    """Linears whose forward ran on the example inputs (annotate_shapes' hooks saw them)."""
    modules = program.analysis.modules
    if program.example is None or modules is None:
        return None
    return {path for path, entry in modules.items() if "inputs" in entry}


def _kept_notes(decisions: list[Decision], options: EligibilityOptions) -> list[str]:
    """One line per rule that kept Linears, then patterns that name no Linear (typos)."""
    by_rule: dict[str, list[str]] = {}
    for d in decisions:
        if not d.swapped:
            by_rule.setdefault(d.rule, []).append(d.path)
    notes = [f"kept by '{rule}': {', '.join(paths)}" for rule, paths in by_rule.items()]
    patterns = (*options.include, *options.exclude)
    for pattern in unused_patterns(patterns, [d.path for d in decisions]):
        notes.append(f"pattern '{pattern}' names no Linear of this model")
    return notes


def compress_paths(paths: list[str]) -> str:
    """`model.layers.*.mlp.up_proj (x2), ...`: paths that differ by block index folded."""
    groups: dict[str, list[str]] = {}
    for path in paths:
        groups.setdefault(re.sub(r"\.\d+\.", ".*.", f".{path}.").strip("."), []).append(path)
    return ", ".join(
        f"{folded} (x{len(members)})" if len(members) > 1 else members[0]
        for folded, members in groups.items()
    )


def route_regions(pass_name: str, program: Program, swapped: set[str]) -> dict[str, int]:
    """Add the call_module rewrite to every region holding a swapped path; calls per region."""
    calls = {}
    for region in program.regions:
        relative = {_relative(path, base) for path in swapped for base in region.paths}
        relative.discard(None)
        if not relative:
            continue
        root = program.submodule(region.paths[0])
        rewrite = partial(route_linears_to_modules, paths=frozenset(relative), root=root)
        region.add_transform(pass_name, rewrite)
        calls[region.name] = _module_calls(region, relative)
    return calls


def _relative(path: str, base: str) -> str | None:
    if base == "":
        return path
    return path[len(base) + 1 :] if path.startswith(base + ".") else None


def _module_calls(region: Region, relative: set[str]) -> int:
    graph = region.representative()
    if graph is None:
        return 0
    return sum(1 for n in graph.gm.graph.find_nodes(op="call_module") if n.target in relative)


def route_linears_to_modules(gm: fx.GraphModule, *, paths: frozenset[str], root: nn.Module) -> None:
    """Replace `linear(x, <get_attr P.weight>, <get_attr P.bias>?)` by `call_module P(x)`.

    Only for P in `paths` (relative to `root`, the region's first repeat) and only when the
    weight and bias are P's own; anything else is left as captured.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in LINEAR_CALLS:
            continue
        x, weight, bias = _linear_args(node)
        path = _owner(weight, "weight")
        if path not in paths or _owner(bias, "bias") != (path if bias is not None else None):
            continue
        if (bias is None) != (root.get_submodule(path).bias is None):
            continue
        _copy_attr(root, gm, path)  # graph.lint() resolves call_module targets in gm
        with graph.inserting_before(node):
            call = graph.call_module(path, (x,))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        for attr in (weight, bias):
            if attr is not None and not attr.users:
                graph.erase_node(attr)


def _linear_args(node: fx.Node) -> tuple[Any, Any, Any]:
    args = list(node.args) + [None] * (3 - len(node.args))
    x = args[0] if args[0] is not None else node.kwargs.get("input")
    weight = args[1] if args[1] is not None else node.kwargs.get("weight")
    bias = args[2] if args[2] is not None else node.kwargs.get("bias")
    return x, weight, bias


def _owner(node: Any, leaf: str) -> str | None:
    """P when `node` is `get_attr P.<leaf>`."""
    if isinstance(node, fx.Node) and node.op == "get_attr" and node.target.endswith(f".{leaf}"):
        return node.target[: -len(leaf) - 1]
    return None
