"""Runtime: what a training loop needs from a compiled model, as `compiled.runtime`.

    model = retarget.compile_for(model, target="fsdp+bf16", example_inputs=batch)
    run = model.runtime
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # after compile_for: plain
    loader = run.shard(loader)
    for batch in loader:
        with run.accumulate():               # run.gradient_accumulation_steps micro-steps
            loss = model(**batch).loss
            run.backward(loss); optimizer.step(); optimizer.zero_grad()
    preds = run.gather_for_metrics(preds)

The same script runs on one process and on N (torchrun / `retarget launch`): compile_for applies
the DDP/FSDP plan when a process group exists, and every method here is the identity or a no-op
in a world of one.

- Who: `state` (ProcessState), `rank`, `world_size`, `local_rank`, `device`,
  `is_main_process`, ... and the main-process helpers (`print`, `wait_for_everyone`,
  `on_main_process`, `main_process_first`, `split_between_processes`, ...), from ProcessState.
- Data: `shard(loader, **options)` (runtime.data.shard_dataloader); `gather`,
  `gather_object`, `gather_for_metrics`, `reduce`, `pad_across_processes`, `broadcast`
  (runtime.collectives).
- Optimizers: `prepare(*objects)`: an optimizer is re-pointed at the compiled model's
  parameters (one built before compile_for holds the originals, which FSDP replaces), becomes
  a ZeroRedundancyOptimizer under zero1 and steps through the loss scaler under fp16; a
  DataLoader is sharded; an LR scheduler is re-bound to its prepared optimizer; the model
  passes through. Under zero1 and fp16 an optimizer must be prepared (its first step says so
  otherwise); under ddp/fsdp/bf16 a plain optimizer created after compile_for is enough.
- Step: `backward(loss)` (loss scaling for fp16, division by the accumulation steps),
  `accumulate()` and `sync_gradients`, `no_sync()`, `clip_grad_norm_`, `clip_grad_value_`.

Accumulation with a plain optimizer stepping every micro-step: on a micro-step that does not
end its window the model runs without gradient communication (DDP no_sync, FSDP2
set_requires_gradient_sync(False)) and, after `backward`, the gradients left in `p.grad` are
held by the runtime with `p.grad = None`, so `optimizer.step()` finds no gradient and changes
nothing (Adam's step count included) and `zero_grad()` clears nothing; the next `backward`
puts them back before it runs. FSDP2 keeps a non-final micro-step's gradients unsharded inside
its own state and leaves `p.grad` None, which is the same contract. The window's last
micro-step syncs the sum; `backward` divided each loss by N, and a window cut short by the end
of the data after k micro-steps has its gradients multiplied by N / k (see runtime/step.py).
Use `run.backward(loss)`, not `loss.backward()`, inside `accumulate()`: it is what puts the
held gradients back. Clipping on a non-final micro-step does nothing and returns None.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from retarget.execution.apply_plan import Applied, applied_of
from retarget.execution.process import ProcessState, ProcessStateFacade
from retarget.execution.step_guard import StepGuard, guard_of
from retarget.execution.xla_placement import xla_steps
from retarget.runtime.data.xla_feed import feed_for
from retarget.runtime.optimizers import (
    ScaledOptimizer,
    remap_parameters,
    warn_frozen_quantized,
    zero_redundancy,
)
from retarget.runtime.scaler import LossScaler, make_loss_scaler
from retarget.runtime.step import (
    HeldGradients,
    Window,
    clip_grad_norm,
    clip_grad_norm_over_stages,
    clip_grad_value,
    gradient_sync,
    scale_gradients,
    window_for,
)


class Runtime(ProcessStateFacade):
    """Training-loop helpers bound to one compiled model; get it as `compiled.runtime`."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.program = model.program
        self.applied: Applied | None = applied_of(model)
        self.state: ProcessState = (
            self.applied.state if self.applied is not None else ProcessState.current()
        )
        if self.program.plan.xla is not None:  # the model lives there: `device` says so
            self.state = dataclasses.replace(self.state, device=xla_steps(model).device)
        self.gradient_accumulation_steps = 1
        """Micro-steps per window for `accumulate()` without an argument."""
        self.accumulation_step = 0
        """Micro-steps done in the current window (saved and restored by checkpoints)."""
        self.sync_gradients = True
        """Whether the current micro-step ends its window (gradients sync, optimizer steps)."""
        self.average_short_windows = True
        """Whether a window cut short by the end of the data averages its own k micro-steps
        (gradients times N/k); False keeps Accelerate's rule: every loss divided by N."""
        self.step_was_skipped = False
        """fp16: whether the last optimizer step was skipped for inf/nan gradients."""
        self.scaler: LossScaler | None = make_loss_scaler(self.program.plan, self.state.device)
        self._window: Window | None = None
        self._held = HeldGradients()
        self._optimizers: list[Optimizer] = []
        self._prepared: list[tuple[Optimizer, Optimizer]] = []

    # -- who: rank, world_size, device, is_main_process, ... (ProcessStateFacade) -----------

    @property
    def guard(self) -> StepGuard | None:
        """The optimizer step guard compile_for installed, if the target needs one."""
        return guard_of(self.model)

    # -- data and collectives --------------------------------------------------------------

    @property
    def data_parallel_rank(self) -> int:
        """Which batch this rank reads: its rank among the data-parallel ranks (the ranks of
        a tp or cp group read the same batches and share this number)."""
        return self._data_view().rank

    @property
    def data_parallel_size(self) -> int:
        """How many different batches the ranks read per step (the world over tp and cp)."""
        return self._data_view().world_size

    def _data_view(self) -> Any:
        return self.applied.data_state() if self.applied is not None else self.state

    def shard(self, loader: DataLoader, **options: Any) -> Any:
        """This rank's share of `loader` (options of runtime.data.shard_dataloader); under
        `xla` its batches are uploaded by torch_xla's ParallelLoader (runtime.data.xla_feed);
        under pp checked against the stages' batch rows (runtime.data.pipeline_batches)."""
        from retarget.runtime.data import sharded_loader as data

        if self.applied is None:
            sharded = data.shard_dataloader(loader, self.state, **options)
        else:
            # Under tp the loader divides over the dp ranks; the seed is agreed by every process.
            view = self.applied.data_state()
            sharded = data.shard_dataloader(loader, view, agree=self.state, **options)
        sharded.feed = feed_for(self.program.target)
        if self.program.plan.pp is not None:
            from retarget.runtime.data.pipeline_batches import fit_to_pipeline

            fit_to_pipeline(sharded, self.program.plan.pp)
        return sharded

    def gather(self, data: Any) -> Any:
        from retarget.runtime import collectives

        return collectives.gather(self.state, data)

    def gather_object(self, obj: Any) -> list[Any]:
        from retarget.runtime import collectives

        return collectives.gather_object(self.state, obj)

    def gather_for_metrics(self, data: Any, *, use_gather_object: bool = False) -> Any:
        """`gather` without the samples even_batches duplicated: exactly the dataset's."""
        from retarget.runtime import collectives

        view = self._data_view()
        return collectives.gather_for_metrics(view, data, use_gather_object=use_gather_object)

    def reduce(self, data: Any, reduction: str = "sum") -> Any:
        from retarget.runtime import collectives

        return collectives.reduce(self.state, data, reduction)

    def pad_across_processes(
        self, data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        from retarget.runtime import collectives

        return collectives.pad_across_processes(self.state, data, dim, pad_index, pad_first)

    def broadcast(self, data: Any, from_process: int = 0) -> Any:
        from retarget.runtime import collectives

        return collectives.broadcast(self.state, data, from_process)

    # -- prepare ---------------------------------------------------------------------------

    def prepare(self, *objects: Any) -> Any:
        """Optimizers, DataLoaders, LR schedulers (and the model itself), ready for the target.

        Returns them in the order given (one object alone, not a tuple); see `prepare_in_order`
        for the order they are prepared in and `bind_scheduler` for schedulers.
        """
        return prepare_in_order(
            objects,
            {
                "model": self._own_model,
                "dataloader": self.shard,
                "optimizer": self.prepare_optimizer,
                "scheduler": self.bind_scheduler,
            },
        )

    def bind_scheduler(self, scheduler: Any) -> Any:
        """Point `scheduler` at the optimizer its optimizer was prepared into here, when that
        one has its own param groups (zero1's ZeroRedundancyOptimizer); returns the scheduler.

        fp16's ScaledOptimizer shares the param groups, so a scheduler stays on the plain
        optimizer, where torch's check that the optimizer stepped before the scheduler works.
        """
        given = getattr(scheduler, "optimizer", None)
        for original, prepared in self._prepared:
            if given is original and prepared.param_groups is not given.param_groups:
                scheduler.optimizer = prepared
        return scheduler

    def prepare_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Remap parameters; zero1: ZeroRedundancyOptimizer; fp16: ScaledOptimizer.

        Preparing an optimizer twice (or a prepared one) returns the same prepared object.
        """
        for given, prepared in self._prepared:
            if optimizer is given or optimizer is prepared:
                return prepared
        prepared = self._prepare_new(optimizer)
        self._prepared.append((optimizer, prepared))
        return prepared

    def _prepare_new(self, optimizer: Optimizer) -> Optimizer:
        remap_parameters(optimizer, self.model, self.program.original)
        warn_frozen_quantized(optimizer, self.model)
        prepared = optimizer
        guard = self.guard
        if self.applied is not None and self.program.plan.zero1 is not None:
            prepared = zero_redundancy(optimizer)
            if guard is not None:
                guard.allow_inner(prepared, prepared.optim)
        self._optimizers.append(prepared)
        if self.scaler is not None:
            # Only the wrapper may step it: a direct step would skip unscaling.
            return ScaledOptimizer(prepared, self)
        if guard is not None:
            guard.allow(prepared)
        return prepared

    def _own_model(self, module: nn.Module) -> nn.Module:
        if module is self.model or module is self.program.original:
            return self.model
        raise ValueError(
            f"prepare: {type(module).__name__} is not the model this runtime belongs to; "
            "compile it with retarget.compile_for and use its own runtime"
        )

    # -- the step --------------------------------------------------------------------------

    @contextlib.contextmanager
    def accumulate(self, steps: int | None = None) -> Iterator[None]:
        """One micro-step of a window of `steps` (default gradient_accumulation_steps).

        Inside, `sync_gradients` says whether this micro-step ends the window: its N-th, or the
        last batch of the active sharded loader. Non-final micro-steps run without gradient
        communication and keep their gradients away from the optimizer (module docstring).
        """
        from retarget.runtime.data.sharded_loader import active_loader

        loader = active_loader()
        end_of_data = loader is not None and loader.end_of_dataloader
        steps = steps or self.gradient_accumulation_steps
        window = window_for(steps, self.accumulation_step, end_of_data)
        self._window, self.sync_gradients = window, window.sync
        try:
            with gradient_sync(self.applied, window.sync):
                yield
        finally:
            self._window, self.sync_gradients = None, True
            self.accumulation_step = 0 if window.sync else window.index

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward and backward inside keep gradients local (no all-reduce / reduce-scatter)."""
        with gradient_sync(self.applied, sync=False):
            yield

    def forward_backward(self, batch: dict[str, Any]) -> torch.Tensor:
        """One training call for every target: forward and backward of `batch` (keyword
        arguments of the model, with labels), gradients left in the parameters; returns the
        batch's mean loss (detached), the same on every rank of a pipeline. Under pp it runs
        the whole schedule (every rank calls it with the same batch); otherwise it is
        `loss = model(**batch).loss; runtime.backward(loss)`."""
        applied = self.applied
        if applied is not None and applied.pipeline is not None:
            return self._pipelined_step(applied.pipeline, batch)
        loss = self.model(**batch).loss
        self.backward(loss)
        return loss.detach()

    def _pipelined_step(self, pipeline: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The schedule's step; inside accumulate() its gradients (the batch's mean) count
        1/N of the window. The schedule divides every gradient by its microbatch count, so the
        earlier micro-steps' gradients are held aside while it runs and added back after."""
        window = self._window
        loss = pipeline.forward_backward(batch)
        if window is None:
            return loss
        scale_gradients(self.model.parameters(), 1.0 / window.steps)
        self._held.restore()
        self._end_micro_step(window)
        return loss

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward()` with the target's loss scaling and the accumulation average."""
        window = self._window
        if window is not None:
            loss = loss / window.steps
        self._held.restore()
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
            self.guard.scaled_gradients = True
        loss.backward(**kwargs)
        if window is not None:
            self._end_micro_step(window)

    def _end_micro_step(self, window: Window) -> None:
        """After a micro-step's backward: hold its gradients away from the optimizer until the
        window ends; a window cut short averages its own micro-steps."""
        if not window.sync:
            self._held.hold(self.model.parameters())
        elif self.average_short_windows:
            scale_gradients(self.model.parameters(), window.rescale)

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor | None:
        """Clip gradients to a global norm (across shards and ranks); returns that norm.

        fp16: gradients are unscaled first (through the prepared optimizer that holds them).
        On a micro-step that does not end its window nothing is clipped and None is returned.
        """
        if not self.sync_gradients:
            return None
        params = _tensors(parameters)
        self._unscale_for(params)
        if self.applied is not None and self.applied.pipeline is not None:
            pipeline = self.applied.pipeline
            counted = pipeline.counted(params)
            return clip_grad_norm_over_stages(params, max_norm, norm_type, pipeline.group, counted)
        return clip_grad_norm(params, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp gradients to [-clip_value, clip_value] (fp16: unscaled first)."""
        if not self.sync_gradients:
            return
        params = _tensors(parameters)
        self._unscale_for(params)
        clip_grad_value(params, clip_value)

    def _unscale_for(self, params: list[torch.Tensor]) -> None:
        if self.scaler is None:
            return
        from retarget.runtime.optimizers import unscale_agreed

        wanted = {id(p) for p in params}
        for optimizer in self._optimizers:
            held = {id(p) for g in optimizer.param_groups for p in g["params"]}
            if held & wanted:
                unscale_agreed(self.scaler, optimizer, self.state)
                return
        raise ValueError(
            "clip under fp16: the gradients are still multiplied by the loss scale and no "
            "prepared optimizer holds these parameters; call run.prepare(optimizer) first"
        )

    def __repr__(self) -> str:
        applied = self.applied.wrapped if self.applied is not None else "none"
        return (
            f"Runtime(target={self.program.target}, rank={self.rank}/{self.world_size}, "
            f"applied={applied}, device={self.device})"
        )


def _tensors(parameters: Any) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)


#: The order `prepare` goes in: models first (an optimizer follows its compiled model),
#: schedulers last (a scheduler follows its prepared optimizer).
PREPARE_ORDER = (("model",), ("dataloader", "optimizer"), ("scheduler",))


def prepare_kind(obj: Any, index: int) -> str:
    """What `prepare` does with its `index`-th argument: model, optimizer, dataloader, scheduler."""
    if isinstance(obj, nn.Module):
        return "model"
    if isinstance(obj, Optimizer):
        return "optimizer"
    if isinstance(obj, DataLoader):
        return "dataloader"
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        callable(getattr(obj, "step", None)) and hasattr(obj, "optimizer")
    ):
        return "scheduler"
    raise TypeError(
        f"prepare: argument {index} is a {type(obj).__name__}; prepare takes models, "
        "optimizers, torch DataLoaders and LR schedulers"
    )


def prepare_in_order(objects: tuple[Any, ...], prepare_one: Mapping[str, Callable]) -> Any:
    """`objects` prepared by `prepare_one[kind]` in PREPARE_ORDER, returned in the order given
    (one object alone, not a tuple). The one `prepare` of Runtime and Accelerator."""
    kinds = [prepare_kind(obj, i) for i, obj in enumerate(objects)]
    result = list(objects)
    for stage in PREPARE_ORDER:
        for i, kind in enumerate(kinds):
            if kind in stage:
                result[i] = prepare_one[kind](objects[i])
    return result[0] if len(result) == 1 else tuple(result)
