"""Optimizers against a compiled model: remap parameters, shard state (zero1), scale (fp16), guard.

`Runtime.prepare(optimizer)` calls `prepare_optimizer`:

1. Remap. An optimizer built before compile_for holds the original model's Parameters. Under DDP
   those are the compiled model's own (the structural copy shares them), but FSDP2 replaces each
   by a DTensor shard. Each parameter is mapped by identity to its name in the original model and
   replaced, in place in the optimizer's param groups, by the compiled model's parameter of that
   name. An optimizer that already stepped keeps state for the old tensors: refused.
2. zero1: the optimizer becomes a ZeroRedundancyOptimizer of the same class, param groups and
   hyperparameters (its state is sharded over the ranks).
3. fp16: the optimizer is wrapped in `ScaledOptimizer`, whose step unscales the gradients, skips
   the step when the loss scaler found inf/nan (all ranks agree), and updates the scale.

The step guard that apply_plan installs (refusing an unprepared optimizer where a plain step
would be wrong) is the execution layer's: retarget/execution/step_guard.py.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from retarget.execution.step_guard import OptimizerNotPrepared
from retarget.kernels.quant.linear import QuantizedLinear
from retarget.runtime.scaler import LossScaler

# -- remapping ------------------------------------------------------------------------------


def remap_parameters(optimizer: Optimizer, compiled: nn.Module, original: nn.Module) -> int:
    """Point the optimizer at the compiled model's parameters; returns how many changed."""
    current = dict(compiled.named_parameters())
    target: dict[int, torch.Tensor] = {id(p): p for p in current.values()}
    for name, param in original.named_parameters():
        if name in current:
            target.setdefault(id(param), current[name])
    changed = 0
    for group in optimizer.param_groups:
        new = [target.get(id(p), p) for p in group["params"]]
        for old, replacement in zip(group["params"], new, strict=True):
            if old is not replacement:
                if optimizer.state.get(old):
                    raise OptimizerNotPrepared(
                        f"prepare: {type(optimizer).__name__} already has state for a parameter "
                        "that compile_for replaced (FSDP shards it): prepare the optimizer "
                        "before its first step, or create it after compile_for"
                    )
                changed += 1
        group["params"] = new
    return changed


def warn_frozen_quantized(optimizer: Optimizer, compiled: nn.Module) -> int:
    """Warn when the optimizer holds the frozen packed weights of quantized Linears (quant).

    They never get a gradient, so torch's optimizers skip them and training is right; but the
    user most likely meant to pass only the trainable parameters (the adapters). Returns how
    many it holds."""
    frozen = {
        id(module.weight)
        for module in compiled.modules()
        if isinstance(module, QuantizedLinear) and not module.weight.requires_grad
    }
    count = sum(id(p) in frozen for group in optimizer.param_groups for p in group["params"])
    if count:
        warnings.warn(
            f"prepare: {type(optimizer).__name__} holds {count} frozen quantized weights "
            "(quant): they get no gradient and are skipped; pass only the trainable "
            "parameters, e.g. [p for p in model.parameters() if p.requires_grad]",
            stacklevel=3,
        )
    return count


# -- zero1 ----------------------------------------------------------------------------------


def zero_redundancy(optimizer: Optimizer) -> Optimizer:
    """A ZeroRedundancyOptimizer of `optimizer`'s class, groups and hyperparameters."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if optimizer.state:
        raise OptimizerNotPrepared(
            f"prepare: zero1 shards optimizer state, but {type(optimizer).__name__} already "
            "stepped; prepare it before its first step"
        )
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [dict(group) for group in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)


# -- fp16 -----------------------------------------------------------------------------------


class ScaledOptimizer(Optimizer):
    """The user's optimizer, stepping through the fp16 loss scaler.

    `step()` unscales the gradients (unless clip_grad_norm_ already did), steps only when no
    rank found inf/nan, and updates the scale; on a micro-step that does not sync gradients it
    does nothing. param_groups, state and state_dict are the wrapped optimizer's, so LR
    schedulers built on either object drive the same learning rates.
    """

    def __init__(self, optimizer: Optimizer, runtime: Any):
        # Optimizer.__init__ is not called: this object owns no parameters, it forwards.
        self.optimizer = optimizer
        self._runtime = weakref.proxy(runtime)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise ValueError("ScaledOptimizer.step: closures are not supported under fp16")
        runtime = self._runtime
        if not runtime.sync_gradients:
            return None
        guard = runtime.guard
        if not guard.scaled_gradients:
            # No loss was scaled since the last step (DCP sets a fresh optimizer's state up by
            # stepping it with zero gradients before any backward; or a backward that did not go
            # through run.backward): the gradients are as they are, so step plainly.
            with guard.stepping(self.optimizer):
                self.optimizer.step()
            runtime.step_was_skipped = False
            return None
        scaler: LossScaler = runtime.scaler
        unscale_agreed(scaler, self.optimizer, runtime.state)
        with guard.stepping(self.optimizer):
            stepped = scaler.step(self.optimizer)
        scaler.update()
        guard.scaled_gradients = False
        runtime.step_was_skipped = not stepped
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"ScaledOptimizer({self.optimizer!r})"


def unscale_agreed(scaler: LossScaler, optimizer: Optimizer, state: Any) -> None:
    """Unscale `optimizer`'s gradients once per step; every rank sees any rank's inf/nan.

    torch's GradScaler decides per process; with sharded (DTensor) gradients each rank sees only
    its shard, so the found-inf flag is max-reduced across ranks (what FSDP's ShardedGradScaler
    does). DTensor gradients are unscaled through their local shards.
    """
    from torch.amp.grad_scaler import OptState

    inner = scaler.grad_scaler
    per_optimizer = inner._per_optimizer_states[id(optimizer)]
    if per_optimizer["stage"] is not OptState.READY:
        return
    inv_scale = inner._scale.double().reciprocal().float()
    found_inf = torch.zeros((), dtype=torch.float32, device=inner._scale.device)
    grouped: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                grad = getattr(param.grad, "_local_tensor", param.grad)
                grouped.setdefault((grad.device, grad.dtype), []).append(grad)
    with torch.no_grad():
        for (device, _), grads in grouped.items():
            flag = found_inf if device == found_inf.device else found_inf.to(device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(device))
            if flag is not found_inf:
                found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device)))
    if state.distributed:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    per_optimizer["found_inf_per_device"] = {found_inf.device: found_inf}
    per_optimizer["stage"] = OptState.UNSCALED
