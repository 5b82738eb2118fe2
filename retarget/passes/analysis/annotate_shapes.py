"""annotate_shapes: shapes, dtypes, parameter counts and FLOPs per region and per Linear/Conv.

Contract: requires regions | provides shapes | after - | numerics exact | options NoOptions

FLOPs are counted, not guessed: one eager forward of the original model on the example inputs
under torch.utils.flop_counter.FlopCounterMode (no grad; RNG and buffers restored), which
attributes each matmul/convolution to the module that issued it. Forward hooks on the same run
record input and output shapes, and for each region's first repeat where each submodule's call
begins in FLOPs (`calls`: a timeline split_stages may cut a block at). Without example inputs
only parameter counts are known.

The cost of that forward must not grow with depth (a region's graph is shared by its repeats, and
so is its measurement): each region's first repeat runs and is counted; a later repeat called
with inputs of the same shapes, dtypes and non-tensor values (the same call signature, so the same
graph and the same count) does not compute: it returns the first repeat's output, which has the
shapes the rest of the model needs. Its FLOPs, shapes and the FLOPs of its Linear/Conv modules
are the first repeat's (`repeats_measured` / `repeats_replayed` in the stats). A repeat called
with another signature runs and is counted. The glue's FLOPs are shape-determined, so the
replayed values do not change them; only glue code that branches on values could see a
difference (the zoo has none; the numbers are for the report, never for numerics).

Results land in `program.analysis.modules` (per Linear/Conv path) and
`program.analysis.regions` (per region), and each region graph node whose value is known
gets `node.meta["shape"]` / `node.meta["dtype"]`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from retarget.frontends.check import preserved_state
from retarget.ir.nodes import traced_value
from retarget.ir.program import Program, describe_tensor
from retarget.ir.region import call_key
from retarget.passes.base import Pass, PassResult
from retarget.targets.grammar import Target


def _attention_flops(query_shape: Any, key_shape: Any, value_shape: Any, *_: Any, **__: Any) -> int:
    """Forward FLOPs of an attention call: the two batched matmuls, Q @ K^T and P @ V.

    The query's head count is the one that computes: under grouped-query attention the key and
    value carry fewer heads, each shared by several query heads (torch's own formula, before 2.10,
    asserts equal head counts, so it is not used here).
    """
    batch, heads, query_len, query_dim = query_shape
    key_len, value_dim = key_shape[-2], value_shape[-1]
    return 2 * batch * heads * query_len * key_len * (query_dim + value_dim)


#: Ops torch's FlopCounterMode has no formula for: the attention kernel
#: scaled_dot_product_attention calls on CPU (without it, attention counted 0 FLOPs here).
EXTRA_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops}

#: Module types whose FLOPs and shapes are reported one by one.
COUNTED_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class AnnotateShapes(Pass):
    name = "annotate_shapes"
    reads_graphs = False
    summary = "shapes, dtypes, parameter counts and FLOPs per region and per Linear/Conv"
    requires = ("regions",)
    provides = ("shapes",)

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """Every target: the report and later decisions read the shapes and FLOPs."""
        return [cls()]

    def run(self, program: Program) -> PassResult:
        watched = _watched_paths(program)
        records, flops, replay = _measure(program, watched) if program.example else ({}, {}, {})
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
        program.analysis.modules = modules
        program.analysis.regions = regions
        program.analysis.flops = flops.get("", 0)
        notes = () if program.example else ("no example_inputs: shapes and FLOPs unknown",)
        stats = {
            "linear_conv": len(modules),
            "forward_flops": flops.get("", 0),
            "params": sum(p.numel() for p in program.original.parameters()),
            **replay,
        }
        return PassResult(changed=False, stats=stats, notes=notes)


def _watched_paths(program: Program) -> set[str]:
    paths = {p for region in program.regions for p in region.paths[:1]}
    for path, module in program.original.named_modules():
        if isinstance(module, COUNTED_MODULES):
            paths.add(path)
    return paths


def _measure(program: Program, watched: set[str]) -> tuple[dict, dict[str, int], dict]:
    model = program.original
    records: dict[str, dict[str, Any]] = {}
    handles = []
    replay = _Replay(model, program.regions)
    counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)
    timeline = _CallTimeline(model, [r.paths[0] for r in program.regions], counter)
    for path in watched:

        def hook(_m, args, kwargs, output, path=path):
            records.setdefault(
                path, {"inputs": _shapes((args, kwargs)), "outputs": _shapes(output)}
            )

        handles.append(model.get_submodule(path).register_forward_hook(hook, with_kwargs=True))
    try:
        with preserved_state(model), torch.no_grad(), counter, replay, timeline:
            model(*program.example.args, **program.example.kwargs)
    finally:
        for handle in handles:
            handle.remove()
    for path, calls in timeline.calls.items():
        records.setdefault(path, {})["calls"] = calls
    flops = {}
    for name, by_op in counter.get_flop_counts().items():
        if name == "Global":
            continue
        path = name.partition(".")[2]
        flops[path] = int(sum(by_op.values()))
    replay.fill_in(records, flops)
    return records, flops, replay.stats()


class _CallTimeline:
    """Where in a block's forward each of its submodules' calls begins, in FLOPs: for the first
    call of each block path given, [submodule path, FLOPs the block had done when its call
    began] in call order, and ["", the block's total] last. A submodule called more than once
    is left out (a point "before it" would be ambiguous). split_stages cuts stages there when
    whole blocks balance poorly."""

    def __init__(self, model: nn.Module, paths: list[str], counter: FlopCounterMode) -> None:
        self.model, self.paths, self.counter = model, paths, counter
        self.calls: dict[str, list[list[Any]]] = {}
        self.handles: list[Any] = []

    def __enter__(self) -> _CallTimeline:
        for path in self.paths:
            block = self.model.get_submodule(path)
            state: dict[str, Any] = {"start": None, "seen": {}, "done": False}

            def begin(_m, _a, state=state):
                if state["start"] is None:
                    state["start"] = self.counter.get_total_flops()

            def end(_m, _a, _o, path=path, state=state):
                if state["done"] or state["start"] is None:
                    return
                state["done"] = True
                seen = state["seen"]
                calls = [[name, at] for name, (at, count) in seen.items() if count == 1]
                total = self.counter.get_total_flops() - state["start"]
                self.calls[path] = [*calls, ["", total]]

            self.handles.append(block.register_forward_pre_hook(begin))
            self.handles.append(block.register_forward_hook(end))
            for name, sub in block.named_modules(remove_duplicate=False):
                if not name:
                    continue

                def mark(_m, _a, name=name, state=state):
                    if state["start"] is None or state["done"]:
                        return
                    at, count = state["seen"].get(name, (0, 0))
                    if not count:
                        at = self.counter.get_total_flops() - state["start"]
                    state["seen"][name] = (at, count + 1)

                self.handles.append(sub.register_forward_pre_hook(mark))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()


class _Replay:
    """Later repeats with the first repeat's call signature return its output (see docstring)."""

    def __init__(self, model: nn.Module, regions) -> None:
        self.model = model
        self.groups = [list(r.paths) for r in regions if len(r.paths) > 1 and r.shared]
        self.first: dict[str, tuple[Any, Any]] = {}  # first path -> (signature, output)
        self.replayed: dict[str, str] = {}  # later path -> its first path
        self.patched: list[nn.Module] = []
        self.handles = []

    def __enter__(self) -> _Replay:
        for paths in self.groups:
            first = paths[0]

            keys: dict[str, Any] = {}

            def key_before(module, args, kwargs, first=first, keys=keys):
                # Before the call: the block updates a KV cache among its arguments.
                keys.setdefault(first, call_key(module, args, kwargs))

            def keep(module, args, kwargs, output, first=first, keys=keys):
                self.first.setdefault(first, (keys[first], output))

            module = self.model.get_submodule(first)
            self.handles.append(module.register_forward_pre_hook(key_before, with_kwargs=True))
            self.handles.append(module.register_forward_hook(keep, with_kwargs=True))
            for path in paths[1:]:
                later = self.model.get_submodule(path)
                real = later.forward

                def forward(*args, first=first, path=path, later=later, real=real, **kwargs):
                    kept = self.first.get(first)
                    if kept is not None and kept[0] == call_key(later, args, kwargs):
                        self.replayed[path] = first
                        return kept[1]
                    return real(*args, **kwargs)

                later.__dict__["forward"] = forward
                self.patched.append(later)
        return self

    def __exit__(self, *exc: object) -> None:
        for module in self.patched:
            module.__dict__.pop("forward", None)
        for handle in self.handles:
            handle.remove()
        self.first.clear()  # drop the kept outputs

    def fill_in(self, records: dict, flops: dict[str, int]) -> None:
        """Give each replayed repeat (and its modules) its first repeat's figures."""
        for path, first in self.replayed.items():
            for key, value in list(flops.items()):
                if key == first or key.startswith(first + "."):
                    flops[path + key[len(first) :]] = value
            for key, value in list(records.items()):
                if key == first or key.startswith(first + "."):
                    records[path + key[len(first) :]] = value
            # Every ancestor of the repeat (the root included) also did that work.
            parts = path.split(".")
            for depth in range(len(parts)):
                ancestor = ".".join(parts[:depth])
                flops[ancestor] = flops.get(ancestor, 0) + flops.get(first, 0)

    def stats(self) -> dict[str, int]:
        measured = sum(len(paths) for paths in self.groups) - len(self.replayed)
        return {"repeats_measured": measured, "repeats_replayed": len(self.replayed)}


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
            value = traced_value(node)
            if isinstance(value, torch.Tensor):
                node.meta["shape"] = tuple(value.shape)
                node.meta["dtype"] = value.dtype
                annotated += 1
    return annotated
