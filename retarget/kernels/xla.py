"""torch-xla behind one probe: the device, SPMD, sharding marks, the step boundary, counters.

torch-xla is optional and lives in its own environment: the newest release on the registry
(2.9.0) needs exactly torch 2.9.0, which its metadata does not say, so installed beside another
torch it imports with an undefined symbol. `torch_xla_or_refuse` turns every way the import can
fail into TargetNotSupportedError saying how to install it; nothing else here imports torch_xla
before it has run.

SPMD is a process-wide switch (`use_spmd` must come before the first XLA tensor): one 1-D mesh
over every device of the process, axis "fsdp"; `mark_sharding` shards a tensor's dim 0 over it.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

import torch

from retarget.core.errors import TargetNotSupportedError

#: How to get a working torch-xla (the README's "XLA" section says the same).
INSTALL = (
    "install it into its own environment: python -m venv .venv-xla && .venv-xla/bin/pip install "
    "-c constraints-xla.txt -e '.[xla,test]' (torch-xla 2.9 needs exactly torch 2.9.0; keep the "
    "main environment on its torch), then run with PJRT_DEVICE=TPU, CUDA or CPU"
)
MESH_AXIS = "fsdp"


@functools.cache
def torch_xla_or_refuse() -> ModuleType:
    """The torch_xla module, imported with its runtime; refuses with how to install it."""
    try:
        import torch_xla
        import torch_xla.runtime  # noqa: F401 - the PJRT runtime, needed by everything below
    except ImportError as error:
        text = str(error)
        why = (
            f"torch_xla is installed but was built for another torch than {torch.__version__} "
            f"({text[:160]})"
            if "undefined symbol" in text
            else f"torch_xla cannot be imported ({text[:160]})"
        )
        raise TargetNotSupportedError(f"xla: {why}; {INSTALL}") from None
    except OSError as error:  # a missing shared library of its torch build
        raise TargetNotSupportedError(
            f"xla: torch_xla failed to load a library ({str(error)[:160]}); {INSTALL}"
        ) from None
    return torch_xla


def available() -> bool:
    """torch_xla imports here (tests use it to skip)."""
    try:
        torch_xla_or_refuse()
    except TargetNotSupportedError:
        return False
    return True


def device() -> torch.device:
    """This process's XLA device (under SPMD the virtual device spanning all of them)."""
    return torch_xla_or_refuse().device()


def device_count() -> int:
    """XLA devices this process addresses (PJRT_DEVICE=CPU: CPU_NUM_DEVICES)."""
    torch_xla_or_refuse()
    import torch_xla.runtime as xr

    return int(xr.global_runtime_device_count())


def platform() -> str:
    """The PJRT device kind: TPU, CUDA, CPU ... (PJRT_DEVICE)."""
    torch_xla_or_refuse()
    import torch_xla.runtime as xr

    return str(xr.device_type() or os.environ.get("PJRT_DEVICE", "?"))


def spmd_enabled() -> bool:
    torch_xla_or_refuse()
    import torch_xla.runtime as xr

    return bool(xr.is_spmd())


def enable_spmd() -> None:
    """Switch this process to SPMD (once; must precede the first XLA tensor it creates)."""
    torch_xla_or_refuse()
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        xr.use_spmd()


@functools.cache
def mesh() -> Any:
    """The 1-D mesh over every device, axis MESH_AXIS."""
    torch_xla_or_refuse()
    import numpy as np
    import torch_xla.distributed.spmd as xs

    count = device_count()
    return xs.Mesh(np.arange(count), (count,), (MESH_AXIS,))


def mark_sharding(tensor: torch.Tensor, spec: tuple[str | None, ...]) -> None:
    """Annotate `tensor` (on the XLA device) with `spec` over the mesh, e.g. ("fsdp", None)."""
    torch_xla_or_refuse()
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(tensor, mesh(), spec)


def sharding_spec(tensor: torch.Tensor) -> str:
    """XLA's description of how `tensor` is laid out ("" when it is not annotated)."""
    torch_xla_or_refuse()
    import torch_xla

    return str(torch_xla._XLAC._get_xla_sharding_spec(tensor))


def local_shard_shapes(tensor: torch.Tensor) -> list[tuple[int, ...]]:
    """The shapes of the pieces each device holds."""
    torch_xla_or_refuse()
    import torch_xla

    shards = torch_xla._XLAC._get_local_shards([tensor])[0]
    return [tuple(shard.shape) for shard, _ in shards]


def sync() -> None:
    """Cut the lazy graph here and run it: the step boundary."""
    torch_xla_or_refuse().sync()


def compile_count() -> int:
    """Graphs XLA compiled in this process so far."""
    torch_xla_or_refuse()
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0
