"""The optimizer step guard: refuses a plain optimizer step that would be silently wrong.

`StepGuard` is a global optimizer step pre-hook that apply_plan installs where stepping a plain
optimizer would be silently wrong: under FSDP an optimizer holding the original (replaced)
Parameters updates tensors the model no longer uses; under zero1 an unprepared optimizer skips
the sharding; under fp16 an unprepared optimizer would step on gradients that `run.backward`
left multiplied by the loss scale. Its first such step raises OptimizerNotPrepared instead,
naming what to call (`compiled.runtime.prepare(optimizer)`, runtime/optimizers.py). fp16 with
the user's own GradScaler, never calling run.backward, is left alone.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from retarget.core.slots import STEP_GUARD


class OptimizerNotPrepared(ValueError):
    """An optimizer steps the compiled model in a way the target needs prepared first."""


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
