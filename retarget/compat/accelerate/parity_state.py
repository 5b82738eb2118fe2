"""`accelerator.state` and `accelerator.gradient_state` with Accelerate's attribute names.

Accelerate scripts read `accelerator.state.num_processes`, `.distributed_type`,
`.mixed_precision`, and `accelerator.gradient_state.sync_gradients`, `.end_of_dataloader`,
`.remainder`. `AcceleratorState` is the process's `ProcessState` (everything the runtime reads
from a state still works) plus those names; `GradientStateView` reads the live accumulation
and loader state of one Accelerator.

    >>> accelerator.state.num_processes, accelerator.state.distributed_type
    (2, <DistributedType.MULTI_CPU: 'MULTI_CPU'>)
    >>> accelerator.gradient_state.end_of_dataloader     # inside the last batch of an epoch
    True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from retarget.compat.accelerate.arguments import DistributedType
from retarget.execution.process import ProcessState, end_process_group
from retarget.runtime.data.sharded_loader import active_loader, active_loaders


@dataclass(frozen=True)
class AcceleratorState(ProcessState):
    """A ProcessState that also answers to Accelerate's AcceleratorState names."""

    distributed_type: DistributedType = DistributedType.NO
    mixed_precision: str = "no"
    """ "fp8", "bf16", "fp16" or "no", from the target."""
    is_fsdp2: bool = False
    """Whether the target shards parameters (retarget's FSDP is FSDP2's fully_shard)."""
    deepspeed_plugin: Any = None
    """The DeepSpeedPlugin given to the Accelerator (realised as a ZeRO target), or None."""
    compiles: bool = False

    def __repr__(self) -> str:
        """Accelerate's text (`logger.info(accelerator.state)` in every transformers example)."""
        backend = f"  Backend: {self.backend}" if self.backend else ""
        device = self.device
        if self.distributed and device.type == "cpu" and device.index is None:
            device = "cpu:0"  # Accelerate indexes the one CPU device under MULTI_CPU
        text = (
            f"Distributed environment: {self.distributed_type}{backend}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Device: {device}\n"
            f"\nMixed precision type: {self.mixed_precision}\n"
        )
        if self.deepspeed_plugin is not None:
            text += f"ds_config: {getattr(self.deepspeed_plugin, 'deepspeed_config', None)}\n"
        return text

    @classmethod
    def of(cls, state: ProcessState, **accelerator_facts: Any) -> AcceleratorState:
        """`state` with the Accelerator's facts added."""
        fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(ProcessState)}
        return cls(**fields, **accelerator_facts)

    num_processes = property(lambda self: self.world_size, doc="Processes over all machines.")
    process_index = property(lambda self: self.rank, doc="This process's global rank.")
    local_process_index = property(lambda self: self.local_rank, doc="Rank on its machine.")
    use_distributed = property(lambda self: self.distributed, doc="More than one process.")
    initialized = property(lambda self: True, doc="Always: the Accelerator built it.")
    fork_launched = property(lambda self: False, doc="Processes are started by torchrun.")
    debug = property(
        lambda self: True,
        doc="Accelerate's debug mode checks collectives' shapes across processes: retarget's "
        "collectives always do (a mismatch raises the same error on every rank).",
    )
    device_mesh = property(lambda self: None, doc="None: meshes are made as models are prepared.")
    parallelism_config = property(
        lambda self: getattr(self, "_parallelism_config", None),
        doc="The ParallelismConfig given to the Accelerator (None: the target says it).",
    )
    torch_tp_plugin = property(
        lambda self: getattr(self, "_torch_tp_plugin", None),
        doc="The TorchTensorParallelPlugin given to the Accelerator, or None.",
    )

    @property
    def deepspeed_plugins(self) -> dict[str, Any] | None:
        """{"default": plugin} when a deepspeed_plugin was given, else None."""
        return None if self.deepspeed_plugin is None else {"default": self.deepspeed_plugin}

    def get_deepspeed_plugin(self, name: str) -> Any:
        plugins = self.deepspeed_plugins or {}
        if name not in plugins:
            raise ValueError(
                f"state.get_deepspeed_plugin({name!r}): the Accelerator has "
                f"{sorted(plugins) or 'no deepspeed_plugin'}; retarget takes one plugin"
            )
        return plugins[name]

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        """Only the one plugin given ("default") can be selected: it is already active."""
        if name not in (None, "default") or self.deepspeed_plugin is None:
            raise ValueError(
                f"state.select_deepspeed_plugin({name!r}) cannot be honoured: retarget realises "
                "one deepspeed_plugin as the target when the Accelerator is built"
            )

    @property
    def dynamo_plugin(self) -> None:
        """None without torch.compile; with it, the target's compile part says the settings."""
        if self.compiles:
            raise NotImplementedError(
                "state.dynamo_plugin: torch.compile's settings are the target's compile part "
                "here (accelerator.target.get('compile')), not a TorchDynamoPlugin"
            )
        return None

    def destroy_process_group(self, group: Any = None) -> None:
        """End the process group (the default one; others are the script's own)."""
        if group is not None:
            raise ValueError(
                "state.destroy_process_group(group=...): only the default group, which the "
                "Accelerator created, is ended here; destroy your own groups with torch"
            )
        end_process_group()


class GradientStateView:
    """Accelerate's GradientState attributes, read live from one Accelerator."""

    initialized = True
    is_xla_gradients_synced = False
    adjust_scheduler = False
    """Prepared schedulers skip the micro-steps that do not sync, as Accelerate's do by
    default (no step count kept for them)."""
    sync_with_dataloader = True
    """Accumulation windows always end at the end of a dataloader."""

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator

    def __repr__(self) -> str:
        return (
            f"Sync Gradients: {self.sync_gradients}\n"
            f"At end of current dataloader: {self.end_of_dataloader}\n"
            f"Extra samples added: {self.remainder}\n"
            f"Gradient accumulation plugin: {self.plugin_kwargs}\n"
        )

    @property
    def num_steps(self) -> int:
        return self._accelerator.gradient_accumulation_steps

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        """The accumulation settings that differ from the plugin's defaults (Accelerate's)."""
        return {"num_steps": self.num_steps}

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-step synchronises gradients (True before any model is prepared)."""
        return self._accelerator.sync_gradients if self._accelerator._models else True

    @property
    def active_dataloader(self) -> Any:
        return active_loader()

    @property
    def dataloader_references(self) -> list[Any]:
        return [None, *active_loaders()]

    @property
    def in_dataloader(self) -> bool:
        return active_loader() is not None

    @property
    def end_of_dataloader(self) -> bool:
        loader = active_loader()
        return loader is not None and loader.end_of_dataloader

    @property
    def remainder(self) -> int:
        """Real samples in the active loader's last round (-1 outside a loader). Unlike
        Accelerate's, it is counted in every case; `duplicates` says whether to trim."""
        loader = active_loader()
        return -1 if loader is None else loader.remainder
