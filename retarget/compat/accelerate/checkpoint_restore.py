"""`Accelerator.load_state(folder)` for a folder Accelerate's own save_state wrote.

A run that trained under Hugging Face Accelerate continues under retarget: prepare the same
model(s), optimizer(s), scheduler(s), register the same objects, then

    accelerator.load_state("runs/accelerate/checkpoint_3")     # Accelerate's files

restores weights, optimizer and scheduler states, the loss scaler, registered objects, the
step and the RNG states (compat/accelerate/checkpoint_folder.py reads the files, refusing any
pickle that holds more than tensors and plain data). Accelerate saves full, unsharded tensors
and optimizer states keyed by parameter position, so the target must keep whole parameters on
each process (single, ddp and their precisions); FSDP targets are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from retarget.compat.accelerate.checkpoint_folder import AccelerateObjects, load_accelerate_state
from retarget.runtime.state.checkpoint import ResumePoint


def load_accelerate_checkpoint(accelerator: Any, folder: str | Path) -> ResumePoint:
    """Load Accelerate's checkpoint `folder` into what `accelerator` prepared and registered."""
    if "fsdp" in accelerator.target.names:
        raise NotImplementedError(
            f"load_state({str(folder)!r}): an Accelerate checkpoint holds full parameters and "
            f"an optimizer state keyed by position, which the '{accelerator.target}' target "
            "shards; load it under a ddp or single target and save_state from there"
        )
    runtimes = accelerator._runtimes()
    scalers = [r.scaler for r in runtimes if r.scaler is not None]
    objects = AccelerateObjects(
        models=list(accelerator._models),
        optimizers=[getattr(o, "optimizer", o) for o in accelerator._optimizers],
        schedulers=list(accelerator._schedulers),
        grad_scaler=scalers[0].grad_scaler if scalers else None,
        custom_objects=list(accelerator._registry),
    )
    step = load_accelerate_state(folder, objects, rank=accelerator.process_index)
    accelerator.step = step
    for runtime in runtimes:
        runtime.accumulation_step = 0
    return ResumePoint(path=Path(folder), step=step, accumulation_step=0)
