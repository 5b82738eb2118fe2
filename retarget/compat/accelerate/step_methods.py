"""The Accelerator's training step and collectives: backward, accumulate, clipping, autocast,
profile, gather, reduce.

A mixin of `Accelerator` (it reads the models the Accelerator prepared): the step goes through
each compiled model's runtime (runtime/runtime.py), which owns loss scaling, accumulation
windows and gradient sync; the collectives go to `runtime.collectives` with the process state.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from retarget.compat.accelerate.precision_kwargs import AutocastKwargs
from retarget.compat.accelerate.process_kwargs import ProfileKwargs
from retarget.execution.nested import map_tensors
from retarget.runtime import collectives
from retarget.targets.precisions import LOW_DTYPES


class StepMethods:
    """backward, accumulate, no_sync, sync_gradients, optimizer_step_was_skipped,
    clip_grad_norm_, clip_grad_value_, autocast, profile, gather, gather_for_metrics, reduce,
    pad_across_processes."""

    def _runtimes(self) -> list[Any]:
        """The runtimes of the prepared models (the training step runs through them)."""
        if not self._models:
            raise RuntimeError("prepare a model first: the training step runs through it")
        return [model.runtime for model in self._models]

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward()` with the target's loss scaling and accumulation averaging.

        As in Accelerate, the loss is divided by gradient_accumulation_steps also outside
        `accumulate()` (scripts that step every N batches themselves rely on it); inside, the
        runtime divides by its window's steps.
        """
        runtime = self._runtimes()[0]
        if not self._accumulating and self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        runtime.backward(loss, **kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """One micro-step: gradients sync (and the optimizer steps) every
        `gradient_accumulation_steps` micro-steps and at the end of a dataloader."""
        runtimes = [m.runtime for m in models] if models else self._runtimes()
        with contextlib.ExitStack() as stack:
            for runtime in runtimes:
                stack.enter_context(runtime.accumulate(self.gradient_accumulation_steps))
            self._accumulating = True
            try:
                yield
            finally:
                self._accumulating = False
        self.step += 1

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Gradients of backward calls inside stay local (no all-reduce)."""
        with model.runtime.no_sync():
            yield

    @property
    def sync_gradients(self) -> bool:
        """Whether the current micro-step synchronises gradients (the optimizer steps); True
        before any model is prepared, as in Accelerate."""
        return not self._models or all(runtime.sync_gradients for runtime in self._runtimes())

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped by the fp16 loss scaler (inf/nan)."""
        return bool(self._models) and any(runtime.step_was_skipped for runtime in self._runtimes())

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0):
        """Clip the global gradient norm (across shards and processes; fp16: unscaled first);
        returns the norm, or None on a micro-step that does not synchronise gradients."""
        params = _tensor_list(parameters)
        return self._runtime_of(params).clip_grad_norm_(params, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp every gradient to [-clip_value, clip_value] (fp16: unscaled first)."""
        params = _tensor_list(parameters)
        self._runtime_of(params).clip_grad_value_(params, clip_value)

    def _runtime_of(self, params: list[torch.Tensor]) -> Any:
        """The runtime of the prepared model that owns `params` (the first model's otherwise)."""
        wanted = {id(p) for p in params}
        for model in self._models:
            if wanted & {id(p) for p in model.parameters()}:
                return model.runtime
        return self._runtimes()[0]

    @contextlib.contextmanager
    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Iterator[None]:
        """torch.autocast in the target's low dtype for code outside the model (a loss)."""
        handler = autocast_handler or self.autocast_handler
        dtype = LOW_DTYPES.get("bf16" if self.mixed_precision == "fp8" else self.mixed_precision)
        if dtype is None:
            yield
            return
        with torch.autocast(self.device.type, dtype=dtype, **handler.autocast_kwargs()):
            yield

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[Any]:
        """torch.profiler around the block; with output_trace_dir, profile_<rank>.json."""
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is not None:
            os.makedirs(handler.output_trace_dir, exist_ok=True)
            path = os.path.join(handler.output_trace_dir, f"profile_{self.process_index}.json")
            profiler.export_chrome_trace(path)
            self.wait_for_everyone()

    # ------------------------------------------------------------------------ collectives

    def gather(self, tensor: Any) -> Any:
        """Every process's `tensor` (or nest of them), concatenated along dim 0."""
        return collectives.gather(self.state, tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """`gather` without the samples even_batches duplicated: exactly the dataset's."""
        return collectives.gather_for_metrics(
            self._data_state(), input_data, use_gather_object=use_gather_object
        )

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """`tensor` summed (or averaged: reduction="mean") over processes, times `scale`."""
        reduced = collectives.reduce(self.state, tensor, reduction)
        return reduced if scale == 1.0 else _scaled(reduced, scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """`tensor` padded along `dim` to the largest size over processes, so it can gather."""
        return collectives.pad_across_processes(self.state, tensor, dim, pad_index, pad_first)


def _tensor_list(parameters: Any) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _scaled(data: Any, scale: float) -> Any:
    return map_tensors(lambda t: t * scale, data)
