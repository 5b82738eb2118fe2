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

`StepGuard` is a global optimizer step pre-hook that apply_plan installs where stepping a plain
optimizer would be silently wrong: under FSDP an optimizer holding the original (replaced)
Parameters updates tensors the model no longer uses; under zero1 an unprepared optimizer skips
the sharding; under fp16 an unprepared optimizer would step on gradients that `run.backward`
left multiplied by the loss scale. Its first such step raises OptimizerNotPrepared instead,
naming what to call. (fp16 with the user's own GradScaler, never calling run.backward, is left
alone.)
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from retarget.core.slots import STEP_GUARD
from retarget.runtime.scaler import LossScaler


class OptimizerNotPrepared(ValueError):
    """An optimizer steps the compiled model in a way the target needs prepared first."""


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
        scaler: LossScaler = runtime.scaler
        unscale_agreed(scaler, self.optimizer, runtime.state)
        guard = runtime.guard
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


# -- guard ----------------------------------------------------------------------------------


class StepGuard:
    """Global optimizer step pre-hook: refuses optimizers that would step the model wrongly.

    - stale: the optimizer holds original Parameters that FSDP replaced (always refused);
    - zero1 (`requires_prepare`): an unprepared optimizer would keep the whole state per rank;
    - fp16 (`scaled_gradients`): the runtime's backward left gradients multiplied by its loss
      scale, which only a prepared optimizer unscales (a user stepping through their own
      GradScaler never called run.backward, so that flag stays down).
    """

    def __init__(self, compiled: nn.Module, *, stale: set[int], requires_prepare: str | None):
        self._model = weakref.ref(compiled)
        self.stale = stale
        self.requires_prepare = requires_prepare
        self.scaled_gradients = False
        """Set by Runtime.backward when it scaled the loss; cleared by the prepared step."""
        self.prepared: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self._stepping: set[int] = set()
        # Weak keys, not ids: a new optimizer may reuse a dead one's id.
        self._touches: weakref.WeakKeyDictionary[Optimizer, tuple[int, bool, bool]] = (
            weakref.WeakKeyDictionary()
        )
        self.handle = register_optimizer_step_pre_hook(self)
        weakref.finalize(compiled, self.handle.remove)

    def allow(self, optimizer: Optimizer) -> None:
        """`optimizer` was prepared: its steps are fine."""
        self.prepared.add(optimizer)

    def stepping(self, optimizer: Optimizer) -> _Stepping:
        """Context: `optimizer` steps on behalf of a prepared wrapper, for the duration."""
        return _Stepping(self._stepping, id(optimizer))

    def allow_inner(self, outer: Optimizer, inner: Optimizer) -> None:
        """`inner` may step while `outer` steps (ZeroRedundancyOptimizer's local optimizer)."""
        active = self._stepping
        outer.register_step_pre_hook(lambda *_: active.add(id(inner)))
        outer.register_step_post_hook(lambda *_: active.discard(id(inner)))

    def __call__(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer in self.prepared or id(optimizer) in self._stepping:
            return
        model = self._model()
        if model is None:
            return
        stale, steps_model = self._what_it_touches(optimizer, model)
        name = type(optimizer).__name__
        if stale:
            raise OptimizerNotPrepared(
                f"{name} holds the model's parameters from before compile_for, which FSDP "
                "replaced by shards: the step would change tensors the model no longer uses. "
                "Call optimizer = compiled.runtime.prepare(optimizer), or create the optimizer "
                "after compile_for"
            )
        why = self.requires_prepare or (
            "fp16: run.backward scaled the loss, and only a prepared optimizer unscales the "
            "gradients and skips inf/nan steps"
            if self.scaled_gradients
            else None
        )
        if steps_model and why:
            raise OptimizerNotPrepared(
                f"{name} steps the compiled model, but target '{model.program.target}' needs "
                f"it prepared ({why}): call optimizer = compiled.runtime.prepare(optimizer) "
                "and step the returned object"
            )

    def _what_it_touches(self, optimizer: Optimizer, model: nn.Module) -> tuple[bool, bool]:
        """(holds stale parameters, holds the model's parameters), cached per param count."""
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        cached = self._touches.get(optimizer)
        if cached is None or cached[0] != count:
            ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
            current = {id(p) for p in model.parameters()}
            cached = (count, bool(ids & self.stale), bool(ids & current))
            self._touches[optimizer] = cached
        return cached[1], cached[2]


class _Stepping:
    def __init__(self, active: set[int], key: int):
        self.active, self.key = active, key

    def __enter__(self) -> None:
        self.active.add(self.key)

    def __exit__(self, *exc: object) -> None:
        self.active.discard(self.key)


def install_guard(program: Any) -> StepGuard | None:
    """The StepGuard a compiled program needs, installed; None when plain optimizers are fine."""
    plan = program.plan
    zero1 = plan.zero1 is not None and plan.applied is not None and plan.applied.applied
    current = {id(p) for p in program.module.parameters()}
    stale = {id(p) for p in program.original.parameters()} - current
    if not (zero1 or stale or plan.loss_scaler is not None):
        return None
    reason = "zero1 shards its state" if zero1 else None
    guard = StepGuard(program.module, stale=stale, requires_prepare=reason)
    STEP_GUARD.set(program.module, guard)
    return guard


def guard_of(module: nn.Module) -> StepGuard | None:
    return STEP_GUARD.get(module)
