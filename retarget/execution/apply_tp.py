"""Apply a TpPlan: torch's parallel styles on the planned modules, over the "tp" mesh dim.

`apply_tp(module, plan, mesh)` calls `torch.distributed.tensor.parallel.parallelize_module` on
each planned module with the style its rule names, then sets the per-rank attribute values
(`plan.attribute_fixes`, e.g. GPT-2's `split_size`). Parameters become DTensors; inputs and
outputs are converted by the styles' own hooks, so the model code between two split modules
sees plain local tensors (colwise output: this rank's slice of the features; rowwise output:
the whole, all-reduced by DTensor).

Styles (core.plans.TP_STYLES) and what realises each:
- colwise / colwise_rep / rowwise / rowwise_rep on nn.Linear and nn.Embedding: torch's
  ColwiseParallel / RowwiseParallel themselves;
- the same on GPT-2's Conv1D (weight [in, out]) and on a module with fused parts (q|k|v along
  its output dim, `plan.fused`): `SplitColwise` / `SplitRowwise`, subclasses of torch's styles
  that only change how the parameters are distributed (the dims come from core.tp_split_dims). A
  fused weight is distributed as `_StridedShard(dim, split_factor=parts)`: each rank holds its
  slice of every part, and the DTensor still describes the original [q|k|v] tensor, so
  `full_tensor()`, state_dict and DCP see the unfused-order weight. Fused parts of unequal
  widths (`plan.fused_widths`, Phi3's q|k|v under GQA) have no DTensor placement: the weight
  is stored with its rows in rank order (core.tp_split_dims.RowOrder) and split evenly, so
  rank r holds [q_r|k_r|v_r]; hooks on the module give state_dict (and so DCP, save_model)
  the model's order whole, and take it back on load. `full_tensor()` of the parameter and of
  its gradient is in rank order (`in_model_order` turns it back);
- sequence_parallel: torch's SequenceParallel (a norm on sequence slices; DTensor out);
  replicate: nothing, or at a sequence boundary PrepareModuleInput (a replicated LM head
  gathers the sequence) / PrepareModuleOutput (a replicated embedding's output is split on it);
- a rule's `sequence` ("gather"/"scatter") sets the layouts of torch's styles at the boundary of
  the sequence-split residual stream (see `style_for`); `vocab_output` keeps the LM head's
  logits a vocab-split DTensor, the compiled forward then runs inside torch's
  `loss_parallel()` and its loss's backward too (`enter_loss_parallel`);
- replicate_grad_allreduce (a per-head norm read on split heads): kept whole, and a hook on
  each parameter all-reduces its partial gradient over the tp ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from retarget.core.plans import TpPlan, TpRule
from retarget.core.slots import OUTER_FORWARD
from retarget.core.tp_split_dims import RowOrder, module_kind, set_width, split_dims
from retarget.execution.module_call import own_forward
from retarget.execution.tp_row_order import keep_model_order

SEQUENCE = Shard(1)  # the residual stream's split under sequence parallelism: (batch, seq, hidden)


def apply_tp(module: nn.Module, plan: TpPlan, mesh: Any) -> list[str]:
    """Split `module`'s planned submodules over the 1-D `mesh`; the paths split, in order."""
    done = []
    tied = _tied_parameters(module)
    for path, rule in plan.rules.items():
        target = module.get_submodule(path)
        if rule.style == "replicate_grad_allreduce":
            all_reduce_gradients(target, mesh.get_group())
            continue
        widths = plan.fused_widths.get(path)
        whole = plan.fused_whole.get(path, ())
        style = style_for(rule, target, plan.fused.get(path, 1), widths, whole)
        if style is None:
            continue
        parallelize_module(target, mesh, style)
        if rule.style != "replicate":
            done.append(path)
    _tie_again(tied)
    if plan.loss_parallel:
        enter_loss_parallel(module)
    for path, values in plan.attribute_fixes.items():
        if path in done:
            # A split module's own forward runs on DTensors, whose sizes are the whole
            # tensor's (Conv1D's `nf`): its widths stay; only the code between split modules
            # sees one rank's slice.
            continue
        target = module.get_submodule(path)
        for attribute, value in values.items():
            set_width(target, attribute, value)
    return done


def _tied_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, name) users of each parameter that more than one module holds (an LM head
    tied to the input embedding)."""
    users: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            users.setdefault(id(param), []).append((sub, name))
    return [group for group in users.values() if len(group) > 1]


def _tie_again(tied: list[list[tuple[nn.Module, str]]]) -> None:
    """Distributing a parameter registers a new one on its module; the other users of a tied
    parameter get that same one back (both splits must place it alike: loss_parallel splits
    the embedding and the head on the vocabulary, dim 0 of both)."""
    for group in tied:
        params = [getattr(sub, name) for sub, name in group]
        split = [p for p in params if isinstance(p, DTensor)]
        if not split:
            continue
        if any(p.placements != split[0].placements for p in split):
            where = ", ".join(f"{type(sub).__name__}.{name}" for sub, name in group)
            raise ValueError(f"tp: tied parameter {where} split differently by its users")
        for sub, name in group:
            sub.register_parameter(name, split[0])


def all_reduce_gradients(module: nn.Module, group: Any) -> None:
    """Sum each gradient contribution of `module`'s parameters over the tp `group` as it
    arrives (before it is accumulated into .grad, so accumulation windows stay exact): each
    rank computed it from its own heads only."""

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    for param in module.parameters(recurse=False):
        if param.requires_grad:
            param.register_hook(summed)


def style_for(
    rule: TpRule,
    module: nn.Module,
    parts: int = 1,
    widths: tuple[int, ...] | None = None,
    whole: tuple[int, ...] = (),
) -> Any:
    """The ParallelStyle that realises `rule` on `module` (None: nothing to install).

    Sequence boundaries (`rule.sequence`) set the layouts: "gather" reads an input split on
    the sequence (Shard(1)) and all-gathers it, "scatter" reduce-scatters the output onto the
    sequence and hands on the DTensor, so the stream between blocks keeps its whole shape
    (model code reading `hidden_states.shape` sees the whole sequence). `vocab_output` keeps
    the logits a DTensor split over the vocabulary (Shard(-1)), for torch's loss_parallel().
    """
    style, sequence = rule.style, rule.sequence
    if style == "replicate_grad_allreduce":
        return None
    if style == "replicate":
        if sequence in ("scatter_input", "gather_output"):
            return StreamBoundary(sequence)
        if sequence == "gather":
            return PrepareModuleInput(
                input_layouts=(SEQUENCE,),
                desired_input_layouts=(Replicate(),),
                use_local_output=True,  # the whole sequence, into a plain module
            )
        if sequence == "scatter":
            return PrepareModuleOutput(
                output_layouts=(Replicate(),),
                desired_output_layouts=(SEQUENCE,),
                use_local_output=False,
            )
        return None
    if style == "sequence_parallel":
        return SequenceParallel()
    kwargs: dict[str, Any] = {}
    if sequence == "gather":
        kwargs["input_layouts"] = SEQUENCE
    if sequence == "scatter":
        kwargs.update(output_layouts=SEQUENCE, use_local_output=False)
    if rule.vocab_output:
        kwargs.update(output_layouts=Shard(-1), use_local_output=False)
    if style == "colwise_rep":
        kwargs["output_layouts"] = Replicate()
    if style == "rowwise_rep":
        kwargs["input_layouts"] = Replicate()
    kind = module_kind(module)
    plain = kind in ("linear", "embedding") and parts == 1 and not widths
    if style in ("colwise", "colwise_rep"):
        if plain:
            return ColwiseParallel(**kwargs)
        return SplitColwise(kind, parts, widths, whole, **kwargs)
    if style in ("rowwise", "rowwise_rep"):
        return OwnedRowwise(**kwargs) if plain else SplitRowwise(kind, **kwargs)
    raise ValueError(f"unknown tensor-parallel style {style!r}")


def enter_loss_parallel(module: nn.Module) -> None:
    """Run the compiled model's forward inside torch's loss_parallel(), so a cross entropy in
    the model's code (HF's ForCausalLMLoss from `labels`) reads the vocab-split logits.

    `loss` comes back a plain tensor (it is whole on every rank) that carries its backward's
    context: a hook on it enters loss_parallel() when the backward reaches it, one on the
    logits leaves it once the cross entropy's backward is done. So `loss.backward()`,
    `compiled.runtime.backward(loss)` and `Accelerator.backward(loss)` all work, and nothing
    else runs under the context."""
    OUTER_FORWARD.set(module, partial(_forward_in_loss_parallel, module))


def _forward_in_loss_parallel(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    with loss_parallel():
        output = own_forward(module, *args, **kwargs)
    mapping = isinstance(output, Mapping)
    if mapping:
        loss, logits = output.get("loss"), output.get("logits")
    elif isinstance(output, tuple) and len(output) > 1:  # return_dict=False: (loss, logits, ..)
        loss, logits = output[0], output[1]
    else:
        return output
    if not isinstance(loss, DTensor) or loss.ndim:
        return output
    loss = loss.to_local()  # Replicate: each rank's local value is the whole loss
    if loss.requires_grad and isinstance(logits, DTensor) and logits.requires_grad:
        entered: list[Any] = []
        loss.register_hook(partial(_enter_backward, entered))
        logits.register_hook(partial(_leave_backward, entered))
    if mapping:
        output["loss"] = loss
        return output
    return (loss, *output[1:])


def _enter_backward(entered: list[Any], grad: torch.Tensor) -> None:
    entered.append(loss_parallel())
    entered[-1].__enter__()


def _leave_backward(entered: list[Any], grad: torch.Tensor) -> None:
    if entered:
        entered.pop().__exit__(None, None, None)


def _distribute_params(
    module: nn.Module,
    mesh: Any,
    kind: str,
    style: str,
    parts: int,
    src_data_rank: int | None,
    widths: tuple[int, ...] | None = None,
    whole: tuple[int, ...] = (),
) -> None:
    orders: dict[str, RowOrder] = {}
    for name, dim in split_dims(kind, style).items():
        param = getattr(module, name, None)
        if param is None:
            continue
        tensor = param.detach()
        if dim is None:
            placement: Any = Replicate()
        elif widths:
            orders[name] = RowOrder(dim, widths, mesh.size(), whole)
            tensor = orders[name].to_stored(tensor)
            placement = Shard(dim)
        elif parts > 1:
            placement = _StridedShard(dim, split_factor=parts)
        else:
            placement = Shard(dim)
        split = distribute_tensor(tensor, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
    if orders:
        keep_model_order(module, orders, mesh.get_group())


class SplitColwise(ColwiseParallel):
    """ColwiseParallel for Conv1D and fused-output modules: parameters split by the layout
    table (fused parts one by one), input and output handled as torch's ColwiseParallel does."""

    def __init__(
        self,
        kind: str,
        parts: int = 1,
        widths: tuple[int, ...] | None = None,
        whole: tuple[int, ...] = (),
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.kind, self.parts, self.widths, self.whole = kind, parts, widths, whole

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        style = "colwise_rep" if self.output_layouts == (Replicate(),) else "colwise"
        return distribute_module(
            module,
            device_mesh,
            lambda name, mod, mesh: _distribute_params(
                mod, mesh, self.kind, style, self.parts, self.src_data_rank, self.widths, self.whole
            ),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(_colwise_output, self.output_layouts, self.use_local_output),
        )


def _colwise_output(
    output_layouts: tuple[Any, ...], use_local_output: bool, mod: nn.Module, outputs: Any, mesh: Any
) -> Any:
    """Output of a colwise split: kept as sharded on the last dim (a strided shard of fused
    parts stays strided: its local tensor is [q_r|k_r|v_r], what the model code splits), or
    gathered whole when the style asks for Replicate."""
    dim = getattr(outputs.placements[0], "dim", None)  # Shard and _StridedShard have one
    last = dim in (-1, outputs.ndim - 1)
    if output_layouts[0].is_replicate() or not last:
        outputs = outputs.redistribute(placements=output_layouts)
    return outputs.to_local() if use_local_output else outputs


class StreamBoundary(ParallelStyle):
    """Where glue that computes on the whole stream meets the split one, on a block the plan
    keeps whole (tp_sequence): "scatter_input" cuts the block's hidden-state input (its first
    positional argument, or `hidden_states`) to this rank's sequence slice, a Replicate ->
    Shard(1) redistribute with no communication (its backward all-gathers the gradient);
    "gather_output" all-gathers the block's output (or its first element) whole. Hooks on the
    block itself run around its graph, as FSDP2's do."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if self.where == "scatter_input":
            module.register_forward_pre_hook(partial(_split_input, device_mesh), with_kwargs=True)
        else:
            module.register_forward_hook(partial(_joined_output, device_mesh))
        return module


def _split_input(mesh: Any, _module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    def split(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        whole = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        return whole.redistribute(mesh, (SEQUENCE,))

    if args:
        return (split(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": split(kwargs["hidden_states"])}
    return args, kwargs


def _joined_output(mesh: Any, _module: nn.Module, _args: tuple, output: Any) -> Any:
    def joined(x: Any) -> Any:
        if not isinstance(x, DTensor):
            return x
        return x.redistribute(mesh, (Replicate(),)).to_local()

    if isinstance(output, tuple):
        return (joined(output[0]), *output[1:]) if output else output
    return joined(output)


class OwnedRowwise(RowwiseParallel):
    """RowwiseParallel whose plain output is the module's own tensor, not the view of the
    DTensor's local tensor that `to_local()` hands out: autograd forbids modifying that view in
    place, and model code adds the residual into a block's output in place (Falcon's
    `mlp_output += attention_output`). The copy is one activation per split module, next to a
    matmul over it; torch.compile elides it where nothing writes into it."""

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, mesh: Any
    ) -> Any:
        outputs = RowwiseParallel._prepare_output_fn(output_layouts, False, mod, outputs, mesh)
        return outputs.to_local().clone() if use_local_output else outputs


class SplitRowwise(OwnedRowwise):
    """RowwiseParallel for Conv1D: weight split on its input dim (dim 0 of [in, out]), bias
    kept whole; input and output handled as torch's RowwiseParallel does for nn.Linear."""

    def __init__(self, kind: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.kind = kind

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        self.desired_input_layouts = (Replicate(),) if self.kind == "embedding" else (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            lambda name, mod, mesh: _distribute_params(
                mod, mesh, self.kind, "rowwise", 1, self.src_data_rank
            ),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


def is_split(param: Any) -> bool:
    """Whether a parameter is a DTensor (split or placed by tp or fsdp)."""
    return isinstance(param, DTensor)
