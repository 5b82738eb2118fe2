"""`retarget.Accelerator`: Hugging Face Accelerate's front door, on retarget's passes.

An Accelerate script runs with one changed line, `from retarget import Accelerator`:

    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    model, optimizer, train_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, scheduler
    )
    for batch in train_loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    print(model.report)              # the prepared model is a CompiledModule

The class is thin. The target comes from `accelerator_target.resolve_target` (target=, plugins,
`retarget launch`, world size, mixed_precision, kwargs handlers); `prepare` hands models to
`compile_for` (with a batch of a loader prepared in the same call as example inputs, when the
batch says how the model is called; else capture waits for the first call) and everything else
to the compiled model's runtime and the runtime modules (data, collectives, checkpoint,
save_model). Unlike Accelerate, an argument is honoured or refused with the reason: nothing is
dropped silently.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from retarget.accelerate.arguments import (
    DistributedType,
    accumulation_steps,
    distributed_type,
    kind_of,
    project_configuration,
    refuse_unsupported,
    shard_options,
    with_dynamo,
)
from retarget.accelerate.example_inputs import example_inputs_for
from retarget.accelerate.kwargs_handlers import collect_handlers
from retarget.accelerate.precision_kwargs import AutocastKwargs
from retarget.accelerate.process_kwargs import InitProcessGroupKwargs, ProfileKwargs
from retarget.accelerate.scheduler import PreparedScheduler
from retarget.accelerate.state_methods import StateMethods
from retarget.accelerate.target_choice import resolve_target
from retarget.accelerate.tracker_set import TrackerSet
from retarget.driver.compile import compile_for
from retarget.driver.compiled import CompiledModule
from retarget.runtime import collectives
from retarget.runtime.data import sharded_loader as data
from retarget.runtime.process import ProcessState, end_process_group, end_process_group_at_exit
from retarget.runtime.state import checkpoint
from retarget.target.precisions import LOW_DTYPES

__all__ = ["Accelerator", "DistributedType"]


class Accelerator(StateMethods):
    """Accelerate's `Accelerator`, realised by retarget's passes and runtime.

    Arguments as in Accelerate (see the README's "Coming from Accelerate"), plus `target=`:
    a target spec or Target that fixes distribution and precision outright. `split_batches`,
    `even_batches` and `dispatch_batches` (or a `dataloader_config` with them) say how
    prepared DataLoaders are sharded.
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = False,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: Any = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        log_with: Any = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: Any = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: Sequence[Any] | None = None,
        dynamo_backend: str | None = None,
        *,
        target: Any = None,
        even_batches: bool = True,
        dispatch_batches: bool = False,
        **unsupported: Any,
    ) -> None:
        refuse_unsupported(device_placement=device_placement, **unsupported)
        handlers = collect_handlers(kwargs_handlers)
        self.state = _process_state(handlers.get(InitProcessGroupKwargs), cpu)
        resolution = resolve_target(
            target=target,
            mixed_precision=mixed_precision,
            fsdp_plugin=fsdp_plugin,
            deepspeed_plugin=deepspeed_plugin,
            handlers=handlers,
            world_size=self.state.world_size,
        )
        self.target = with_dynamo(resolution.target, dynamo_backend)
        self.target_origin = resolution.origin
        self.gradient_accumulation_steps = accumulation_steps(
            gradient_accumulation_steps, resolution.gradient_accumulation_steps
        )
        self.shard_options = shard_options(
            dataloader_config, split_batches, even_batches, dispatch_batches
        )
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.autocast_handler = handlers.get(AutocastKwargs, AutocastKwargs())
        if not self.autocast_handler.enabled and self.mixed_precision != "no":
            self.autocast_handler.refuse(
                "enabled",
                f"it would turn off the {self.mixed_precision} autocast mixed_precision= asks "
                "for; pass it to accelerator.autocast(...) around code that must run in float32",
            )
        self.profile_handler = handlers.get(ProfileKwargs)
        self.project_configuration = project_configuration(project_dir, project_config)
        self._trackers = TrackerSet(
            log_with, self.project_configuration.logging_dir, self.state.is_main_process
        )
        self._registry = checkpoint.CheckpointRegistry()
        self._models: list[CompiledModule] = []
        self._optimizers: list[Any] = []
        self._schedulers: list[PreparedScheduler] = []
        self._dataloaders: list[Any] = []
        self._prepared_optimizers: dict[int, Any] = {}  # id(given) -> prepared
        self._accumulating = False
        self.step = 0

    # ------------------------------------------------------------------------ who and where

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def num_processes(self) -> int:
        return self.state.world_size

    @property
    def process_index(self) -> int:
        return self.state.rank

    @property
    def local_process_index(self) -> int:
        return self.state.local_rank

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.state.distributed

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's name for the target's distribution (NO in a world of one)."""
        return distributed_type(self.target, self.state.world_size, self.device)

    @property
    def mixed_precision(self) -> str:
        """ "fp8", "bf16", "fp16" or "no", as the target says."""
        names = self.target.names
        return next((p for p in ("fp8", "bf16", "fp16") if p in names), "no")

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def split_batches(self) -> bool:
        return self.shard_options["split_batches"]

    @property
    def even_batches(self) -> bool:
        return self.shard_options["even_batches"]

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the local main process only."""
        self.state.print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        self.state.wait_for_everyone()

    def on_main_process(self, function: Callable) -> Callable:
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable) -> Callable:
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable) -> Callable:
        return self.state.on_process(self.state.world_size - 1)(function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None):
        """`@on_process(process_index=1)` or `on_process(fn, process_index=1)`."""
        if process_index is None:
            raise TypeError("on_process needs process_index=")
        decorate = self.state.on_process(process_index)
        return decorate if function is None else decorate(function)

    def on_local_process(
        self, function: Callable | None = None, local_process_index: int | None = None
    ):
        """`@on_local_process(local_process_index=1)` or with the function first."""
        if local_process_index is None:
            raise TypeError("on_local_process needs local_process_index=")
        decorate = self.state.on_local_process(local_process_index)
        return decorate if function is None else decorate(function)

    def main_process_first(self) -> contextlib.AbstractContextManager:
        return self.state.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager:
        return self.state.local_main_process_first()

    def split_between_processes(self, inputs: Any, apply_padding: bool = False):
        return self.state.split_between_processes(inputs, apply_padding=apply_padding)

    # ------------------------------------------------------------------------ prepare

    def prepare(self, *objects: Any, device_placement: Any = None) -> Any:
        """Models, optimizers, DataLoaders and LR schedulers, in any order, ready to train.

        A model becomes `compile_for(model, self.target, example_inputs=...)`; a DataLoader is
        sharded; an optimizer is re-pointed at its compiled model's parameters; a scheduler
        steps with its optimizer (see accelerator_scheduler). Returns them in the order given
        (one object alone, not a tuple).
        """
        if device_placement is not None:
            refuse_unsupported(device_placement=all(device_placement))
        kinds = [kind_of(obj, i) for i, obj in enumerate(objects)]
        loaders = [obj for i, obj in enumerate(objects) if kinds[i] == "dataloader"]
        prepare_one = {
            "model": lambda model: self._prepare_model(model, loaders),
            "dataloader": self._prepare_dataloader,
            "optimizer": self._prepare_optimizer,
            "scheduler": self._prepare_scheduler,
        }
        result: list[Any] = list(objects)
        # Models first (optimizers follow their compiled model), schedulers last (they follow
        # their prepared optimizer).
        for stage in (("model",), ("dataloader", "optimizer"), ("scheduler",)):
            for i, kind in enumerate(kinds):
                if kind in stage:
                    result[i] = prepare_one[kind](objects[i])
        return result[0] if len(result) == 1 else tuple(result)

    def _prepare_model(self, model: nn.Module, loaders: list[DataLoader]) -> CompiledModule:
        if isinstance(model, CompiledModule):
            if model.program.target != self.target:
                raise ValueError(
                    f"prepare: this model was compiled for '{model.program.target}' but the "
                    f"Accelerator trains for '{self.target}': pass the plain model (or "
                    "Accelerator(target=...) with its target)"
                )
            if all(model is not prepared for prepared in self._models):
                self._models.append(model)
            return model
        example = None
        if loaders:
            per_rank = self.state.world_size if self.split_batches else 1
            example = example_inputs_for(model, loaders[0], per_rank, self.device)
        compiled = compile_for(model, self.target, example_inputs=example)
        compiled.runtime.gradient_accumulation_steps = self.gradient_accumulation_steps
        self._models.append(compiled)
        return compiled

    def _prepare_dataloader(self, loader: DataLoader) -> Any:
        sharded = data.shard_dataloader(loader, self.state, **self.shard_options)
        self._dataloaders.append(sharded)
        return sharded

    def _prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        model = self._owner(optimizer)
        prepared = model.runtime.prepare_optimizer(optimizer)
        self._optimizers.append(prepared)
        self._prepared_optimizers[id(optimizer)] = prepared
        return prepared

    def _owner(self, optimizer: torch.optim.Optimizer) -> CompiledModule:
        """The prepared model whose parameters (or its original's) `optimizer` updates."""
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for model in self._models:
            owned = {id(p) for p in model.parameters()}
            owned |= {id(p) for p in model.program.original.parameters()}
            if params & owned:
                return model
        raise ValueError(
            "prepare: the optimizer updates parameters of no prepared model: prepare its model "
            "first, or in the same call"
        )

    def _prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        # Follow the optimizer it was prepared into when that one has its own param groups
        # (zero1's ZeroRedundancyOptimizer), as the runtime's prepare does; fp16's wrapper
        # shares them, and stays unbound so torch's step-order check keeps working.
        given = getattr(scheduler, "optimizer", None)
        bound = self._prepared_optimizers.get(id(given))
        if bound is not None and bound.param_groups is not given.param_groups:
            scheduler.optimizer = bound
        steps = 1 if self.split_batches else self.state.world_size
        prepared = PreparedScheduler(
            scheduler,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            steps_per_update=steps,
            sync_gradients=lambda: self.sync_gradients,
            step_was_skipped=lambda: self.optimizer_step_was_skipped,
        )
        self._schedulers.append(prepared)
        return prepared

    # ------------------------------------------------------------------------ training step

    def _runtimes(self) -> list[Any]:
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
        """Whether the current micro-step synchronises gradients (the optimizer steps)."""
        return all(runtime.sync_gradients for runtime in self._runtimes())

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped by the fp16 loss scaler (inf/nan)."""
        return any(runtime.step_was_skipped for runtime in self._runtimes())

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
        return collectives.gather(self.state, tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        return collectives.gather_for_metrics(
            self.state, input_data, use_gather_object=use_gather_object
        )

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        reduced = collectives.reduce(self.state, tensor, reduction)
        return reduced if scale == 1.0 else _scaled(reduced, scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        return collectives.pad_across_processes(self.state, tensor, dim, pad_index, pad_first)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """A loader whose next iteration starts after `num_batches` batches of its epoch.

        A loader this Accelerator prepared is itself set to skip and returned, so its epoch
        count goes on from the skipped epoch (a resumed run then shuffles the next epoch as
        the uninterrupted run did); others get `runtime.data.skip_first_batches`.
        """
        if num_batches < 0:
            raise ValueError(f"skip_first_batches: num_batches={num_batches} must be >= 0")
        if any(dataloader is prepared for prepared in self._dataloaders):
            dataloader.load_state_dict({**dataloader.state_dict(), "position": num_batches})
            return dataloader
        return data.skip_first_batches(dataloader, num_batches)

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget every prepared object and collect garbage; returns one None per object."""
        self._models, self._optimizers, self._schedulers, self._dataloaders = [], [], [], []
        self._prepared_optimizers = {}
        self.step = 0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None] * len(objects)

    clear = free_memory

    # ------------------------------------------------------------------------ trackers

    def init_trackers(
        self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None
    ) -> None:
        self._trackers.init(project_name, config, init_kwargs)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        self._trackers.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        return self._trackers.get(name, unwrap)

    @property
    def trackers(self) -> list[Any]:
        return list(self._trackers.trackers)

    def end_training(self) -> None:
        """Close the trackers, then end the process group (as Accelerate does)."""
        self._trackers.finish()
        self.wait_for_everyone()
        end_process_group()

    def __repr__(self) -> str:
        return (
            f"Accelerator(target='{self.target}' ({self.target_origin}), process "
            f"{self.process_index} of {self.num_processes}, device {self.device})"
        )


def _process_state(group: InitProcessGroupKwargs | None, cpu: bool) -> ProcessState:
    """This process's state, the process group created with the handler's settings."""
    group = group or InitProcessGroupKwargs()
    group.check()
    with group.environment():
        state = ProcessState.current(backend=group.backend, cpu=cpu)
    if group.backend is not None and state.distributed and state.backend != group.backend:
        group.refuse(
            "backend",
            f"the process group already exists with {state.backend}; create the "
            "Accelerator before anything else starts it",
        )
    if state.distributed:  # also a group the script created itself
        end_process_group_at_exit()
    return state


def _tensor_list(parameters: Any) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _scaled(data: Any, scale: float) -> Any:
    from retarget.runtime.nested import map_tensors

    return map_tensors(lambda t: t * scale, data)
