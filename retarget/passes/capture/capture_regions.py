"""capture_regions: capture one graph per distinct block type and reuse it for every repeat.

Contract: requires blocks | provides regions | after split_context | numerics exact
    | options CaptureOptions

Modes (`compile_for(capture=...)`):
- "regions" (default): every repeated block found by find_blocks is a region; glue code
  (embeddings, HF wrappers, losses) stays eager. A model without repeated blocks is one region.
  Capture cost is then independent of depth.
- "auto" (retarget.Accelerator's): "regions" when a pass of the pipeline reads or rewrites a
  graph (`Pass.reads_graphs`: precision, fp8, quant, ac, compile, tp, pp, cp, a pass of the
  user's, or compile_for's verify/print options); otherwise the regions are installed and not
  captured (`Region.deferred`): each repeat runs its module's own forward, which is exactly what
  its graph would compute (a capture is checked bit for bit against it), without the capture's
  cost (a torch.export per block type, most of an uncompiled first step). The report says so.
- "whole": the whole model is one region; when it cannot be captured, regions are used.
- "eager": nothing is captured.

With example inputs, one probe forward (no grad, RNG and buffers restored) records the inputs
each block receives; each block type is captured from its first repeat and checked bit for bit
against eager on its first and last repeat. Without example inputs, regions are installed and
captured at their first call. Either way a new call signature (another batch size, eval mode)
is captured when first seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from retarget.core.module_record import update_record
from retarget.core.modules import original_class
from retarget.execution.module_call import retarget_module
from retarget.frontends import FRONTENDS
from retarget.frontends.check import preserved_state
from retarget.frontends.state import copy_state_args
from retarget.ir.program import ROOT, Program
from retarget.ir.region import Region, running_eagerly
from retarget.passes.base import Pass, PassResult
from retarget.targets.grammar import Target

MODES = ("regions", "auto", "whole", "eager")


@dataclass(frozen=True, kw_only=True)
class CaptureOptions:
    mode: str = "regions"
    """regions | auto | whole | eager (see the module docstring)."""
    deferred: bool = False
    """auto, settled by the pipeline (`settle_capture`): no pass reads a graph, capture none."""
    frontends: tuple[str, ...] = tuple(FRONTENDS)
    """Frontends to try, in order; the rest of the order list is skipped."""
    target: str = ""
    """The target, as the reason of a region nothing captures names it."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"capture must be one of {MODES}, got {self.mode!r}")
        unknown = [f for f in self.frontends if f not in FRONTENDS]
        if unknown:
            raise ValueError(f"unknown frontend {unknown[0]!r}; frontends: {tuple(FRONTENDS)}")


#: Why a deferred region has no graph (the report's reason column).
DEFERRED_REASON = "no pass of '{target}' rewrites its graph: runs its own forward"


class CaptureRegions(Pass):
    name = "capture_regions"
    reads_graphs = False
    summary = "capture one graph per distinct block type, reuse it for every repeat"
    requires = ("blocks",)
    provides = ("regions",)
    # cp routes attention to its split op and cuts the example first (split_context).
    after = ("split_context",)
    Options = CaptureOptions

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """Every target; build_pipeline gives it compile_for's capture mode and frontends."""
        return [cls(CaptureOptions(target=str(target)))]

    def run(self, program: Program) -> PassResult:
        mode = self.options.mode
        if program.regions:  # a second run: the regions are installed and hold their graphs
            return PassResult(changed=False, notes=("regions already captured",))
        if mode == "eager":
            return PassResult(changed=False, notes=("capture='eager': every module runs eagerly",))
        notes: list[str] = []
        regions: list[Region] = []
        if mode == "whole":
            root = self._region(ROOT, original_class(program.module).__name__, [""])
            regions = self._capture_all(program, [root], notes)
            if root.eager_only:
                notes.append(f"whole model not capturable ({root.reason}); using regions")
                self._uninstall(program, regions)
                regions = []
        if not regions:
            regions = self._capture_all(program, self._block_regions(program, notes), notes)
        program.regions = regions
        return PassResult(changed=True, stats=_stats(regions), notes=tuple(notes))

    def _capture_all(self, program: Program, regions: list[Region], notes: list[str]):
        self._install(program, regions)
        if self.options.deferred:
            for region in regions:
                region.defer(DEFERRED_REASON.format(target=self.options.target))
            notes.append(
                "capture='auto': no pass of this target reads or rewrites a graph, so nothing "
                "is captured; every repeat runs its own forward (capture='regions' captures)"
            )
            return regions
        if program.example is None:
            notes.append("no example_inputs: regions are captured lazily at their first call")
            return regions
        inputs = record_inputs(program.module, [r.paths[:1] for r in regions], program.example)
        for region in regions:
            self._capture(program, region, inputs, notes)
        return regions

    def _region(self, name: str, block_type: str, paths: list[str]) -> Region:
        return Region(
            name=name, block_type=block_type, paths=paths, frontends=self.options.frontends
        )

    def _block_regions(self, program: Program, notes: list[str]) -> list[Region]:
        if not program.blocks:
            notes.append("no repeated blocks: the whole model is one region")
            return [self._region(ROOT, original_class(program.module).__name__, [""])]
        return [self._region(g.name, g.block_type, list(g.paths)) for g in program.blocks]

    def _install(self, program: Program, regions: list[Region]) -> None:
        for region in regions:
            for path in region.paths:
                retarget_module(program.submodule(path), region=region, path=path)

    def _uninstall(self, program: Program, regions: list[Region]) -> None:
        for region in regions:
            for path in region.paths:
                update_record(program.submodule(path), region=None)

    def _capture(self, program: Program, region: Region, inputs: dict, notes: list[str]) -> None:
        first = region.paths[0]
        if first not in inputs:
            notes.append(f"{region.name}: not called on the example inputs; captured at first call")
            return
        args, kwargs = inputs[first]
        others = tuple(program.submodule(p) for p in region.paths[1:][-1:])
        region.capture(program.submodule(first), args, kwargs, check=others)
        if region.eager_only:
            notes.append(f"{region.name}: eager ({region.reason})")


class _AllSeen(Exception):
    """Raised by the probe's hooks to end the forward once every wanted input is recorded."""


def record_inputs(module: nn.Module, path_lists: list[list[str]], example) -> dict[str, Any]:
    """Run the model on the example until each path's first (args, kwargs) is recorded.

    The forward is cut short (by an exception from the hook that completes the set) as soon as
    every wanted path has been called once, so probing the first repeat of each block costs the
    layers before it, not the whole depth. Regions check their last repeat with the first
    repeat's inputs, so nothing later is needed.
    """
    wanted = {path for paths in path_lists for path in paths}
    seen: dict[str, tuple[tuple, dict]] = {}
    handles = []
    for path in wanted:
        if path == "":
            seen[""] = (example.args, example.kwargs)
            continue

        def hook(_module, args, kwargs, path=path) -> None:
            if path not in seen:  # a pre-hook that returns a value would replace the inputs
                # A cache among the inputs is copied: the rest of the forward updates it.
                seen[path] = copy_state_args(args, kwargs)
                if wanted <= seen.keys():
                    raise _AllSeen

        handles.append(module.get_submodule(path).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        if wanted - {""}:
            with running_eagerly(tuple(module.modules())), preserved_state(module), torch.no_grad():
                module(*example.args, **example.kwargs)
    except _AllSeen:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _stats(regions: list[Region]) -> dict[str, Any]:
    frontends: dict[str, int] = {}
    for region in regions:
        frontends[region.frontend] = frontends.get(region.frontend, 0) + 1
    return {
        "regions": len(regions),
        "repeats": sum(r.repeats for r in regions),
        "frontends": frontends,
        "capture_seconds": round(sum(r.capture_seconds for r in regions), 4),
    }
