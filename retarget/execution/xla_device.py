"""torch-xla behind one probe: the device, SPMD, sharding marks, the step boundary, counters.

torch-xla is optional and lives in its own environment: the newest release on the registry
(2.9.0) needs exactly torch 2.9.0, which its metadata does not say, so installed beside another
torch it imports with an undefined symbol. `torch_xla_or_refuse` turns every way the import can
fail into TargetNotSupportedError saying how to install it; nothing else here imports torch_xla
before it has run.

SPMD is a process-wide switch (`use_spmd` must come before the first XLA tensor): one 1-D mesh
over every device of the process, axis "fsdp"; `mark_sharding` shards a tensor's dim 0 over it.
`parallel_loader` uploads a loader's batches in background threads (torch_xla's ParallelLoader,
what MpDeviceLoader wraps), each tensor's batch dim split over the mesh on the way.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterable
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


#: The message when a CPU backward ran before XLA's runtime started.
ENGINE_SIZED_BEFORE_XLA = (
    "xla: this process ran a backward on the CPU before torch_xla's runtime started, so "
    "torch's autograd engine has no queue for the XLA device and the first XLA backward fails "
    "inside it (torch_xla alone does the same). Build the XLA model (compile_for(model, 'xla')) "
    "before any other backward in the process, or train it in a fresh process"
)


@functools.cache
def check_backward_runs() -> None:
    """One backward of a one-element XLA tensor, which must succeed before training: torch's
    autograd engine sizes its per-device queues at its first backward, and a CPU backward before
    XLA's runtime started leaves none for XLA (an internal assert at the first XLA backward).
    Refused with what to do. Call it after SPMD is switched on, if it is to be."""
    x = torch.ones((), device=device(), requires_grad=True)
    try:
        (x * 2).backward()
    except RuntimeError as error:
        if "device_ready_queues_" in str(error) or "INTERNAL ASSERT" in str(error):
            raise TargetNotSupportedError(ENGINE_SIZED_BEFORE_XLA) from None
        raise
    sync(wait=True)  # the probe's graph runs now, not inside the first training step


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
    """The shapes of the pieces each device holds (read from the pieces themselves: on a
    pending tensor, settle first or each call runs the lazy graph)."""
    torch_xla_or_refuse()
    import torch_xla

    shards = torch_xla._XLAC._get_local_shards([tensor])[0]
    return [tuple(shard.shape) for shard, _ in shards]


def sync(*, wait: bool = False) -> None:
    """Cut the lazy graph here and launch it: the step boundary (`wait`: until it finished)."""
    torch_xla_or_refuse().sync(wait=wait)


def settle(modules: Iterable[torch.nn.Module]) -> None:
    """Run what XLA's lazy graph still owes before `modules`' tensors are read out one by one
    (unwrap, save_state, save_model).

    After an optimizer step the parameters and the optimizer's state are pending computations;
    reading each one alone compiles and runs a graph of its own. Measured on CPU PJRT for a
    2-layer Llama after 3 AdamW steps: save_state 114 s and 63 compiles unsettled, 0.15 s and
    none after one sync; unwrap() 32 s (21 compiles) against 0.01 s. A no-op without torch_xla
    loaded or with no parameter on an XLA device.
    """
    if "torch_xla" in sys.modules and any(
        p.device.type == "xla" for m in modules for p in m.parameters()
    ):
        sync(wait=True)


def compile_count() -> int:
    """Traced graphs XLA compiled in this process so far (misses of its graph cache).

    Not the CompileTime metric: that also counts the small program XLA compiles, uncached,
    every time a sharded tensor is copied to the CPU (measured: one per `.cpu()` under SPMD).
    """
    torch_xla_or_refuse()
    import torch_xla.debug.metrics as met

    return int(met.counter_value("UncachedCompile") or 0)


@functools.cache
def batch_dim_sharding() -> Any:
    """An input sharding for ParallelLoader: dim 0 of every tensor over the mesh, any rank.

    torch_xla's ShardingSpec applies one partition spec to the tensors whose rank matches it
    and silently leaves the others whole, and its dict form needs dict batches with a spec per
    key; a batch of (inputs, labels) has tensors of two ranks. This one builds the spec from
    each tensor's rank, and leaves whole (replicated) a 0-dim tensor or one whose dim 0 does
    not divide by the device count (the pre-hook of the compiled model then does the same).
    """
    torch_xla_or_refuse()
    import torch_xla.distributed.spmd as xs

    count = device_count()
    by_rank: dict[int, Any] = {}

    class BatchDimSharding(xs.ShardingSpec):
        def can_apply(self, t: torch.Tensor) -> bool:
            return t.dim() >= 1 and t.shape[0] % count == 0

        def xla_spec(self, t: torch.Tensor) -> Any:
            if not self.can_apply(t):
                return None
            if t.dim() not in by_rank:
                spec = (MESH_AXIS,) + (None,) * (t.dim() - 1)
                by_rank[t.dim()] = xs.ShardingSpec(mesh(), spec)
            return by_rank[t.dim()].xla_spec(t)

    return BatchDimSharding(mesh(), (MESH_AXIS,))


def parallel_loader(batches: Iterable[Any], *, shard_batch: bool) -> Any:
    """torch_xla's ParallelLoader over `batches` onto this process's device (close() it).

    Its `per_device_loader(device())` yields the batches on the device, calling
    `torch_xla.sync()` before each one (the step boundary MpDeviceLoader gives); with
    `shard_batch` each tensor's dim 0 is split over the mesh as it is uploaded.
    """
    torch_xla_or_refuse()
    import torch_xla.distributed.parallel_loader as pl

    sharding = batch_dim_sharding() if shard_batch else None
    return pl.ParallelLoader(batches, [device()], input_sharding=sharding)


def rng_seed() -> int | None:
    """The XLA device's running RNG seed (dropout on XLA tensors), or None when this process has
    not started the XLA runtime (nothing to save; and asking would start it)."""
    if "torch_xla" not in sys.modules:
        return None
    import torch_xla

    if not torch_xla._XLAC._xla_runtime_is_initialized():
        return None
    import torch_xla.core.xla_model as xm

    return int(xm.get_rng_state())


def set_rng_seed(seed: int) -> None:
    """Continue the XLA device's random stream from `seed` (a value of `rng_seed()`)."""
    torch_xla_or_refuse()
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(seed)
