"""Apply `program.plan.stream`: size the blocks against the budget, offload what does not fit.

Called by the driver after the plan is applied, on the compiled model (`program.module`) and
the user's model (`program.original`), which share every weight. The device map comes from
`infer_auto_device_map` on the user's model (no-split units are find_blocks' repeats), with the
budget `stream[max_memory=]` gives (a share of the model's weights when it is a fraction). The
offloaded tensors are swapped in and out of both trees at once, so neither keeps a reference
that would hold them in memory. Tensors the checkpoint loader already recorded on disk are
read from there (as are the ones `load_checkpoint_in_model(mmap=True)` maps from the
checkpoint); others are written to a temporary folder first (named in the report, removed
with the compiled model).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import warnings
import weakref
from pathlib import Path

import torch

from retarget.bigmodel.device_map import available_memory, infer_auto_device_map, tensor_sizes
from retarget.bigmodel.dispatch import offload_entries
from retarget.core.placement import CPU, DISK
from retarget.ir.program import Program


def stream_weights(program: Program) -> None:
    """Realise `program.plan.stream` on the compiled and the original model."""
    plan = program.plan.stream
    if plan is None:
        return
    model, compiled = program.original, program.module
    main = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device(CPU)
    if plan.source == CPU and main.type == CPU:
        warnings.warn(
            "stream[from=cpu]: the execution device is the cpu, so weights kept on the cpu are "
            "already where they run; nothing is offloaded (use stream[from=disk])",
            stacklevel=3,
        )
        program.plan.stream = dataclasses.replace(plan, device_map={"": CPU})
        return
    budget = _budget(model, plan.max_memory, main)
    planned = infer_auto_device_map(model, max_memory={str(main): budget}, mode="sequential")
    entries = {k: (plan.source if v == DISK else v) for k, v in planned.items()}
    folder = ""
    if DISK in entries.values():
        folder = tempfile.mkdtemp(prefix="retarget-stream-")
        weakref.finalize(compiled, shutil.rmtree, folder, ignore_errors=True)
    runtime = offload_entries(
        compiled,
        entries,
        main,
        offload_dir=folder or None,
        prefetch=plan.prefetch,
        also=(model,),
    )
    if folder and not any(Path(folder).iterdir()):  # every tensor was on disk already
        shutil.rmtree(folder, ignore_errors=True)
        folder = ""
    program.plan.stream = dataclasses.replace(
        plan,
        device_map=entries,
        folder=folder,
        units=len(runtime.units),
        offloaded_bytes=sum(u.nbytes for u in runtime.units),
    )


def _budget(model, max_memory, main: torch.device) -> int:
    if isinstance(max_memory, float):
        return int(max_memory * sum(tensor_sizes(model, None).values()))
    if isinstance(max_memory, int):
        return max_memory
    return available_memory()[str(main)]
