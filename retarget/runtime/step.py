"""The training step's gradient mechanics: accumulation windows, no-sync, held gradients, clipping.

Gradient accumulation with a plain optimizer that steps every micro-step:

    for batch in loader:
        with run.accumulate():               # N micro-steps per window
            run.backward(model(**batch).loss)
            optimizer.step(); optimizer.zero_grad()

- A window ends (`sync_gradients` is True) on its N-th micro-step, or on the active loader's
  last batch (`end_of_dataloader`), so a last partial window also steps.
- Non-final micro-steps run under no-sync: DDP's `no_sync()` (gradients accumulate locally, no
  all-reduce), FSDP2's `set_requires_gradient_sync(False)` (FSDP accumulates unsharded
  gradients internally and leaves the sharded `p.grad` None).
- The optimizer must not see a non-final micro-step's gradients. After such a backward the
  gradients left in `p.grad` (DDP, one process) are moved into a `HeldGradients` store and
  `p.grad` is set to None, so `optimizer.step()` skips every parameter (torch optimizers skip
  parameters without a gradient, Adam's step count included) and `zero_grad()` has nothing to
  clear. The next backward puts them back first, so it accumulates onto them; the final
  micro-step's backward then all-reduces the whole window's sum.
- `backward` divides the loss by N. When a window ends early after k < N micro-steps (end of
  data), the synced gradients are multiplied by N / k, so every window averages its own
  micro-steps: N micro-steps, or a last partial window, equal one step on their concatenated
  batch (for equal micro-batch sizes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from retarget.core.tp_split_dims import ROW_ORDER
from retarget.execution.apply_plan import Applied


@dataclass
class Window:
    """Where the current micro-step sits in its accumulation window."""

    steps: int
    """N: micro-steps per window."""
    index: int
    """This micro-step's 1-based position in the window."""
    sync: bool
    """Whether it ends the window (gradients synchronise, the optimizer steps)."""

    @property
    def rescale(self) -> float:
        """Factor for the synced gradients of a window cut short (1 for a full one)."""
        return self.steps / self.index if self.sync and self.index < self.steps else 1.0


@dataclass
class HeldGradients:
    """Gradients of non-final micro-steps, kept where the optimizer does not see them."""

    grads: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)

    def hold(self, params: Iterable[nn.Parameter]) -> None:
        for param in params:
            if param.grad is not None:
                self.grads[param] = param.grad
                param.grad = None

    def restore(self) -> None:
        for param, grad in self.grads.items():
            param.grad = grad if param.grad is None else param.grad + grad
        self.grads.clear()

    def __len__(self) -> int:
        return len(self.grads)


def window_for(steps: int, done: int, end_of_data: bool) -> Window:
    """The window position of the next micro-step after `done` in the current window."""
    if steps < 1:
        raise ValueError(f"accumulate: steps must be at least 1, got {steps}")
    index = done + 1
    return Window(steps=steps, index=index, sync=index >= steps or end_of_data)


@contextlib.contextmanager
def gradient_sync(applied: Applied | None, sync: bool) -> Iterator[None]:
    """Forward and backward inside run with (sync) or without (no-sync) gradient communication."""
    if sync or applied is None or not applied.syncs_data_parallel:
        yield  # tp alone, or pp (its schedule syncs): no data-parallel sync to hold back
    elif applied.ddp is not None:
        with applied.ddp.no_sync():
            yield
    else:
        root = applied.fsdp_root
        root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)


def scale_gradients(params: Iterable[nn.Parameter], factor: float) -> None:
    """Multiply every gradient in place (a window cut short averages its own micro-steps)."""
    if factor == 1.0:
        return
    with torch.no_grad():
        for param in params:
            if param.grad is not None:
                param.grad.mul_(factor)


def clip_grad_norm(
    params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip to a global norm and return it as a plain tensor.

    DTensor gradients (FSDP2 shards, tp splits) make torch's norm reduce across their mesh, so
    the norm is the whole model's, as in one process; DDP gradients and the ones tp keeps whole
    are identical on every rank, so their local norm is already the global one. torch's
    clip_grad_norm_ takes one mesh at a time, so gradients are grouped by mesh (fsdp+tp mixes
    the dp mesh and the (dp, tp) mesh; tp alone mixes plain tensors and tp DTensors), each
    group's norm made whole, and the groups' norms combined. A tp parameter whose fused parts
    every rank holds whole (Falcon's k and v) is read whole in the model's order, so those
    rows count once.
    """
    duplicated, rest = [], []  # tp parameters whose fused parts every rank holds whole
    for param in params:
        order = getattr(param, ROW_ORDER, None)
        whole = param.grad is not None and order is not None and order.whole
        (duplicated if whole else rest).append(param)
    groups = _by_mesh(rest)
    if len(groups) <= 1 and not duplicated:
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        return total.full_tensor() if hasattr(total, "full_tensor") else total
    norms = _group_norms(groups, norm_type)
    for param in duplicated:
        grad = getattr(param, ROW_ORDER).to_model(param.grad.full_tensor())
        norms.append(torch.nn.utils.get_total_norm([grad], norm_type))
    total = torch.nn.utils.get_total_norm(norms, norm_type)
    for group in [*groups.values(), duplicated]:
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _by_mesh(params: Iterable[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """The parameters with a gradient, grouped by their gradient's mesh (None: plain tensors):
    torch's norm and clip take one mesh at a time."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            groups.setdefault(_mesh_key(param.grad), []).append(param)
    return groups


def _group_norms(groups: dict[Any, list[torch.Tensor]], norm_type: float) -> list[torch.Tensor]:
    """Each group's gradient norm, made whole over its mesh (a plain tensor)."""
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return norms


def clip_grad_norm_over_stages(
    params: list[torch.Tensor],
    max_norm: float,
    norm_type: float,
    group: Any,
    counted: list[torch.Tensor],
) -> torch.Tensor:
    """Clip to the whole model's norm under pp, where each rank holds its stage's gradients
    only: the norms of `counted` (the parameters whose norm this rank counts: a weight tied
    across stages is counted on one of them) are combined over the pipeline's process group (a
    sum of p-th powers, or the max for the inf-norm), so every stage clips by the same factor,
    the one a single process would use. Under fsdp+pp and tp+pp a stage's gradients are
    DTensor shards: their norm is combined over the stage's dp and tp ranks first."""
    import math

    import torch.distributed as dist

    # One norm per mesh (plain tensors, tp's, fsdp's), each made whole over its mesh.
    norms = [norm.float() for norm in _group_norms(_by_mesh(counted), norm_type)]
    local = torch.nn.utils.get_total_norm(norms, norm_type) if norms else torch.zeros(())
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = local
    else:
        powered = local**norm_type
        dist.all_reduce(powered, group=group)
        total = powered ** (1.0 / norm_type)
    for same_mesh in _by_mesh(params).values():
        torch.nn.utils.clip_grads_with_norm_(same_mesh, max_norm, total)
    return total


def _mesh_key(grad: torch.Tensor) -> Any:
    mesh = getattr(grad, "device_mesh", None)
    return None if mesh is None else (tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names)


def clip_grad_value(params: list[torch.Tensor], clip_value: float) -> None:
    """Clamp every gradient element to [-clip_value, clip_value] (elementwise: shards are fine)."""
    torch.nn.utils.clip_grad_value_(params, clip_value)
