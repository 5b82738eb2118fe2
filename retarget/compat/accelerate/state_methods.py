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

from retarget.compat.accelerate.checkpoint_folder import is_accelerate_checkpoint
from retarget.compat.accelerate.checkpoint_restore import load_accelerate_checkpoint
from retarget.compat.accelerate.fp32_wrapper import set_fp32_wrapper
from retarget.runtime.state import checkpoint
from retarget.runtime.state import save_model as model_files
from retarget.targets.precisions import LOW_DTYPES


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
        if self._save_hooks:
            self._run_save_hooks(str(output_dir or self._next_checkpoint_dir()))
        return checkpoint.save_state(
            output_dir,
            **self._state_objects(),
            step=self.step,
            accumulation_step=self._accumulation_step(),
            project=project,
            overwrite=True,  # Accelerate writes into a folder that exists, whatever it holds
        )

    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict | None = None,
        **load_model_func_kwargs: Any,
    ):
        """Restore what save_state saved, into the objects prepared (same ones, same order).

        `strict=True` (the default, Accelerate's model loading keyword) is what happens: every
        tensor is checked against the checkpoint. `load_kwargs` (torch.load's) and
        `strict=False` are refused: nothing is unpickled, and DCP loads whole models. A folder
        written by Hugging Face Accelerate's save_state is read too (checkpoint_folder.py,
        checkpoint_restore.py):
        the run continues from Accelerate's step.
        """
        if load_kwargs:
            raise ValueError(
                f"load_state(load_kwargs={load_kwargs!r}) cannot be honoured: checkpoints are "
                "read without torch.load (DCP, safetensors, JSON)"
            )
        if load_model_func_kwargs.pop("strict", True) is not True:
            raise ValueError(
                "load_state(strict=False) cannot be honoured: models are restored through "
                "torch.distributed.checkpoint, which loads every tensor the model has"
            )
        if load_model_func_kwargs:
            raise TypeError(f"load_state takes no {', '.join(sorted(load_model_func_kwargs))}")
        if input_dir is not None and is_accelerate_checkpoint(input_dir):
            if not self._models:
                raise RuntimeError("load_state: prepare the model first")
            return load_accelerate_checkpoint(self, input_dir)
        project = self.project_configuration.checkpoints()
        if self._load_hooks:
            self._run_load_hooks(str(input_dir or self._latest_checkpoint_dir()))
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

    def _next_checkpoint_dir(self) -> str:
        project = self.project_configuration.checkpoints()
        if project is None:
            raise ValueError("save_state needs output_dir, or automatic checkpoint naming")
        return str(project.checkpoints_dir / f"checkpoint_{self.save_iteration}")

    def _latest_checkpoint_dir(self) -> str:
        project = self.project_configuration.checkpoints()
        existing = checkpoint.numbered_checkpoints(project) if project is not None else []
        if not existing:
            raise ValueError("load_state needs input_dir, or a complete numbered checkpoint")
        return str(existing[-1])

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

    def unwrap_model(
        self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> nn.Module:
        """The model object you passed to prepare, carrying the current weights.

        As in Accelerate: under bf16/fp16 its forward runs in autocast with float32 outputs
        unless keep_fp32_wrapper=False; when the target compiles and keep_torch_compile=True it
        comes back in torch.compile (the target's backend and mode)."""
        original = model_files.unwrap_model(model)
        dtype = LOW_DTYPES.get("bf16" if self.mixed_precision == "fp8" else self.mixed_precision)
        set_fp32_wrapper(original, dtype if keep_fp32_wrapper else None, self.device.type)
        part = self.target.get("compile")
        if keep_torch_compile and part is not None:
            options = dict(part.options)
            return torch.compile(
                original, backend=options.get("backend", "inductor"), mode=options.get("mode")
            )
        return original

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict on the CPU with the original keys (rank 0 only under FSDP);
        unwrap=False: the prepared model's own `state_dict()` (its tensors, as they are)."""
        if not unwrap:
            return model.state_dict()
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
