"""Apply the xla plan: SPMD on, the model on the XLA device, parameters annotated, a step
boundary and the inputs moved (and sharded on the batch dim) at every call.

Moving to an XLA device makes new Parameters (an XLA tensor cannot stand in a CPU tensor's
place), so the user's model keeps its CPU ones: build the optimizer from the compiled model's
parameters, and `unwrap()` copies the trained weights back into the user's model. Each call first
cuts the lazy graph (`torch_xla.sync()`): the previous step's forward, backward and optimizer
update run as one compiled XLA program, the way `xm.mark_step` after `optimizer.step()` would,
without the user writing it. `XlaSteps` counts the graphs XLA compiled before each call: after
warm-up a fixed input shape compiles nothing (a recompiling step is a performance bug, named in
the report).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from retarget.core.slots import XLA_STEPS
from retarget.ir.program import Program
from retarget.kernels import xla


class XlaSteps:
    """Forward pre-hook of the compiled model: step boundary, inputs to the device, counts."""

    def __init__(self, device: torch.device, shard_batch: bool, devices: int) -> None:
        self.device = device
        self.shard_batch = shard_batch
        self.devices = devices
        self.compiled_before: list[int] = []
        """Graphs compiled in this process before each call (one entry per call)."""

    def __call__(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        xla.sync()
        self.compiled_before.append(xla.compile_count())
        return tree_map(self._place, args), tree_map(self._place, kwargs)

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
        counts = self.compiled_before
        if not counts:
            return "xla steps: no call yet"
        per_call = [b - a for a, b in zip(counts, counts[1:], strict=False)]
        return f"xla steps: {len(counts)} calls, graphs compiled between calls {per_call}"


def apply_xla(program: Program) -> None:
    """Realise program.plan.xla on program.module (nothing without an xla plan)."""
    plan = program.plan.xla
    if plan is None:
        return
    if plan.spmd:
        xla.enable_spmd()
    device = xla.device()
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
