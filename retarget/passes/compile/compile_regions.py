"""compile_regions (`compile`): torch.compile each region's final graph, once per block type.

Contract: requires regions | provides compiled | after swap_fp8, quantize_linears, insert_autocast,
    checkpoint_blocks
    | numerics approx(rtol=0.0001, atol=1e-05) | options CompileRegionsOptions

`compile[backend=inductor|aot_eager|eager|..., mode=..., dynamic=auto|true|false,
fullgraph=true|false, scope=regions|whole]`.

- scope=regions (default): each region gets a runner (compiled_calls.RegionCompiler) that calls
  its graph through `torch.compile`. The graph compiled is the region's final one: it runs after
  every precision rewrite (insert_autocast, swap_fp8 are graph transforms already applied) and
  inside checkpoint_blocks' checkpoint, which wraps the call, so backward's recompute calls the
  same compiled callable. One callable per distinct block type and call signature serves every
  repeat (the graph reads the live repeat's parameters); glue (embeddings, heads, losses) stays
  eager, as in torchtitan's per-block compile.
- A region no frontend captured compiles its eager form (the block's forward with every pass's
  module-level rewrite); dynamo splits it at what it cannot trace (graph breaks, counted).
  A call forced eager by a user's hook inside the block stays uncompiled (ir/hooks.py).
- scope=whole: the whole model is one captured region (build_pipeline captures with
  capture="whole") and that graph is compiled. A model that cannot be captured whole is refused,
  naming why; `ac` and scope=whole are refused by the target rules (no blocks to checkpoint).

Compiling happens at the first call of each signature; with example inputs this pass makes that
call itself (one forward with grad, RNG and buffers restored), so the report shows compile
seconds, graphs and graph breaks. Not when FSDP will shard the blocks on more than one process:
fully_shard re-classes each block and dynamo guards on the class, so that compile would be
redone at the first step (measured: one recompile per region); regions compile then instead.
Nor under tp on more than one process: the split blocks are captured again after the split
(execution/apply_tp.py), and the graph compiled now would be dropped.
A compile that fails runs the uncompiled graph with one warning and the reason in the report;
fullgraph=true makes it an error naming the region.

Options that cannot be honoured are refused before anything is compiled: an unregistered
backend, a mode for a backend other than inductor, reduce-overhead (CUDA graphs) on a model
whose parameters are not on CUDA.

    >>> compiled = retarget.compile_for(model, "bf16+ac+compile", example_inputs=batch)
    >>> print(compiled.report)   # per region: backend, mode, compiles, recompiles, graph breaks
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from retarget.execution.compiled_calls import CompileOptions, RegionCompiler
from retarget.frontends.check import preserved_state
from retarget.ir.program import Program
from retarget.ir.region import Region
from retarget.passes.base import Numerics, Pass, PassResult
from retarget.targets.grammar import Target
from retarget.targets.strategies import STRATEGY

#: The modes that run CUDA graphs: refused for a model not on CUDA.
CUDA_GRAPH_MODES = ("reduce-overhead",)
WHOLE = "whole"


@dataclass(frozen=True, kw_only=True)
class CompileRegionsOptions(CompileOptions):
    """torch.compile's options (the `compile` part) and what of the parts beside it the notes
    say: tp splits the blocks after this pass, FSDP re-classes them."""

    beside_tp: bool = False
    beside_fsdp: bool = False


class CompileRegions(Pass):
    name = "compile_regions"
    summary = "torch.compile each region's final graph once per block type; glue stays eager"
    requires = ("regions",)
    provides = ("compiled",)
    # Compile what the blocks finally compute: casts, fp8 modules and checkpoint wrappers are in
    # place (torchtitan's order: ac, then compile, then shard; shard_* declare after this pass).
    after = ("swap_fp8", "quantize_linears", "insert_autocast", "checkpoint_blocks")
    # aot_eager runs the graph's own aten ops: bitwise on the float32 zoo, gradients within a bf16
    # ulp under bf16 with dropout (tests/passes/compile/test_compile_regions.py); inductor fuses
    # kernels and reorders floating point sums.
    numerics = Numerics("approx", rtol=1e-4, atol=1e-5)
    Options = CompileRegionsOptions

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """The pass for the target's `compile` part; [] without one, and under pp, whose stages
        (not the region graphs) run: split_stages has each stage's blocks compiled there."""
        part = target.get("compile")
        if part is None or "pp" in target:  # under pp split_stages compiles the stages' blocks
            return []
        keys = ("backend", "mode", "dynamic", "fullgraph", "scope")
        options = CompileRegionsOptions(
            **{key: part.get(key) for key in keys},
            beside_tp="tp" in target,
            beside_fsdp=STRATEGY[target.strategy].wrapper == "fsdp",
        )
        return [cls(checked_options(options))]

    def run(self, program: Program) -> PassResult:
        options = self.options
        refuse_cuda_graphs_off_cuda(program, options)
        compiled = [r.name for r in program.regions if r.runner is not None]
        if compiled:  # a second run: each region has its compiler
            return PassResult(changed=False, notes=(f"already compiled: {', '.join(compiled)}",))
        regions = self._regions(program)
        if not regions:
            raise ValueError(
                "compile: capture='eager' leaves no region to compile; drop the compile part "
                "or use capture='regions' (the default)"
            )
        for region in regions:
            form = "eager form" if region.eager_only else "graph"
            region.runner = RegionCompiler(region.name, options, form)
        notes = [f"{r.name}: {_how(r)}" for r in regions]
        if program.example is None:
            notes.append("no example_inputs: each region compiles at its first call")
        elif options.beside_tp and program.world.size > 1:
            notes.append(
                "tp splits the blocks after this pass and they are captured again: each "
                "region compiles its split graph at its first call"
            )
        elif _resharded_later(program, options):
            notes.append(
                "FSDP re-classes each block when it shards it (after this pass), and dynamo "
                "guards on the class: each region compiles at its first call after sharding"
            )
        else:
            _compile_now(program)
        stats = {"backend": options.backend, "mode": options.mode, "scope": options.scope}
        stats.update(_totals(regions))
        notes += [_compile_note(r) for r in regions]
        return PassResult(changed=True, stats=stats, notes=tuple(notes))

    def _regions(self, program: Program) -> list[Region]:
        if self.options.scope != WHOLE:
            return list(program.regions)
        root = program.region_of("")
        if root is None or root.eager_only:
            why = root.reason if root is not None else _whole_capture_note(program)
            raise NotImplementedError(
                "compile_regions: compile[scope=whole] compiles the whole model as one captured "
                f"graph, and this model is not one ({why}); use compile[scope=regions], which "
                "compiles each block's graph and leaves the glue eager"
            )
        return [root]


def checked_options(options: CompileOptions) -> CompileOptions:
    """The options with the backend's registered spelling; refuses what torch cannot run."""
    registered = {name.lower(): name for name in torch._dynamo.list_backends(exclude_tags=())}
    backend = registered.get(options.backend.lower())
    if backend is None:
        raise ValueError(
            f"compile: backend={options.backend!r} is not a registered torch.compile backend; "
            f"registered: {', '.join(sorted(registered.values()))}"
        )
    if options.mode != "default" and backend != "inductor":
        raise ValueError(
            f"compile: mode={options.mode} is an inductor mode and backend={backend} takes "
            "none; drop mode or use backend=inductor"
        )
    return dataclasses.replace(options, backend=backend)


def refuse_cuda_graphs_off_cuda(program: Program, options: CompileOptions) -> None:
    """Refuse a CUDA-graph mode for a model whose parameters are not all on CUDA."""
    devices = {p.device.type for p in program.module.parameters()}
    if options.mode in CUDA_GRAPH_MODES and devices != {"cuda"}:
        raise ValueError(
            f"compile: mode={options.mode} runs CUDA graphs, but the model's parameters are on "
            f"{', '.join(sorted(devices)) or 'no device'}; use mode=default or "
            "mode=max-autotune-no-cudagraphs, or move the model to CUDA first"
        )


def _whole_capture_note(program: Program) -> str:
    notes = [n for r in program.history if r.name == "capture_regions" for n in r.notes]
    return next((n for n in notes if "whole" in n), "it was captured as regions")


def _resharded_later(program: Program, options: CompileRegionsOptions) -> bool:
    """Whether FSDP will shard the blocks: a compile made now would be redone (a guard miss)."""
    return options.beside_fsdp and program.world.size > 1


def _compile_now(program: Program) -> None:
    """One forward on the example inputs, as training calls it, so that every region compiles."""
    example = program.example
    with preserved_state(program.module), torch.enable_grad():
        program.module(*example.args, **example.kwargs)


def _how(region: Region) -> str:
    if region.eager_only:
        return (
            "no captured graph (see regions): its eager form, every pass's module-level "
            "rewrite applied, is compiled; dynamo splits it where it cannot trace"
        )
    shared = f"one compiled callable per signature for its {region.repeats} repeat(s)"
    return f"final graph compiled, {shared}" if region.shared else "one graph per repeat, compiled"


def _compile_note(region: Region) -> str:
    s = region.runner.summary()
    if s["fallback"]:
        return f"{region.name}: compile failed, runs uncompiled: {s['fallback']}"
    breaks = f", {s['graph_breaks']} graph break(s)" if s["graph_breaks"] else ""
    return (
        f"{region.name}: {s['compiles']} graph(s) compiled in {s['compile_seconds']:.2f} s, "
        f"{s['recompiles']} recompile(s){breaks}"
    )


def _totals(regions: list[Region]) -> dict[str, Any]:
    summaries = [r.runner.summary() for r in regions]
    return {
        "regions": len(regions),
        "compiles": sum(s["compiles"] for s in summaries),
        "graph_breaks": sum(s["graph_breaks"] for s in summaries),
        "uncompiled": sum(bool(s["fallback"]) for s in summaries),
    }
