"""Apply `program.plan.stream`: offload what the plan's device map keeps off the device.

plan_stream (passes/place/) sized the blocks against the budget and recorded the device map;
here the compiled model (`program.module`) and the user's model (`program.original`), which
share every weight, are hooked together along it, so the offloaded tensors are swapped in and
out of both trees at once and neither keeps a reference that would hold them in memory.
Tensors the checkpoint loader already recorded on disk are read from there (as are the ones
`load_checkpoint_in_model(mmap=True)` maps from the checkpoint); others are written to a
temporary folder first (named in the report, removed with the compiled model).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from retarget.core.placement import CPU, DISK
from retarget.execution.offload.placement import offload_entries
from retarget.ir.program import Program


def stream_weights(program: Program) -> bool:
    """Realise `program.plan.stream` on both models; False when nothing is offloaded."""
    plan = program.plan.stream
    if plan is None:
        return False
    main = torch.device(plan.main_device)
    entries = plan.device_map
    if not any(d == DISK or (d == CPU and main.type != CPU) for d in entries.values()):
        return False
    model, compiled = program.original, program.module
    folder = ""
    if DISK in entries.values():
        folder = tempfile.mkdtemp(prefix="retarget-stream-")
        weakref.finalize(compiled, shutil.rmtree, folder, ignore_errors=True)
    runtime = offload_entries(
        compiled,
        entries,
        main,
        offload_dir=folder or None,
        blocks=set(plan.blocks),
        prefetch=plan.prefetch,
        also=(model,),
    )
    if folder and not any(Path(folder).iterdir()):  # every tensor was on disk already
        shutil.rmtree(folder, ignore_errors=True)
        folder = ""
    program.plan.stream = dataclasses.replace(
        plan,
        folder=folder,
        units=len(runtime.units),
        offloaded_bytes=sum(u.nbytes for u in runtime.units),
    )
    return True
