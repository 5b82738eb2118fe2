"""Dynamic loss scaling for fp16: torch.amp.GradScaler with the target's options and counters.

fp16 gradients underflow; scaling the loss by a large factor keeps them representable. The
scale backs off when a step finds inf/nan gradients (that step is skipped) and grows after
`growth_interval` good steps. `compile_for(model, "fp16[init_scale=1024]")` records the options
in `compiled.program.plan.loss_scaler`; the runtime's backward builds the scaler from it:

    >>> scaler = make_loss_scaler(compiled.program.plan, "cpu")
    >>> scaler.scale(loss).backward()
    >>> stepped = scaler.step(optimizer)   # False: inf/nan in gradients, parameters unchanged
    >>> scaler.update()
    >>> scaler.skipped_steps, scaler.last_skip_reason
"""

from __future__ import annotations

from typing import Any

import torch

from retarget.core.plans import Plan

#: Why a step is skipped, as the counters report it.
INF_OR_NAN = "inf/nan in gradients"


class LossScaler:
    """torch.amp.GradScaler plus the counters the report needs (skipped steps and why)."""

    def __init__(
        self,
        device: str | torch.device = "cuda",
        *,
        init_scale: float = 65536.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        self.device = torch.device(device).type
        #: torch's GradScaler underneath; runtime.optimizers.unscale_agreed drives it directly
        #: when gradients are sharded (its found-inf flag must agree across ranks).
        self.grad_scaler = torch.amp.GradScaler(
            self.device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )
        self.steps = 0
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.last_skip_reason: str | None = None

    @property
    def scale_value(self) -> float:
        """The current loss scale."""
        return self.grad_scaler.get_scale()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the current scale; call backward on this."""
        return self.grad_scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale in place (before clipping them)."""
        self.grad_scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> bool:
        """Unscale and step `optimizer`; False when inf/nan gradients made it skip the step."""
        self.grad_scaler.step(optimizer, *args, **kwargs)
        # GradScaler keeps what it found during unscale_ per optimizer and device.
        found = self.grad_scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        skipped = bool(sum(v.item() for v in found.values()))
        self.steps += 1
        self.skipped_steps += skipped
        self.last_step_skipped = skipped
        self.last_skip_reason = INF_OR_NAN if skipped else None
        return not skipped

    def update(self) -> None:
        """Back the scale off after a skipped step, grow it after growth_interval good ones."""
        self.grad_scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return {
            "grad_scaler": self.grad_scaler.state_dict(),
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.grad_scaler.load_state_dict(state["grad_scaler"])
        self.steps = state["steps"]
        self.skipped_steps = state["skipped_steps"]

    def __repr__(self) -> str:
        return (
            f"LossScaler(device={self.device!r}, scale={self.scale_value}, steps={self.steps}, "
            f"skipped_steps={self.skipped_steps})"
        )


def make_loss_scaler(plan: Plan, device: str | torch.device) -> LossScaler | None:
    """The scaler a compiled program's plan asks for (fp16), or None (bf16, fp32)."""
    options = plan.loss_scaler
    return None if options is None else LossScaler(device, **options.options())
