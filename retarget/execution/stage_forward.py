"""What a pipeline stage runs its graph under: autocast (pp+bf16), recomputed blocks (pp+ac) and
compiled blocks (pp+compile).

split_stages decides them under pp (`plan.pp.autocast`, `checkpoint_every`, `compile`), because
the stages torch.distributed.pipelining splits from the exported model are what runs, not the
region graphs insert_autocast, checkpoint_blocks and compile_regions rewrite. apply_pipeline calls
`run_stage_forward` on each of this rank's stage modules before torch's stage and schedule
take them; it replaces forwards on the module objects (instance attributes), so fully_shard,
which changes the stage module's class and hooks its calls, still runs around them.

- autocast: the stage's forward runs under torch.autocast(device, bfloat16); its floating
  outputs are cast back to the dtypes the trace gave them (float32), because the next stage
  receives into buffers made from the trace (a bfloat16 tensor sent into a float32 buffer
  would be read as garbage). The logits the last stage hands the loss are cast the same way,
  as transformers' loss casts them itself.
- recomputation: torch's split keeps the model's module tree inside a stage (the blocks are
  InterpreterModules at their paths, under the `model.` prefix of the traced wrapper); each
  repeated block's forward runs under non-reentrant torch.utils.checkpoint, so a stage keeps
  only the blocks' inputs per microbatch in flight and recomputes a block in its backward
  (with the autocast state it ran under). A block a cut divides is recomputed in each stage's
  part. Counting: the n-th, 2n-th, ... block of the model (ac[every=n]), as checkpoint_blocks
  counts the repeats.
- compile: each repeated block's forward (checkpoint inside, torchtitan's order: ac, then
  compile, then fully_shard around the stage) goes through torch.compile with the target's
  arguments. Each block of a stage is its own InterpreterModule with its own graph code, so
  dynamo compiles each block once (not once per block type, as compile_regions' shared
  region graphs do); autocast stays the stage's, which dynamo reads as ambient state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from retarget.core.plans import PpPlan

#: The prefix of the model's modules inside a stage (execution/pipeline_stages traces a
#: wrapper holding the model as `model`).
TRACED_PREFIX = "model."


def run_stage_forward(stage_module: nn.Module, plan: PpPlan, device_type: str) -> None:
    """Set `stage_module` (one of torch's stage modules) to run as `plan` says."""
    blocks = list(dict.fromkeys(block for stage in plan.stages for block in stage.blocks))
    for index, block in enumerate(blocks):
        try:
            module = stage_module.get_submodule(TRACED_PREFIX + block)
        except AttributeError:
            continue  # another stage's block
        if plan.checkpoint_every and (index + 1) % plan.checkpoint_every == 0:
            _recompute_in_backward(module)
        if plan.compile:
            module.forward = torch.compile(module.forward, **plan.compile)
    if plan.autocast:
        _autocast(stage_module, getattr(torch, plan.autocast), device_type)


def _recompute_in_backward(module: nn.Module) -> None:
    forward = module.forward

    def forward_recomputed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = forward_recomputed


def _autocast(stage_module: nn.Module, dtype: torch.dtype, device_type: str) -> None:
    traced = traced_output_dtypes(stage_module)
    forward = stage_module.forward

    def forward_in_autocast(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            out = forward(*args, **kwargs)
        if isinstance(out, (tuple, list)):
            return type(out)(_as_traced(v, d) for v, d in zip(out, traced, strict=True))
        return _as_traced(out, traced[0])

    stage_module.forward = forward_in_autocast


def traced_output_dtypes(stage_module: nn.Module) -> list[torch.dtype | None]:
    """The dtype the trace gave each output of a stage module's graph (None: not a tensor)."""
    graph = stage_module.graph
    output = next(n for n in graph.nodes if n.op == "output")
    values = output.args[0]
    values = values if isinstance(values, (tuple, list)) else (values,)
    dtypes = []
    for value in values:
        meta = value.meta.get("val") if isinstance(value, fx.Node) else None
        dtypes.append(getattr(meta, "dtype", None))
    return dtypes


def _as_traced(value: Any, dtype: torch.dtype | None) -> Any:
    if isinstance(value, torch.Tensor) and dtype is not None and value.dtype != dtype:
        return value.to(dtype)
    return value
