"""Shard a DataLoader across processes: each rank its share of every epoch, in an agreed order.

    >>> loader = shard_dataloader(DataLoader(dataset, batch_size=8, shuffle=True), state)
    >>> for epoch in range(3):
    ...     for batch in loader:            # this rank's batches, already on state.device
    ...         ...                         # loader.end_of_dataloader: True on the last one
    >>> resumed = skip_first_batches(loader, 120)   # same epoch order, from batch 120 on

What every rank gets is decided by `data_sharding.deal_rounds` (whole batches round robin, or
each batch split; the last round completed by wrap-around with `even_batches`), from the epoch's
batches drawn by `data_sharding.epoch_batches`: shuffles are seeded from one seed that rank 0
chooses and broadcasts, plus the epoch, so ranks agree within an epoch, epochs differ, and the
order does not depend on the number of processes or on the training loop's RNG. The epoch
advances by itself each time iteration starts again (or `set_epoch(e)`).

Three ways to read, same batches:
- map-style dataset: each rank loads only its own samples (index-level sharding);
- IterableDataset: every rank reads the stream and keeps its slices (`IterableShard`);
- `dispatch_batches=True`: rank 0 alone reads and collates every rank's batch and scatters them
  (`scatter_object_list`); the other ranks never touch the dataset.

In a world of one nothing is padded or sent. `active_loader()` is the loader being iterated
(a stack): gather_for_metrics and accumulation read its end_of_dataloader and remainder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from retarget.execution.nested import send_to_device
from retarget.execution.process import ProcessState
from retarget.runtime.data.dispatch import CollateTagged, receive_batches
from retarget.runtime.data.loader_facts import (
    batch_size_of,
    check_agreeing,
    check_shardable,
    drops_last,
    skip_plain,
    worker_settings,
)
from retarget.runtime.data.sharding import (
    Deal,
    DrawsFactory,
    EpochDraws,
    IterableShard,
    ShardOptions,
    deal_rounds,
    epoch_batches,
)

_ACTIVE: list[ShardedDataLoader] = []


def active_loader() -> ShardedDataLoader | None:
    """The innermost ShardedDataLoader whose iteration is in progress, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def active_loaders() -> list[ShardedDataLoader]:
    """Every ShardedDataLoader being iterated, outermost first (nested loops)."""
    return list(_ACTIVE)


def shard_dataloader(
    loader: DataLoader,
    state: ProcessState | None = None,
    *,
    split_batches: bool = False,
    even_batches: bool = True,
    dispatch_batches: bool = False,
    device: torch.device | str | None = None,
    seed: int | None = None,
    order: str | DrawsFactory = "seeded",
    agree: ProcessState | None = None,
) -> ShardedDataLoader:
    """`loader` divided between the processes of `state` (see ShardOptions for the options).

    Every rank must call this together: rank 0's `seed` (by default the loader generator's or
    torch's initial seed) is broadcast so that all ranks shuffle alike; `order` given a factory of
    EpochDraws draws each epoch by its rules instead (Accelerate's: ShardOptions.order). Batches go
    to `device` (default: the process's); `agree` (default `state`, tp: all) share the seed.
    """
    state = state or ProcessState.current()
    agree = check_agreeing(state, agree or state, dispatch_batches)
    if seed is None:
        generator = loader.generator
        seed = generator.initial_seed() if generator is not None else torch.initial_seed()
    box = [int(seed) % 2**62]
    if agree.distributed:
        dist.broadcast_object_list(box, src=0)
    options = ShardOptions(
        split_batches=split_batches,
        even_batches=even_batches,
        dispatch_batches=dispatch_batches,
        order=order,
    )
    return ShardedDataLoader(loader, state, options=options, device=device, seed=box[0])


def skip_first_batches(loader: Any, num_batches: int) -> Any:
    """A loader whose next iteration starts after `num_batches` batches of the current epoch.

    A ShardedDataLoader keeps the uninterrupted epoch's order; later iterations are whole
    epochs. A plain DataLoader never loads the skipped samples of a map-style dataset; its
    shuffle is the uninterrupted one only if torch's RNG is as at that epoch's start."""
    if num_batches < 0:
        raise ValueError(f"skip_first_batches: num_batches={num_batches} must be >= 0")
    if isinstance(loader, ShardedDataLoader):
        return loader.skip_first_batches(num_batches)
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"skip_first_batches takes a DataLoader or ShardedDataLoader, got {type(loader)}"
        )
    return skip_plain(loader, num_batches)


class ShardedDataLoader:
    """This rank's share of a DataLoader; build it with `shard_dataloader`.

    Attributes: `dataset` and `base_loader` (the wrapped ones), `batch_size` (per rank),
    `total_batch_size` (all ranks, one step), `total_dataset_length`, `epoch`, `position`
    (batches of this epoch consumed, skipped ones included), and, for the iteration in
    progress, `end_of_dataloader` (True while the last batch is processed), `remainder` (real
    samples in the last round; -1 unknown) and `duplicates` (wrap-around samples that complete
    the last round; -1 unknown). `feed`, when set, moves the batches instead of `.to(device)`
    (batches -> batches on the device; under `xla`: runtime.data.xla_feed).
    """

    def __init__(
        self,
        loader: DataLoader,
        state: ProcessState,
        *,
        options: ShardOptions | None = None,
        device: torch.device | str | None = None,
        seed: int = 0,
    ):
        options = options if options is not None else ShardOptions()
        check_shardable(loader, state, options)
        self.base_loader, self.dataset, self.state = loader, loader.dataset, state
        self.options, self.seed = options, seed
        self.device = torch.device(device) if device is not None else state.device
        self.feed: Callable[[Iterable[Any]], Iterable[Any]] | None = None
        self._iterable = isinstance(loader.dataset, IterableDataset)
        # padding and sending only serve equal counts across ranks: a world of one needs neither
        self._even = options.even_batches and state.distributed
        self._dispatch = options.dispatch_batches and state.distributed
        self._loader_batch = batch_size_of(loader)
        #: The last incomplete batch of an epoch is dropped: the loader's drop_last, or
        #: `drop_incomplete_batches()` (pp, whose stages run one batch size only).
        self.drop_last = drops_last(loader)
        split = options.split_batches
        self.batch_size: int | None = None
        self.total_batch_size: int | None = None
        if self._loader_batch is not None:
            self.batch_size = self._loader_batch // (state.world_size if split else 1)
            self.total_batch_size = self.batch_size * state.world_size
        # a stream's unit is an item: a sample, or a whole batch when the loader does not batch
        self._per_rank = self.batch_size or 1
        self.epoch, self.position = 0, 0
        self.end_of_dataloader, self.remainder, self.duplicates = False, -1, -1
        self._started = self._finished = False
        self._skip = 0
        self._deal_cache: tuple[int, Deal] | None = None
        self._final = (-1, -1)
        self._inner: DataLoader | None = None
        self._inner_batches = _EpochBatches()
        self._draws: EpochDraws | None = None
        if options.order != "seeded" and not self._iterable:
            self._draws = options.order(loader, state, dispatch=self._dispatch)

    def drop_incomplete_batches(self) -> None:
        """Drop an epoch's last batch when it is short, from the next iteration on (as the
        loader's drop_last=True would)."""
        self.drop_last = True
        self._deal_cache = None

    def set_even_batches(self, even_batches: bool) -> None:
        """Change `even_batches` from the next iteration on (join_uneven_inputs' override)."""
        self.options = dataclasses.replace(self.options, even_batches=even_batches)
        self._even = even_batches and self.state.distributed
        self._deal_cache = None

    # -- epochs and resume ----------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch `epoch` next (its shuffle); later iterations count on from there."""
        self.epoch, self.position = epoch, 0
        self._started = self._finished = False

    def skip_first_batches(self, num_batches: int) -> ShardedDataLoader:
        """A copy whose next iteration is this epoch from batch `num_batches` on."""
        skipped = ShardedDataLoader(
            self.base_loader, self.state, options=self.options, device=self.device, seed=self.seed
        )
        skipped.set_epoch(self.epoch)
        skipped._draws, skipped.feed = self._draws, self.feed
        skipped.drop_last = self.drop_last
        skipped._skip = num_batches
        return skipped

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: resuming from it continues with the next unseen batch (in
        Accelerate's order, with the RNG states its epoch was drawn from)."""
        done = self._finished or (not self._iterable and self.position >= self._epoch_length())
        finished = self._started and done
        position = 0 if finished else self.position if self._started else self._skip
        state = {"epoch": self.epoch + finished, "position": position, "seed": self.seed}
        if self._draws is not None and self._started:
            state.update(self._draws.state_dict(finished))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s point: same seed, same epoch, next unseen batch."""
        self.seed = state["seed"]
        self.set_epoch(state["epoch"])
        self._skip = state["position"]
        if self._draws is not None:
            self._draws.load_state_dict(state)

    @property
    def total_dataset_length(self) -> int | None:
        """len(dataset), or None for a stream without a length."""
        try:
            return len(self.dataset)
        except TypeError:
            return None

    def __len__(self) -> int:
        """Batches this rank gets in the next (or current) iteration."""
        return max(0, self._epoch_length() - self._skip)

    # -- iteration ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self._started:
            self.epoch, self.position = self.epoch + 1, 0
        self._started, self._finished = True, False
        skip, self.position = self._skip, self._skip
        self.end_of_dataloader, self.remainder, self.duplicates = False, -1, -1
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        _ACTIVE.append(self)
        try:
            yield from self._look_ahead(self._source(self.epoch, skip))
        finally:
            self._skip = 0
            del _ACTIVE[max(i for i, entry in enumerate(_ACTIVE) if entry is self)]

    def _look_ahead(self, source: Iterable[Any]) -> Iterator[Any]:
        """Yield one batch behind the source, so the last one is known while it is processed."""
        batches = iter(source if self.feed is None else self.feed(source))
        current = next(batches, _END)
        while current is not _END:
            current = send_to_device(current, self.device) if self.feed is None else current
            following = next(batches, _END)
            self.end_of_dataloader = following is _END
            self.position += 1
            yield current
            current = following
        self.end_of_dataloader, self._finished = True, True

    def _source(self, epoch: int, skip: int) -> Iterator[Any]:
        if self._draws is not None:
            drawn = self._draws.draw(epoch)
            if drawn or not self._dispatch:  # dispatch: rank 0 alone draws the batches
                self._deal_cache = (epoch, self._deal_batches(drawn))
        if self._dispatch:
            return receive_batches(
                self.state,
                self._tagged(epoch, skip) if self.state.rank == 0 else None,
                final_counts=lambda: self._final,
                on_last=self._set_counts,
            )
        if self._iterable:
            return self._stream(epoch, skip)
        deal = self._deal(epoch)
        self.remainder, self.duplicates = deal.remainder, deal.duplicates
        return iter(self._map_loader(deal.parts_of(self.state.rank)[skip:], epoch))

    def _deal(self, epoch: int) -> Deal:
        """The epoch's deal: drawn (seeded order), or, in Accelerate's order before the epoch
        is drawn, dealt from the batch sizes alone (its lengths are right; RNG untouched)."""
        if self._deal_cache is None or self._deal_cache[0] != epoch:
            if self._draws is not None:
                batches = [list(range(size)) for size in self._draws.batch_sizes()]
            else:
                batches = epoch_batches(self.base_loader.batch_sampler, self.seed, epoch)
            self._deal_cache = (epoch, self._deal_batches(batches))
        return self._deal_cache[1]

    def _deal_batches(self, batches: list[list[int]]) -> Deal:
        if self.drop_last and self._loader_batch is not None:
            # drop_incomplete_batches() on a loader that keeps its short last batch
            batches = [batch for batch in batches if len(batch) >= self._loader_batch]
        if self._draws is not None and self._dispatch:
            return self._draws.deal_dispatched(
                batches,
                world=self.state.world_size,
                split_batches=self.options.split_batches,
                drop_last=self.drop_last,
            )
        return deal_rounds(
            batches,
            world=self.state.world_size,
            batch_size=self._loader_batch,
            split_batches=self.options.split_batches,
            even_batches=self._even,
            drop_last=self.drop_last,
        )

    def _epoch_length(self) -> int:
        if not self._iterable:
            return len(self._deal(self.epoch).parts_of(self.state.rank))
        items = len(self.dataset)  # a stream without a length raises TypeError, as DataLoader
        full, part = divmod(items, self._per_rank * self.state.world_size)
        if part and not self.drop_last:
            full += int(self._even or part > self.state.rank * self._per_rank)
        return full

    # -- reading --------------------------------------------------------------------------------

    def _map_loader(self, batches: list[list[int]], epoch: int) -> DataLoader:
        """One DataLoader for every epoch (persistent workers stay), fed this epoch's batches."""
        if self._inner is None:
            settings = worker_settings(self.base_loader)
            self._inner = DataLoader(self.dataset, batch_sampler=self._inner_batches, **settings)
        self._inner_batches.batches = batches
        self._inner.generator = self._worker_seed(epoch, self.state.rank)
        return self._inner

    def _shard(self, epoch: int, skip: int, rank: int | None) -> IterableShard:
        return IterableShard(
            self.dataset,
            world=self.state.world_size,
            rank=rank,
            per_rank=self._per_rank,
            even_batches=self._even,
            drop_last=self.drop_last,
            seed=(self.seed + epoch) % 2**62,
            skip_rounds=skip,
        )

    def _stream(self, epoch: int, skip: int) -> Iterator[Any]:
        shard = self._shard(epoch, skip, self.state.rank)
        # worker RNG must not depend on the rank: every rank reads the same stream
        settings = worker_settings(self.base_loader, self._worker_seed(epoch, 0))
        yield from DataLoader(shard, batch_size=self.batch_size, **settings)
        self.remainder, self.duplicates = self._stream_counts(shard)

    def _stream_counts(self, shard: IterableShard) -> tuple[int, int]:
        """(remainder, duplicates) of a stream's last round, once the stream is read."""
        size, drop = self._per_rank * self.state.world_size, self.drop_last
        items = self.total_dataset_length
        if self.base_loader.num_workers == 0:
            real = shard.last_round_real  # the workers' copies of the shard are out of reach
        elif items is not None:
            real = (size if items >= size else 0) if drop else (items % size or min(size, items))
        else:
            return -1, -1
        return real, size - real if self._even and not drop and 0 < real < size else 0

    def _set_counts(self, counts: tuple[int, int]) -> None:
        self.remainder, self.duplicates = counts

    def _worker_seed(self, epoch: int, rank: int) -> torch.Generator:
        """Seeds the worker processes' RNG (and nothing else) per epoch, not from global RNG."""
        return torch.Generator().manual_seed(hash((self.seed, epoch, rank)) % 2**62)

    # -- dispatch -------------------------------------------------------------------------------

    def _tagged(self, epoch: int, skip: int) -> Iterator[tuple[int, Any]]:
        """Rank 0: every rank's batches, collated here, as (rank, batch), round by round."""
        if self._iterable:
            shard = self._shard(epoch, skip, None)
            collate = CollateTagged(self.base_loader.collate_fn, self.batch_size is not None)
            settings = worker_settings(self.base_loader, self._worker_seed(epoch, 0))
            settings["collate_fn"] = collate
            yield from DataLoader(shard, batch_size=None, **settings)
            self._final = self._stream_counts(shard)
            return
        deal = self._deal(epoch)
        owners, parts = [], []
        for round_ in deal.rounds[skip:]:
            for rank, part in enumerate(round_):
                if part is not None:
                    owners.append(rank)
                    parts.append(part)
        self._final = (deal.remainder, deal.duplicates)
        yield from zip(owners, self._map_loader(parts, epoch), strict=True)


_END = object()


class _EpochBatches:
    """A batch sampler whose batches are replaced each epoch."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)
