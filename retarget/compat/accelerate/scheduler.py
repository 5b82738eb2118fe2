"""A learning-rate scheduler prepared by the Accelerator: it steps when the optimizer steps.

Accelerate scripts call `lr_scheduler.step()` on every micro-batch, inside `accumulate()`, and
build the schedule for the whole dataset's number of batches. Accelerate's prepared scheduler
makes that right, and so does this one, with the same rules:

- on a micro-step that does not synchronise gradients (the optimizer does not step), nothing;
- after an optimizer step the loss scaler skipped (fp16 inf/nan), nothing;
- otherwise the wrapped scheduler steps once per process (`num_processes` times), because each
  optimizer step consumed one batch per process of the schedule's batches; with
  `split_batches` (one loader batch per step, split across processes) once. A OneCycleLR stops
  at its `total_steps` instead of raising.

`step_scheduler_with_optimizer=False` turns all of this off: every call steps the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class PreparedScheduler:
    """Wraps an LR scheduler; `state_dict`, `get_last_lr` and other attributes read through."""

    def __init__(
        self,
        scheduler: Any,
        *,
        step_with_optimizer: bool,
        steps_per_update: int,
        sync_gradients: Callable[[], bool],
        step_was_skipped: Callable[[], bool],
    ) -> None:
        self.scheduler = scheduler
        self.step_with_optimizer = step_with_optimizer
        self.steps_per_update = steps_per_update
        self._sync_gradients = sync_gradients
        self._step_was_skipped = step_was_skipped

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self._sync_gradients() or self._step_was_skipped():
            return
        total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises past it
        for _ in range(self.steps_per_update):
            if total is not None and self.scheduler.last_epoch + 1 > total:
                break
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"PreparedScheduler({self.scheduler!r}, steps_per_update={self.steps_per_update})"
