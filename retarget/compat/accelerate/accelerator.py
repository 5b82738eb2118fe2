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

The class is thin. The target comes from `target_choice.resolve_target` (target=, plugins,
`retarget launch`, world size, mixed_precision, kwargs handlers); `prepare` hands models to
`compile_for` (with a batch of a loader prepared in the same call as example inputs, when the
batch says how the model is called; else capture waits for the first call) and everything else
to the compiled model's runtime and the runtime modules (data, collectives, checkpoint,
save_model). Unlike Accelerate, an argument is honoured or refused with the reason: nothing is
dropped silently.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from retarget.compat.accelerate.accelerate_state import share_state_with_accelerate
from retarget.compat.accelerate.arguments import (
    DistributedType,
    accumulation_steps,
    distributed_type,
    project_configuration,
    refuse_unsupported,
    shard_options,
)
from retarget.compat.accelerate.dynamo import dynamo_target
from retarget.compat.accelerate.example_inputs import example_inputs_for
from retarget.compat.accelerate.kwargs_handlers import collect_handlers
from retarget.compat.accelerate.parity_members import ParityMembers
from retarget.compat.accelerate.parity_methods import ParityMethods
from retarget.compat.accelerate.parity_state import AcceleratorState
from retarget.compat.accelerate.precision_kwargs import AutocastKwargs
from retarget.compat.accelerate.process_kwargs import InitProcessGroupKwargs, ProfileKwargs
from retarget.compat.accelerate.scheduler import PreparedScheduler
from retarget.compat.accelerate.state_methods import StateMethods
from retarget.compat.accelerate.step_methods import StepMethods
from retarget.compat.accelerate.target_choice import resolve_target
from retarget.compat.accelerate.tracker_set import TrackerSet
from retarget.driver.compile import compile_for
from retarget.driver.compiled import CompiledModule
from retarget.execution.apply_plan import applied_of
from retarget.execution.process import (
    ProcessState,
    ProcessStateFacade,
    end_process_group,
    end_process_group_at_exit,
)
from retarget.execution.rank0_loading import asks_rank0_loading, transformers_environment
from retarget.execution.xla_placement import xla_device_for
from retarget.runtime.data import sharded_loader as data
from retarget.runtime.data.pipeline_batches import fit_to_pipeline
from retarget.runtime.data.xla_feed import feed_for
from retarget.runtime.runtime import prepare_in_order
from retarget.runtime.state import checkpoint

__all__ = ["Accelerator", "DistributedType"]


class Accelerator(ProcessStateFacade, StepMethods, StateMethods, ParityMembers, ParityMethods):
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
        dynamo_plugin: Any = None,
        *,
        target: Any = None,
        even_batches: bool = True,
        dispatch_batches: bool = False,
        torch_tp_plugin: Any = None,
        parallelism_config: Any = None,
        **unsupported: Any,
    ) -> None:
        self._torch_tp_plugin, self._parallelism_config = torch_tp_plugin, parallelism_config
        refuse_unsupported(device_placement=device_placement, **unsupported)
        handlers = collect_handlers(kwargs_handlers)
        process = _process_state(handlers.get(InitProcessGroupKwargs), cpu)
        self.state = process
        resolution = resolve_target(
            target=target,
            mixed_precision=mixed_precision,
            fsdp_plugin=fsdp_plugin,
            deepspeed_plugin=deepspeed_plugin,
            handlers=handlers,
            world_size=self.state.world_size,
            parallelism_config=parallelism_config,
            torch_tp_plugin=torch_tp_plugin,
        )
        self.target = dynamo_target(
            resolution.target, dynamo_backend, dynamo_plugin, origin=resolution.origin
        )
        self.target_origin = resolution.origin
        if asks_rank0_loading(self.target):  # from_pretrained then loads on local rank 0 only
            transformers_environment()
        if "xla" in self.target:  # models and batches live there, as Accelerate's device says
            process = dataclasses.replace(process, device=xla_device_for(self.target))
        self.state = AcceleratorState.of(
            process,
            distributed_type=distributed_type(self.target, process.world_size, process.device),
            mixed_precision=self.mixed_precision,
            is_fsdp2=self.is_fsdp2,
            deepspeed_plugin=deepspeed_plugin,
            compiles="compile" in self.target,
        )
        self.kwargs_handlers = handlers
        self.dataloader_config = dataloader_config
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
        self._accumulating = False
        self.step = 0
        share_state_with_accelerate(process)  # accelerate.logging and co., when imported

    # -------------------------------- who and where: rank, device, ... (ProcessStateFacade)

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's name for the target's distribution (NO in a world of one)."""
        return self.state.distributed_type

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

    # ------------------------------------------------------------------------ prepare

    def prepare(self, *objects: Any, device_placement: Any = None) -> Any:
        """Models, optimizers, DataLoaders and LR schedulers, in any order, ready to train.

        A model becomes `compile_for(model, self.target, example_inputs=...)`; a DataLoader is
        sharded; an optimizer is re-pointed at its compiled model's parameters; a scheduler
        steps with its optimizer (see scheduler.py). Returns them in the order given
        (one object alone, not a tuple). The order of preparation and which optimizer a
        scheduler follows are the runtime's (`prepare_in_order`, `Runtime.bind_scheduler`).
        """
        if device_placement is not None:
            refuse_unsupported(device_placement=all(device_placement))
        loaders = [obj for obj in objects if isinstance(obj, DataLoader)]
        return prepare_in_order(
            objects,
            {
                "model": lambda model: self._prepare_model(model, loaders),
                "dataloader": self._prepare_dataloader,
                "optimizer": self._prepare_optimizer,
                "scheduler": self._prepare_scheduler,
            },
        )

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
            # capture runs the model where it is; under xla that is still the CPU
            where = torch.device("cpu") if "xla" in self.target else self.device
            example = example_inputs_for(model, loaders[0], per_rank, where)
        # "auto": Accelerate captures nothing, so neither does a target whose passes read no
        # graph (fp32 ddp/fsdp): its first step does not wait for a torch.export per block.
        compiled = compile_for(model, self.target, example_inputs=example, capture="auto")
        compiled.runtime.gradient_accumulation_steps = self.gradient_accumulation_steps
        # Accelerate divides every micro-step's loss by N, also in a window the end of the data
        # cuts short: scripts migrated from it must see the same gradients.
        compiled.runtime.average_short_windows = False
        self._models.append(compiled)
        return compiled

    def _data_state(self) -> Any:
        """The process as data parallelism sees it (under tp: the dp ranks and group)."""
        views = [a.data_state() for a in map(applied_of, self._models) if a is not None]
        return views[0] if views else self.state

    def _prepare_dataloader(self, loader: DataLoader) -> Any:
        # Under tp the loader divides over the dp ranks of the prepared model's mesh.
        view = self._data_state()
        sharded = data.shard_dataloader(loader, view, agree=self.state, **self.shard_options)
        sharded.feed = feed_for(self.target)  # xla: uploaded by torch_xla's ParallelLoader
        pipelines = [m.program.plan.pp for m in self._models if m.program.plan.pp is not None]
        if pipelines:  # pp: batches of the stages' traced rows only
            fit_to_pipeline(sharded, pipelines[0])
        self._dataloaders.append(sharded)
        return sharded

    def _prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        model = self._owner(optimizer)
        prepared = model.runtime.prepare_optimizer(optimizer)
        self._optimizers.append(prepared)
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
        for model in self._models:
            model.runtime.bind_scheduler(scheduler)
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

    # ------------------------------------------------------------------------ loaders, memory

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
