"""annotate_shapes: shapes, dtypes, parameter counts and FLOPs per region and per Linear/Conv.

FLOPs are counted, not guessed: one eager forward of the original model on the example inputs
under torch.utils.flop_counter.FlopCounterMode (no grad; RNG and buffers restored), which
attributes each matmul/convolution to the module that issued it. Forward hooks on the same run
record input and output shapes. Without example inputs only parameter counts are known.

Results land in `program.analysis["modules"]` (per Linear/Conv path) and
`program.analysis["regions"]` (per region), and each region graph node whose value is known
gets `node.meta["shape"]` / `node.meta["dtype"]`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from retarget.frontends.check import preserved_state
from retarget.passes.base import Pass, PassResult
from retarget.program import Program, describe_tensor

#: Module types whose FLOPs and shapes are reported one by one.
COUNTED_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class AnnotateShapes(Pass):
    name = "annotate_shapes"
    summary = "shapes, dtypes, parameter counts and FLOPs per region and per Linear/Conv"
    requires = ("regions",)
    provides = ("shapes",)

    def run(self, program: Program) -> PassResult:
        watched = _watched_paths(program)
        records, flops = _measure(program, watched) if program.example else ({}, {})
        modules = {}
        for path, module in program.original.named_modules():
            if isinstance(module, COUNTED_MODULES):
                modules[path] = _module_entry(module, records.get(path), flops.get(path, 0))
        regions = {}
        for region in program.regions:
            first = program.original.get_submodule(region.paths[0])
            entry = {
                "block_type": region.block_type,
                "repeats": region.repeats,
                "params_per_repeat": sum(p.numel() for p in first.parameters()),
                "flops_per_repeat": flops.get(region.paths[0], 0),
                "flops": sum(flops.get(p, 0) for p in region.paths),
                **(records.get(region.paths[0]) or {}),
            }
            entry["graph_nodes_annotated"] = _annotate_graphs(region)
            regions[region.name] = entry
        program.analysis["modules"] = modules
        program.analysis["regions"] = regions
        program.analysis["flops"] = flops.get("", 0)
        notes = () if program.example else ("no example_inputs: shapes and FLOPs unknown",)
        stats = {
            "linear_conv": len(modules),
            "forward_flops": flops.get("", 0),
            "params": sum(p.numel() for p in program.original.parameters()),
        }
        return PassResult(changed=False, stats=stats, notes=notes)


def _watched_paths(program: Program) -> set[str]:
    paths = {p for region in program.regions for p in region.paths[:1]}
    for path, module in program.original.named_modules():
        if isinstance(module, COUNTED_MODULES):
            paths.add(path)
    return paths


def _measure(program: Program, watched: set[str]) -> tuple[dict, dict[str, int]]:
    model = program.original
    records: dict[str, dict[str, Any]] = {}
    handles = []
    for path in watched:

        def hook(_m, args, kwargs, output, path=path):
            records.setdefault(
                path, {"inputs": _shapes((args, kwargs)), "outputs": _shapes(output)}
            )

        handles.append(model.get_submodule(path).register_forward_hook(hook, with_kwargs=True))
    counter = FlopCounterMode(display=False)
    try:
        with preserved_state(model), torch.no_grad(), counter:
            model(*program.example.args, **program.example.kwargs)
    finally:
        for handle in handles:
            handle.remove()
    flops = {}
    for name, by_op in counter.get_flop_counts().items():
        if name == "Global":
            continue
        path = name.partition(".")[2]
        flops[path] = int(sum(by_op.values()))
    return records, flops


def _shapes(tree: Any) -> list[str]:
    return [describe_tensor(t) for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _module_entry(module: nn.Module, record: dict | None, flops: int) -> dict[str, Any]:
    weight = module.weight
    entry = {
        "class": type(module).__name__,
        "weight": describe_tensor(weight),
        "params": sum(p.numel() for p in module.parameters(recurse=False)),
        "flops": flops,
    }
    if record:
        entry.update(record)
    return entry


def _annotate_graphs(region) -> int:
    annotated = 0
    for graph in region.graphs.values():
        for node in graph.gm.graph.nodes:
            value = node.meta.get("val", node.meta.get("example_value"))
            if isinstance(value, torch.Tensor):
                node.meta["shape"] = tuple(value.shape)
                node.meta["dtype"] = value.dtype
                annotated += 1
    return annotated
