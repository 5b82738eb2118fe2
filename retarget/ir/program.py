"""Program: the one object that flows through the pass pipeline.

module     the structural copy being rewritten (it becomes the CompiledModule)
original   the user's model, never edited; shares every parameter tensor with `module`
tree       networkx DiGraph of the module hierarchy (find_blocks)
blocks     repeated block groups found by structural hashing (find_blocks)
regions    capture units with their graphs (capture_regions)
world      the processes the plan is made for, resolved once by compile_for (core.world)
dims       every parallel degree, resolved from the target and the world on first use
           (`parallel_dims()`, core.parallel_dims)
analysis   typed facts the analyses found (`Analysis`: shapes, FLOPs, fp8 decisions, ...)
plan       typed records of decisions that need a process group (`core.plans.Plan`); passes
           write them, the runtime applies them
history    per pass: name, seconds, changed, stats, notes, graph text after it
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch import nn

from retarget.core.parallel_dims import ParallelDims
from retarget.core.plans import Plan
from retarget.core.world import World
from retarget.ir.region import Region
from retarget.targets.grammar import Target

ROOT = "<model>"


@dataclass(frozen=True)
class ExampleInputs:
    """How the model is called: `model(*args, **kwargs)`."""

    args: tuple
    kwargs: dict[str, Any]

    @classmethod
    def of(cls, example: Any) -> ExampleInputs | None:
        """tuple -> positional args, dict -> keyword args, anything else -> one argument."""
        if example is None:
            return None
        if isinstance(example, ExampleInputs):
            return example
        if isinstance(example, tuple):
            return cls(example, {})
        if isinstance(example, dict):
            return cls((), dict(example))
        return cls((example,), {})


@dataclass
class Analysis:
    """Facts the analysis passes found; a field is None until the pass that finds it ran."""

    modules: dict[str, dict[str, Any]] | None = None
    """annotate_shapes: per Linear/Conv path, its input/output shapes and FLOPs."""
    regions: dict[str, dict[str, Any]] | None = None
    """annotate_shapes: per region, its FLOPs and call signature."""
    flops: int | None = None
    """annotate_shapes: FLOPs of one forward of the whole model on the example inputs."""
    fp8: dict[str, Any] | None = None
    """swap_fp8: the backend, why it was chosen, the recipe, and every Linear's decision."""
    quant: dict[str, Any] | None = None
    """quantize_linears: the backend, the format, every Linear's decision and the bytes."""
    activation_profile: Any = None
    """checkpoint_blocks: the ActivationProfile of one forward (what each repeat keeps)."""
    checkpoint: dict[str, Any] | None = None
    """checkpoint_blocks: the policy and the per-repeat plan it chose."""


@dataclass
class PassRecord:
    """Provenance of one pass run."""

    name: str
    summary: str
    numerics: str
    seconds: float
    changed: bool
    stats: dict[str, Any]
    notes: tuple[str, ...]
    graphs: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "changed": self.changed,
            "seconds": round(self.seconds, 6),
            "stats": self.stats,
            "notes": list(self.notes),
        }


@dataclass
class Program:
    """What flows through the pipeline: the model being rewritten and everything decided on it.

    compile_for makes one per compile; every pass reads and writes it, the appliers carry out
    its `plan`, and the CompiledModule keeps it (`compiled.program`) for the report and the
    runtime.
    """

    module: nn.Module
    """The structural copy being rewritten (it becomes the CompiledModule)."""
    original: nn.Module
    """The user's model, never edited (under FSDP its replaced parameters are emptied)."""
    target: Target
    example: ExampleInputs | None
    """How the model is called on the example inputs (None: regions captured at first call)."""
    capture: str = "regions"
    """The capture mode asked (compile_for's `capture`; "auto" may have captured nothing)."""
    tree: nx.DiGraph = field(default_factory=nx.DiGraph)
    """The module tree (find_blocks): path -> class, parameter counts, fingerprint."""
    blocks: list[BlockGroup] = field(default_factory=list)
    """Groups of structurally equal modules, the repeats (find_blocks)."""
    regions: list[Region] = field(default_factory=list)
    """The capture units and their graphs (capture_regions)."""
    world: World = field(default_factory=World.resolve)
    """The processes the plan is made for, resolved once."""
    dims: ParallelDims | None = None
    """Every parallel degree (`parallel_dims()`); None until a pass first asks."""
    analysis: Analysis = field(default_factory=Analysis)
    """Shapes and FLOPs, fp8 decisions, the activation profile, the checkpoint plan."""
    plan: Plan = field(default_factory=Plan)
    """The frozen records of what needs a process group or a device (core/plans.py)."""
    history: list[PassRecord] = field(default_factory=list)
    """One record per pass run: seconds, changed, stats, notes, the graphs after it."""
    notes: list[str] = field(default_factory=list)
    parked_hooks: dict[int, list[tuple[int, Any]]] = field(default_factory=dict, repr=False)
    """The user's hooks compile_for set aside while it runs (ir/hooks.py), by hook dict;
    empty once it returned them."""

    def parallel_dims(self) -> ParallelDims:
        """The degrees of the target in this world, resolved and checked once, on first use
        (inside the first pass that asks, so a refusal is that pass's)."""
        if self.dims is None:
            self.dims = ParallelDims.resolve(self.target, self.world)
        return self.dims

    def submodule(self, path: str) -> nn.Module:
        return self.module.get_submodule(path)

    def region_of(self, path: str) -> Region | None:
        return next((r for r in self.regions if path in r.paths), None)

    def graph_text(self) -> dict[str, str]:
        """The code of each region's representative graph, by region name."""
        texts = {}
        for region in self.regions:
            graph = region.representative()
            if graph is not None:
                texts[region.name] = graph.gm.code.strip()
        return texts

    def graphs_at(self, pass_name: str, when: str = "after") -> dict[str, str]:
        """Region graph text right after (or before) the named pass ran."""
        if when not in ("before", "after"):
            raise ValueError(f"when must be 'before' or 'after', got {when!r}")
        names = [record.name for record in self.history]
        if pass_name not in names:
            raise KeyError(f"pass '{pass_name}' did not run; ran: {', '.join(names)}")
        index = names.index(pass_name) + (0 if when == "after" else -1)
        for record in reversed(self.history[: index + 1]):
            if record.graphs:
                return record.graphs
        return {}

    def state_keys(self) -> list[str]:
        return list(self.module.state_dict().keys())

    def run_example(self) -> Any:
        """Run the rewritten module on the example inputs."""
        assert self.example is not None, "run_example needs example inputs"
        return self.module(*self.example.args, **self.example.kwargs)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


@dataclass
class BlockGroup:
    """Modules of one structure found at several paths (the repeats of a block)."""

    block_type: str
    paths: list[str]
    fingerprint: str
    parameters: int

    @property
    def name(self) -> str:
        parents = {path.rpartition(".")[0] for path in self.paths}
        if len(parents) == 1:
            parent = parents.pop()
            return f"{parent}.*" if parent else "*"
        return f"{self.paths[0]} (+{len(self.paths) - 1})"


def describe_tensor(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return type(value).__name__
