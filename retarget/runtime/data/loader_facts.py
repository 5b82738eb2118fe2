"""What sharding needs from a plain torch DataLoader: its settings, checks, plain skipping.

`ShardedDataLoader` rebuilds DataLoaders over the user's dataset (one per rank's share) and must
keep everything the user configured (workers, collate_fn, pinning, timeouts); it must also
refuse loaders it cannot shard as asked, before any process has started iterating.
`skip_first_batches` on a plain DataLoader lives here too: it needs nothing of the sharding.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from retarget.execution.process import ProcessState
from retarget.runtime.data.sharding import ShardOptions


def skip_plain(loader: DataLoader, count: int) -> Any:
    """A plain DataLoader whose next iteration leaves out its first `count` batches.

    A map-style dataset's skipped batches are never loaded (the batch sampler skips them).
    """
    if isinstance(loader.dataset, IterableDataset) or loader.batch_sampler is None:
        return SkippedLoader(loader, count)
    skipping = SkipFirstBatches(loader.batch_sampler, count)
    return DataLoader(loader.dataset, batch_sampler=skipping, **worker_settings(loader))


class SkipFirstBatches:
    """A batch sampler that leaves out the first `count` batches of its first iteration."""

    def __init__(self, batch_sampler: Any, count: int):
        self.batch_sampler, self.count = batch_sampler, count
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        self.sampler = getattr(batch_sampler, "sampler", None)

    def __iter__(self) -> Iterator[list[int]]:
        count, self.count = self.count, 0
        return itertools.islice(iter(self.batch_sampler), count, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.count)


class SkippedLoader:
    """A plain loader of a stream whose first iteration leaves out the first `count` batches."""

    def __init__(self, loader: DataLoader, count: int):
        self.loader, self.count = loader, count
        self.dataset, self.batch_size = loader.dataset, loader.batch_size

    def __iter__(self) -> Iterator[Any]:
        count, self.count = self.count, 0
        return itertools.islice(iter(self.loader), count, None)

    def __len__(self) -> int:
        return max(0, len(self.loader) - self.count)


def batch_size_of(loader: DataLoader) -> int | None:
    if loader.batch_size is not None:
        return loader.batch_size
    return getattr(loader.batch_sampler, "batch_size", None)


def drops_last(loader: DataLoader) -> bool:
    return bool(loader.drop_last or getattr(loader.batch_sampler, "drop_last", False))


def worker_settings(loader: DataLoader, generator: torch.Generator | None = None) -> dict:
    """The loader's process and memory settings, for a DataLoader built over its dataset."""
    settings: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": generator if generator is not None else loader.generator,
        "pin_memory_device": loader.pin_memory_device,
        "in_order": loader.in_order,
    }
    if loader.num_workers > 0:
        settings["prefetch_factor"] = loader.prefetch_factor
        settings["persistent_workers"] = loader.persistent_workers
    return settings


def check_shardable(loader: DataLoader, state: ProcessState, options: ShardOptions) -> None:
    """Refuse what cannot be sharded as asked, naming the setting to change."""
    if not isinstance(loader, DataLoader):
        raise TypeError(f"shard_dataloader takes a torch DataLoader, got {type(loader).__name__}")
    samplers = (loader.sampler, getattr(loader.batch_sampler, "sampler", None))
    if any(isinstance(s, DistributedSampler) for s in samplers):
        raise ValueError(
            "shard_dataloader: the loader already uses a DistributedSampler, so it would be "
            "sharded twice; build it with a plain sampler (shuffle=True/False)"
        )
    iterable = isinstance(loader.dataset, IterableDataset)
    size, world = batch_size_of(loader), state.world_size
    if not iterable and loader.batch_sampler is None:
        raise ValueError(
            "shard_dataloader: the loader has batch_size=None (it yields single samples); "
            "use batch_size=1 or a batch_sampler"
        )
    if options.split_batches and (size is None or size % world):
        raise ValueError(
            f"shard_dataloader(split_batches=True) cuts each batch into {world} equal parts, "
            f"but the loader's batch size is {size}; use a batch size that is a multiple of "
            f"{world}, or split_batches=False"
        )
    if options.even_batches and world > 1 and size is None and not iterable:
        raise ValueError(
            "shard_dataloader(even_batches=True) completes the last batches to the loader's "
            "batch size, but its batch sampler has no batch_size; use even_batches=False"
        )


def check_agreeing(state: ProcessState, agree: ProcessState, dispatch: bool) -> ProcessState:
    """`agree`, the processes that shuffle alike, unless dispatching would break tp: under
    tensor parallelism `state` is the dp view and the ranks of a tp group share batches."""
    if dispatch and agree.world_size != state.world_size:
        raise ValueError(
            "dispatch_batches=True under tensor parallelism: rank 0 would scatter batches to "
            "every process, but the ranks of a tp group must get the same batch; use the "
            "default dispatch_batches=False"
        )
    return agree
