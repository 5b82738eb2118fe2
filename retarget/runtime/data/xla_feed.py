"""XlaFeed: a prepared loader's batches onto the XLA device through torch_xla's ParallelLoader.

Under the `xla` target `Runtime.shard` and `Accelerator.prepare` give the ShardedDataLoader a
feed: its CPU batches go through torch_xla's ParallelLoader (what MpDeviceLoader wraps), which
uploads them in background threads, under SPMD splitting every tensor's dim 0 over the mesh on
the way (execution.xla_device.batch_dim_sharding: tuple batches of tensors of any rank
too), and calls `torch_xla.sync()` before handing out each batch.

The loader keeps its own bookkeeping in the consuming thread: the feed sits between the batch
source and the loader's one-batch look-ahead, so `position`, `end_of_dataloader` (gradient
accumulation's last window, gather_for_metrics) and `state_dict()` count the batches the
training loop received, not the ones the upload threads ran ahead to. An error raised by the
dataset inside an upload thread is raised here, in the loop, instead of ending the epoch early
(ParallelLoader's reader thread would otherwise stop silently).

    >>> loader = compiled.runtime.shard(DataLoader(ds, batch_size=8))   # under "xla"
    >>> x, y = next(iter(loader))     # on the XLA device, each split on dim 0 over 4 devices
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from retarget.execution import xla_device as xla
from retarget.targets.grammar import Target


class XlaFeed:
    """Callable `batches -> the same batches on the XLA device`, one iteration at a time."""

    def __init__(self, *, spmd: bool) -> None:
        self.spmd = spmd
        """Split each tensor's batch dim over the devices (when there are several)."""

    def __call__(self, batches: Iterable[Any]) -> Iterator[Any]:
        if self.spmd:
            xla.enable_spmd()  # before the first XLA tensor, should the loader run first
        shard = self.spmd and xla.device_count() > 1
        failures: list[BaseException] = []
        loader = xla.parallel_loader(_recording(batches, failures), shard_batch=shard)
        try:
            yield from loader.per_device_loader(xla.device())
        finally:
            loader.close()
        if failures:
            raise failures[0]

    def __repr__(self) -> str:
        return f"XlaFeed(spmd={self.spmd})"


def _recording(batches: Iterable[Any], failures: list[BaseException]) -> Iterator[Any]:
    """`batches`, ending at the first exception, which is kept in `failures`."""
    try:
        yield from batches
    except Exception as error:  # the reader thread would swallow it
        failures.append(error)


def feed_for(target: Target) -> XlaFeed | None:
    """The upload path of a loader prepared for `target` (None when it has no xla part)."""
    part = target.get("xla")
    return None if part is None else XlaFeed(spmd=bool(part.get("spmd")))
