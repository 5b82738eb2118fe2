"""Dispatch mode: rank 0 reads and collates every rank's batch and sends each rank its own.

For data that only one process should read (a stream from a queue, costly preprocessing done
once), `shard_dataloader(..., dispatch_batches=True)` makes rank 0 run the same deal as the
sharded mode, collate every rank's batch itself (with the loader's workers), and scatter the
batches round by round; the other ranks never touch the dataset and receive exactly the batches
they would have loaded themselves.

Each message is `(batch or None, last, final)`: rank 0 reads one round ahead so that it can say
which round is the last, and with it the last round's (remainder, duplicates) that
`gather_for_metrics` needs. A rank with no batch in the last round (even_batches=False) gets
None there. Batches travel pickled (`scatter_object_list`), so any collated structure works.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from retarget.execution.process import ProcessState

#: (remainder, duplicates) of an epoch's last round, as ShardedDataLoader reports them.
Counts = tuple[int, int]


def receive_batches(
    state: ProcessState,
    tagged: Iterator[tuple[int, Any]] | None,
    *,
    final_counts: Callable[[], Counts],
    on_last: Callable[[Counts], None],
) -> Iterator[Any]:
    """Every rank: this rank's batch of each round, as sent by rank 0.

    Rank 0 passes `tagged`, every rank's batches as `(rank, batch)` in round order, and
    `final_counts`, read once `tagged` is exhausted; the other ranks pass None. `on_last`
    receives the counts on every rank before the last batch is yielded.
    """
    rounds = _group_rounds(tagged if tagged is not None else iter(()))
    pending = next(rounds, None)
    while True:
        messages = None
        if tagged is not None:
            following = next(rounds, None)
            last = following is None
            final = final_counts() if last else None
            round_ = pending or {}
            messages = [(round_.get(r), last, final) for r in range(state.world_size)]
            pending = following
        box: list[Any] = [None]
        dist.scatter_object_list(box, messages, src=0)
        batch, last, final = box[0]
        if last:
            on_last(final)
        if batch is not None:
            yield batch
        if last:
            return


def _group_rounds(tagged: Iterator[tuple[int, Any]]) -> Iterator[dict[int, Any]]:
    """(rank, batch) pairs grouped into rounds: rank 0 has a batch in every round, first."""
    for _, members in itertools.groupby(_number_rounds(tagged), key=lambda item: item[0]):
        yield {rank: batch for _, rank, batch in members}


def _number_rounds(tagged: Iterator[tuple[int, Any]]) -> Iterator[tuple[int, int, Any]]:
    index = -1
    for rank, batch in tagged:
        index += rank == 0
        yield index, rank, batch


class CollateTagged:
    """Collate a (rank, items) pair into (rank, batch); picklable for worker processes."""

    def __init__(self, collate_fn: Any, batched: bool):
        self.collate_fn, self.batched = collate_fn, batched

    def __call__(self, tagged: tuple[int, list[Any]]) -> tuple[int, Any]:
        rank, items = tagged
        return rank, self.collate_fn(items if self.batched else items[0])
