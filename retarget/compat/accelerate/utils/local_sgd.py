"""LocalSGD: train without gradient communication, average the parameters every K steps.

    with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)       # gradients stay on this process
            optimizer.step(); optimizer.zero_grad()
            local_sgd.step()                 # every 8th call: parameters averaged over processes

On leaving the block the parameters are averaged once more, so every process ends with the
same model. Parameters are averaged in place (an all-reduce per parameter), so the optimizer
keeps pointing at them. In a world of one it does nothing, as in Accelerate.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class LocalSGD:
    """Accelerate's LocalSGD on a retarget.Accelerator: `no_sync` inside, periodic averaging."""

    def __init__(
        self, accelerator: Any, model: nn.Module, local_sgd_steps: int, enabled: bool = True
    ) -> None:
        if local_sgd_steps < 1:
            raise ValueError(f"LocalSGD: local_sgd_steps={local_sgd_steps} must be >= 1")
        if "fsdp" in getattr(accelerator.target, "names", ()):
            raise NotImplementedError(
                "LocalSGD averages whole parameters: it runs on ddp targets and single "
                f"processes, not on '{accelerator.target}' (FSDP shards the parameters)"
            )
        self.enabled = enabled and accelerator.num_processes > 1
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self._no_sync = contextlib.ExitStack()

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync.enter_context(self.accelerator.no_sync(self.model))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            if exc[0] is None:  # an error may have left the processes out of step
                self._sync_and_avg_model_params()
            self._no_sync.close()

    def step(self) -> None:
        """Count an optimizer step; every `local_sgd_steps`-th averages the parameters."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_avg_model_params()

    @torch.no_grad()
    def _sync_and_avg_model_params(self) -> None:
        self.accelerator.wait_for_everyone()
        world = self.accelerator.num_processes
        for param in self.model.parameters():
            dist.all_reduce(param)  # in place: the optimizer keeps pointing at it
            param.div_(world)
