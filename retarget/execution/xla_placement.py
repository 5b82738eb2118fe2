"""Apply the xla plan: SPMD on, the model on the XLA device, parameters annotated, a step
boundary and the inputs moved (and sharded on the batch dim) at every call.

Moving to an XLA device makes new Parameters (an XLA tensor cannot stand in a CPU tensor's
place), so the user's model keeps its CPU ones: build the optimizer from the compiled model's
parameters, and `unwrap()` copies the trained weights back into the user's model. Each call first
cuts the lazy graph (`torch_xla.sync()`): the previous step's forward, backward and optimizer
update run as one compiled XLA program, the way `xm.mark_step` after `optimizer.step()` would,
without the user writing it. `XlaSteps` counts the graphs XLA compiled before each call: after
warm-up (WARM_UP_STEPS: the first steps compile the step, then again once the optimizer has
state) a fixed input shape compiles nothing, so a step after it that compiles a new graph is a
performance bug: it warns once, naming the step and the count, and the report lists every such
step. The graphs of step N are counted at the start of call N+1 (the sync that runs them).
A prepared loader's upload path is runtime.data.xla_feed's `feed_for`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils._pytree import tree_map

from retarget.core.slots import XLA_STEPS
from retarget.execution import xla_device as xla
from retarget.ir.program import Program
from retarget.targets.grammar import Target

#: Calls of one kind allowed to compile. Measured with AdamW: steps 1 and 2 compile (the
#: optimizer's state appears after step 1), none after; the third is margin. Kinds are counted
#: apart (training, eval, no_grad): an eval loop compiles its own graphs.
WARM_UP_STEPS = 3


class XlaRecompileWarning(UserWarning):
    """A step after warm-up compiled a new XLA graph (a changed shape or baked-in value)."""


class XlaSteps:
    """Forward pre-hook of the compiled model: step boundary, inputs to the device, counts."""

    def __init__(self, device: torch.device, shard_batch: bool, devices: int) -> None:
        self.device = device
        self.shard_batch = shard_batch
        self.devices = devices
        self.compiled_before: list[int] = []
        """Graphs compiled in this process before each call (one entry per call)."""
        self.kinds: list[str] = []
        """Each call's kind: "train", "eval", "train/no_grad" or "eval/no_grad"."""
        self.warm_up = WARM_UP_STEPS
        self.warned = False
        self._nth_of_kind: list[int] = []
        self._seen: dict[str, int] = {}

    def __call__(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        xla.sync()
        self.compiled_before.append(xla.compile_count())
        self._warn_on_recompile()
        kind = ("train" if module.training else "eval") + (
            "" if torch.is_grad_enabled() else "/no_grad"
        )
        self._seen[kind] = self._seen.get(kind, 0) + 1
        self.kinds.append(kind)
        self._nth_of_kind.append(self._seen[kind])
        return tree_map(self._place, args), tree_map(self._place, kwargs)

    def per_step(self) -> list[int]:
        """Graphs compiled during each finished step (step N: from call N to call N+1)."""
        counts = self.compiled_before
        return [b - a for a, b in zip(counts, counts[1:], strict=False)]

    def recompiling_steps(self) -> dict[int, int]:
        """Step number (1-based) -> graphs it compiled, for the steps past their kind's warm-up."""
        return {
            step: count
            for step, count in enumerate(self.per_step(), start=1)
            if self._nth_of_kind[step - 1] > self.warm_up and count
        }

    def _warn_on_recompile(self) -> None:
        step = len(self.compiled_before) - 1  # the step this call's sync just ran
        if self.warned or step < 1 or self._nth_of_kind[step - 1] <= self.warm_up:
            return
        count = self.compiled_before[-1] - self.compiled_before[-2]
        if not count:
            return
        self.warned = True
        warnings.warn(
            f"xla: step {step} ({self.kinds[step - 1]}) compiled {count} new XLA graph(s) "
            f"after the {self.warm_up} warm-up steps of its kind, costing a compile each: an "
            "input shape or a Python value baked into the graph changed (a last partial batch: "
            "drop_last=True; varying lengths: pad to a few fixed sizes). Warned once; "
            "compiled.report lists the recompiling steps",
            XlaRecompileWarning,
            stacklevel=4,
        )

    def _place(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        moved = value if value.device == self.device else value.to(self.device)
        if self.shard_batch and moved.dim() >= 1 and moved.shape[0] % self.devices == 0:
            if not xla.sharding_spec(moved):
                xla.mark_sharding(moved, (xla.MESH_AXIS,) + (None,) * (moved.dim() - 1))
        return moved

    def recompiles_after(self, warm_up: int) -> int:
        """Graphs compiled after the first `warm_up` calls (up to the last call's start)."""
        if len(self.compiled_before) <= warm_up:
            return 0
        return self.compiled_before[-1] - self.compiled_before[warm_up]

    def describe(self) -> str:
        if not self.compiled_before:
            return "xla steps: no call yet"
        steps = self.per_step()
        shown = ", ".join(map(str, steps[:12])) + (", ..." if len(steps) > 12 else "")
        late = list(self.recompiling_steps().items())
        after = "recompiled at " + ", ".join(f"step {s} ({n})" for s, n in late[:8])
        if len(late) > 8:
            after += f", ... ({len(late)} steps in all, each in to_dict())"
        after = after if late else "none"
        return (
            f"xla steps: {len(self.compiled_before)} calls; graphs compiled per step [{shown}] "
            f"(step N counted when call N+1 starts); after warm-up ({self.warm_up} steps of "
            f"each kind): {after}"
        )

    def to_dict(self) -> dict[str, Any]:
        late = self.recompiling_steps()
        return {
            "calls": len(self.compiled_before),
            "compiled_per_step": self.per_step(),
            "warm_up_steps": self.warm_up,
            "recompiling_steps": {str(step): count for step, count in late.items()},
        }


def apply_xla(program: Program) -> None:
    """Realise program.plan.xla on program.module (nothing without an xla plan)."""
    plan = program.plan.xla
    if plan is None:
        return
    if plan.spmd:
        xla.enable_spmd()
    device = xla.device()
    xla.check_backward_runs()  # a CPU backward before XLA's runtime: refused, saying what to do
    module = program.module
    module.to(device)
    for name, param in module.named_parameters():
        spec = plan.shards.get(name)
        if spec is not None:
            xla.mark_sharding(param, spec)
    steps = XlaSteps(device, shard_batch=plan.spmd and plan.devices > 1, devices=plan.devices)
    module.register_forward_pre_hook(steps, with_kwargs=True)
    XLA_STEPS.set(module, steps)


def xla_steps(module: Any) -> XlaSteps | None:
    """The step counter of a model compiled for xla, else None."""
    return XLA_STEPS.get(module)


def xla_device_for(target: Target) -> torch.device:
    """The XLA device `target` trains on, SPMD switched on first when it asks for it (the
    switch must precede the first XLA tensor, which a caller holding the device may create)."""
    if target.get("xla").get("spmd"):
        xla.enable_spmd()
    return xla.device()
