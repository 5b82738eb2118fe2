"""tp inside pipeline stages (tp+pp, fsdp+tp+pp): each block of this rank's stages computes on
DTensors over the "tp" mesh dimension.

A pipeline stage is torch.distributed.pipelining's split of the exported model: its blocks are
InterpreterModules running aten graphs traced at the whole model's widths (a head count is a
constant in a `view` or an `expand`). Rewriting those widths per rank, as the region graphs'
tp does, would need every shape rule again on a second kind of graph; instead each block's
parameters become DTensors placed as `plan.tp`'s rules say (colwise: split on the output
features, rowwise: on the input features, everything else replicated) and the block's graph
runs on DTensors: an aten op on a DTensor computes the whole-width result from the shards, so
the traced global shapes stay right, and its sharding propagation inserts the collectives (the
all-reduce after a rowwise Linear). At a block's edges its plain inputs enter as replicated
DTensors and its outputs leave as replicated local tensors, so what the stage sends and the
parts outside the blocks (embeddings, final norm, head: kept whole on every tp rank) are
plain tensors. The gradient of a block input is made replicated on the way back (an
all-reduce of the partial sums), as torch's ColwiseParallel does.

Three graph edits let the traced ops run on DTensors (`_ready_for_dtensors`):
- `aten._assert_tensor_metadata` (a trace-time check) has no sharding rule: it is dropped;
- a `view`/`reshape` of a DTensor whose shard is not contiguous locally fails in DTensor's
  local view, forward or backward: it reshapes a contiguous copy both ways (no copy when the
  shard already is contiguous: `contiguous_reshape`);
- `scaled_dot_product_attention`'s CPU backward has no sharding rule: attention runs on each
  rank's heads (`local_attention`: q, k and v split on the head dim, the mask whole), which is
  what tp means for attention; grouped k/v heads stay aligned because both counts divide.

Gradients of the split parameters come out of DTensor's rules in whatever placement it chose
(often Partial); `settle_gradients` redistributes them to their parameters' placements after
each schedule step (FSDP2 does so itself under fsdp+tp+pp).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import fx, nn

from retarget.core.plans import TpPlan

#: The tp styles placed inside a stage; any other (vocab-parallel, sequence) is refused.
_PLACED = ("colwise", "rowwise", "replicate", "replicate_grad_allreduce")


def split_stage_blocks(
    stage_module: nn.Module,
    blocks: list[str],
    prefix: str,
    tp: TpPlan,
    original: nn.Module,
    mesh: Any,
    replaced: dict[int, nn.Parameter],
) -> None:
    """Make the blocks of `stage_module` found at `prefix + path` compute on DTensors over
    `mesh` (the tp mesh) as `tp` says; `replaced` gets (and, for a block cut between two of
    this rank's stages, gives) the DTensor Parameter that replaces each plain one, by the
    plain one's id."""
    for block in blocks:
        try:
            module = stage_module.get_submodule(prefix + block)
        except AttributeError:
            continue  # another stage's block
        for sub in module.modules():
            graph = getattr(sub, "graph", None)
            if isinstance(graph, fx.Graph):
                # the code generated from it is regenerated once every edit is made
                # (apply_pipeline: pipeline_split.run_generated_code)
                _ready_for_dtensors(graph)
        for name, sub in module.named_modules():
            path = f"{block}.{name}" if name else block
            rule = tp.rules.get(path)
            style = rule.style if rule is not None else "replicate"
            if style not in _PLACED:
                raise NotImplementedError(
                    f"tp+pp: {path} is split {style}; inside a pipeline stage only colwise and "
                    "rowwise Linears are split (use tp[plan=auto] without sequence_parallel)"
                )
            for key, param in list(sub._parameters.items()):
                if param is None:
                    continue
                if id(param) not in replaced:  # a block cut between two of this rank's stages
                    placement = _placement(style, key, param, original, path)
                    replaced[id(param)] = _distribute(param, mesh, placement)
                sub._parameters[key] = replaced[id(param)]
        module.forward = functools.partial(_on_dtensors, module.forward, mesh)


def _placement(style: str, key: str, param: nn.Parameter, original: nn.Module, path: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    if style not in ("colwise", "rowwise"):
        return Replicate()
    user_module = original.get_submodule(path)
    # transformers' Conv1D (GPT-2) stores its weight as (in, out), an nn.Linear as (out, in).
    transposed = type(user_module).__name__ == "Conv1D"
    if not (isinstance(user_module, nn.Linear) or transposed):
        raise NotImplementedError(
            f"tp+pp: {path} ({type(user_module).__name__}) is split {style}; inside a pipeline "
            "stage only nn.Linear and transformers' Conv1D are split"
        )
    if key == "bias":
        return Shard(0) if style == "colwise" else Replicate()
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    return Shard(out_dim if style == "colwise" else in_dim)


def _distribute(param: nn.Parameter, mesh: Any, placement: Any) -> nn.Parameter:
    from torch.distributed.tensor import distribute_tensor

    tensor = distribute_tensor(param.detach(), mesh, [placement])
    return nn.Parameter(tensor, requires_grad=param.requires_grad)


def _on_dtensors(forward: Any, mesh: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a block's forward with its plain tensor inputs as replicated DTensors; its DTensor
    outputs come back replicated and local."""
    from torch.distributed.tensor import DTensor, Replicate

    def enter(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            return DTensor.from_local(value, mesh, [Replicate()], run_check=False)
        return value

    def leave(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value.redistribute(mesh, [Replicate()]).to_local()
        return value

    out = forward(*[enter(v) for v in args], **{k: enter(v) for k, v in kwargs.items()})
    if isinstance(out, (tuple, list)):
        return type(out)(leave(v) for v in out)
    return leave(out)


def _ready_for_dtensors(graph: fx.Graph) -> None:
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten._assert_tensor_metadata.default:
            graph.erase_node(node)
        elif node.target is aten.scaled_dot_product_attention.default:
            node.target = local_attention
        elif node.target in (aten.view.default, aten.reshape.default):
            node.target = contiguous_reshape
    graph.lint()


class _ContiguousReshape(torch.autograd.Function):
    """reshape of a contiguous copy, whose gradient is reshaped from a contiguous copy too
    (a DTensor's gradient can arrive with a local shard no view can read)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, shape: list[int]) -> torch.Tensor:
        ctx.shape = tensor.shape
        return _compact(tensor).reshape(shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _compact(grad).reshape(ctx.shape), None


def _compact(tensor: Any) -> Any:
    """A DTensor whose local shard is contiguous (DTensor's own `contiguous()` reads the global
    strides, which can say contiguous when the shard is not)."""
    if tensor.to_local().is_contiguous():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def contiguous_reshape(tensor: Any, shape: list[int]) -> Any:
    """aten view/reshape in a block graph that runs on DTensors (see the module docstring)."""
    if not isinstance(tensor, torch.Tensor) or not hasattr(tensor, "placements"):
        return torch.ops.aten.reshape.default(tensor, shape)
    return _ContiguousReshape.apply(tensor, shape)


def local_attention(
    query: Any, key: Any, value: Any, mask: Any = None, *args: Any, **kwargs: Any
) -> Any:
    """scaled_dot_product_attention on this rank's heads (dim 1) of DTensor q, k and v."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    attention = torch.ops.aten.scaled_dot_product_attention.default
    if not isinstance(query, DTensor):
        return attention(query, key, value, mask, *args, **kwargs)
    mesh = query.device_mesh

    def local(tensor: Any, placement: Any) -> Any:
        if isinstance(tensor, DTensor):
            return tensor.redistribute(mesh, [placement]).to_local()
        return tensor

    heads = [local(t, Shard(1)) for t in (query, key, value)]
    out = attention(*heads, local(mask, Replicate()), *args, **kwargs)
    return DTensor.from_local(out, mesh, [Shard(1)], run_check=False)


def settle_gradients(params: list[nn.Parameter]) -> None:
    """Redistribute each DTensor parameter's gradient to the parameter's own placements."""
    for param in params:
        grad = param.grad
        if grad is None or not hasattr(grad, "placements"):
            continue
        if tuple(grad.placements) != tuple(param.placements):
            param.grad = grad.redistribute(param.device_mesh, param.placements)
