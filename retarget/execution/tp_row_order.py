"""tp parameters stored in rank order (fused parts of unequal widths) seen in the model's order.

Phi3's qkv under GQA is q|k|v of unequal widths: no DTensor placement gives rank r its slice of
each part, so apply_tp stores the weight with its rows in rank order (core.tp_split_dims.
RowOrder) and splits that evenly. What the user reads by name must still be the model's tensor:
hooks on the module give `state_dict()` (and so DCP checkpoints and save_model) those parameters
whole in the model's order, and turn a whole tensor in the model's order back into the stored
DTensor on load (a checkpoint written without tp, or at another degree, loads right).
`in_model_order` does the same for a parameter's gradient or optimizer state; `full_tensor()`
of the parameter itself is in rank order.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from retarget.core.tp_split_dims import ROW_ORDER, RowOrder


def keep_model_order(module: nn.Module, orders: dict[str, RowOrder], group: Any) -> None:
    """state_dict gives the parameters stored in rank order whole, in the model's order; load
    takes that back (module docstring). Each call of state_dict gathers them: a collective.
    Parts every rank holds whole get their gradient summed over the tp `group` (each rank's is
    partial: only its heads read them); the parameter carries its order (ROW_ORDER), so that
    clipping counts those rows once."""
    module.__dict__[ROW_ORDERS] = orders
    for name, order in orders.items():
        param = module._parameters[name]
        setattr(param, ROW_ORDER, order)
        if order.whole and param.requires_grad:
            param.register_hook(partial(_sum_whole_rows, order, group))
    module._register_state_dict_hook(_model_order_state)
    module.register_load_state_dict_pre_hook(_stored_order_load)


#: The attribute a module whose parameters are stored in rank order keeps its RowOrders in.
ROW_ORDERS = "_retarget_tp_row_orders"


def _sum_whole_rows(order: RowOrder, group: Any, grad: DTensor) -> DTensor:
    """The gradient with the rows of the parts every rank holds whole summed over `group`
    (before it is accumulated into .grad, so accumulation windows stay exact)."""
    local = grad.to_local().clone()  # the parameter is a DTensor, and so its gradient
    rows = order.whole_rows.to(local.device)
    summed = local.index_select(order.dim, rows)
    dist.all_reduce(summed, group=group)
    local.index_copy_(order.dim, rows, summed)
    return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)


def in_model_order(module: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (module's parameter `name`, its gradient or its optimizer state) whole, in
    the model's order: `full_tensor()` of a DTensor, put back from rank order when stored so."""
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    order = module.__dict__.get(ROW_ORDERS, {}).get(name)
    return whole if order is None else order.to_model(whole)


def _model_order_state(module: nn.Module, state_dict: dict, prefix: str, _metadata: Any) -> None:
    for name in module.__dict__[ROW_ORDERS]:
        key = prefix + name
        if key in state_dict:
            state_dict[key] = in_model_order(module, name, state_dict[key].detach())


def _stored_order_load(module: nn.Module, state_dict: dict, prefix: str, *_args: Any) -> None:
    """A state dict holds these parameters in the model's order: a plain tensor, or a DTensor
    read whole (torch's set_model_state_dict with full_state_dict distributes the whole
    tensor with the live parameter's placements, which say nothing of the order)."""
    for name in module.__dict__[ROW_ORDERS]:
        key, live = prefix + name, module._parameters.get(name)
        value = state_dict.get(key)
        if value is not None and isinstance(live, DTensor):
            state_dict[key] = stored_like(module, name, value, live)


def stored_like(module: nn.Module, name: str, value: torch.Tensor, live: DTensor) -> DTensor:
    """`value` (whole, in the model's order) as a DTensor stored like `live` (parameter `name`
    of `module`, or its optimizer state)."""
    whole = value.full_tensor() if isinstance(value, DTensor) else value
    stored = module.__dict__[ROW_ORDERS][name].to_stored(whole.to(live.device))
    return distribute_tensor(stored, live.device_mesh, live.placements, src_data_rank=None)


def _stored_in_rank_order(model: nn.Module, fqn: str) -> tuple[nn.Module, str] | None:
    owner, _, name = fqn.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return None
    return (module, name) if name in module.__dict__.get(ROW_ORDERS, {}) else None


def optimizer_state_in_model_order(model: nn.Module, optim_state: dict[str, Any]) -> None:
    """In an optimizer state dict keyed by parameter names (torch's get_state_dict), the
    state of parameters stored in rank order (Adam's moments) whole in the model's order, so a
    checkpoint holds what one process would; in place."""
    for fqn, states in list(optim_state.get("state", {}).items()):
        found = _stored_in_rank_order(model, fqn)
        if found is not None:  # a new dict: torch hands out the optimizer's own
            optim_state["state"][fqn] = {
                key: in_model_order(*found, v) if isinstance(v, DTensor) and v.ndim else v
                for key, v in states.items()
            }


def optimizer_state_in_stored_order(model: nn.Module, optim_state: dict[str, Any]) -> None:
    """The inverse of `optimizer_state_in_model_order`, stored like each parameter."""
    for fqn, states in list(optim_state.get("state", {}).items()):
        found = _stored_in_rank_order(model, fqn)
        if found is None:
            continue
        live = found[0]._parameters[found[1]]
        for key, value in states.items():
            if isinstance(value, torch.Tensor) and value.ndim and isinstance(live, DTensor):
                states[key] = stored_like(*found, value, live)
