"""The Accelerator's saving and loading: checkpoints, model weights, plain objects.

A mixin of `Accelerator` (it reads the objects the Accelerator prepared): save_state/load_state
hand every prepared model, optimizer, scheduler, the loss scaler, the loaders' positions and the
registered objects to `runtime.checkpoint`; save_model, unwrap_model and get_state_dict go to
`runtime.save_model`.

Loaders follow Accelerate's resume rule: a restored loader starts its saved epoch from the
beginning (the same shuffle), and the script skips the batches it already trained on with
`skip_first_batches`, as Accelerate's checkpointing example does.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from retarget.accelerate.accelerate_checkpoint import load_accelerate_checkpoint
from retarget.runtime.state import checkpoint
from retarget.runtime.state import save_model as model_files
from retarget.runtime.state.accelerate_folder import is_accelerate_checkpoint


class StateMethods:
    """save_state, load_state, register_for_checkpointing, save_model, save, unwrap_model,
    get_state_dict."""

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Objects with state_dict()/load_state_dict() saved and restored with save_state."""
        self._registry.register_for_checkpointing(*objects)

    def save_state(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        safe_serialization: bool = True,
        **kwargs: Any,
    ):
        """Checkpoint models, optimizers, schedulers, the loss scaler, loader positions, RNG
        states and registered objects; with automatic naming into the next numbered folder."""
        if not safe_serialization:
            raise ValueError(
                "save_state(safe_serialization=False) cannot be honoured: checkpoints are "
                "written without pickle (torch.distributed.checkpoint, safetensors and JSON)"
            )
        if kwargs:
            raise TypeError(f"save_state takes no {', '.join(sorted(kwargs))} here")
        project = self.project_configuration.checkpoints()
        return checkpoint.save_state(
            output_dir,
            **self._state_objects(),
            step=self.step,
            accumulation_step=self._accumulation_step(),
            project=project,
        )

    def load_state(self, input_dir: str | os.PathLike[str] | None = None, **kwargs: Any):
        """Restore what save_state saved, into the objects prepared (same ones, same order).

        A folder written by Hugging Face Accelerate's save_state is read too
        (accelerate_checkpoint.py): the run continues from Accelerate's step.
        """
        if kwargs:
            raise TypeError(f"load_state takes no {', '.join(sorted(kwargs))} here")
        if input_dir is not None and is_accelerate_checkpoint(input_dir):
            if not self._models:
                raise RuntimeError("load_state: prepare the model first")
            return load_accelerate_checkpoint(self, input_dir)
        project = self.project_configuration.checkpoints()
        resumed = checkpoint.load_state(input_dir, **self._state_objects(), project=project)
        self.step = resumed.step
        for runtime in self._runtimes():
            runtime.accumulation_step = resumed.accumulation_step
        return resumed

    def _state_objects(self) -> dict[str, Any]:
        if not self._models:
            raise RuntimeError("save_state/load_state: prepare the model first")
        scalers = [r.scaler for r in self._runtimes() if r.scaler is not None]
        return {
            "model": self._models,
            "optimizers": [getattr(o, "optimizer", o) for o in self._optimizers],
            "schedulers": self._schedulers,
            "scaler": scalers[0] if scalers else None,
            "dataloaders": [_EpochStart(loader) for loader in self._dataloaders],
            "custom_objects": self._registry,
        }

    def _accumulation_step(self) -> int:
        return self._runtimes()[0].accumulation_step

    def save_model(
        self,
        model: nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ):
        """Full weights with the original keys as safetensors shards plus an index json."""
        return model_files.save_model(
            model,
            save_directory,
            max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
        )

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """Write `obj` once, from the main process (safetensors for a dict of tensors)."""
        if self.is_main_process:
            if safe_serialization:
                from safetensors.torch import save_file

                save_file(obj, f, metadata={"format": "pt"})
            else:
                torch.save(obj, f)
        self.wait_for_everyone()

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True) -> nn.Module:
        """The model object you passed to prepare, carrying the current weights."""
        return model_files.unwrap_model(model)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict on the CPU with the original keys (rank 0 only under FSDP)."""
        return model_files.get_state_dict(model)


class _EpochStart:
    """A prepared loader as save_state/load_state see it, with Accelerate's resume rule: a
    restored loader starts its saved epoch from the beginning (same shuffle), and the script
    skips the batches already trained on (skip_first_batches), as it does under Accelerate."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict({**state, "position": 0})
