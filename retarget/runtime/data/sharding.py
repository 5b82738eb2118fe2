"""Which samples each rank gets: the arithmetic of data sharding, with no process group.

Everything here is a pure function of (the epoch's batches, world size, options), so every rank
computes the same plan independently, and the plan can be tested for any world size in one
process. `sharded_loader.py` runs the plan.

A *round* is one global batch: what all ranks together consume in one step. `deal_rounds` cuts
an epoch into rounds and gives each rank its part:

- default: each rank gets whole batches of the loader's batch size, round robin
  (rank r gets batches r, r + world, ...), so a round is `world` consecutive batches;
- `split_batches`: each batch of the loader is one round, cut into `world` equal slices.

When the epoch does not fill the last round, `even_batches` completes it by wrapping around to
the start of the epoch's order, so every rank gets the same number of batches of the same size
(the duplicated samples are counted in `Deal.duplicates`, and `gather_for_metrics` drops them).
Without it, the last round is dealt as far as it goes: some ranks get a shorter batch or none.
With `drop_last` the loader's incomplete batch is dropped, and so are the batches of an
incomplete last round, so every rank still gets the same count.

Concatenating the rounds' parts in rank order gives the epoch's samples in sampler order (plus
the wrap-around at the very end): that is what makes `gather_for_metrics` return the dataset in
order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import IterableDataset

#: One rank's part of a round: sample indices, or None when the rank gets nothing this round.
Part = list[int] | None


@dataclass(frozen=True, kw_only=True)
class ShardOptions:
    """How `shard_dataloader` divides an epoch between processes (Accelerate's names)."""

    split_batches: bool = False
    """Cut each batch of the loader across the ranks (per-rank batch = batch_size / world), so
    the global batch is the loader's batch size. Off: each rank gets whole batches and the
    global batch is batch_size x world."""

    even_batches: bool = True
    """Complete the last round by wrapping around to the start of the epoch so that every rank
    gets the same number of equally sized batches (collectives need every rank to take part).
    Off: every sample exactly once; the last round may leave ranks with a short batch or none."""

    dispatch_batches: bool = False
    """Rank 0 alone reads the dataset and sends each rank its batch; the other ranks never touch
    the dataset (for streams that cannot be read in parallel, or costly preprocessing)."""

    order: str | DrawsFactory = "seeded"
    """How a map-style loader's epochs are shuffled. "seeded": from the agreed seed + epoch,
    the caller's RNG untouched, the same order for any world size. Else a factory of
    `EpochDraws`, which draws each epoch itself: the Accelerate layer's `AccelerateDraws`
    (retarget/compat/accelerate/data_order.py) draws from the RNG as Accelerate's prepared loader
    does, so a script moved from Accelerate gets its batches and later random numbers unchanged."""

    def __post_init__(self) -> None:
        if self.order != "seeded" and not callable(self.order):
            raise ValueError(
                f"ShardOptions(order={self.order!r}): 'seeded', or a factory of EpochDraws "
                "(Accelerate's order: order=retarget.compat.accelerate.data_order.AccelerateDraws)"
            )


class EpochDraws(Protocol):
    """An epoch order drawn by its own rules (`ShardOptions.order` given as a factory): the
    loader asks it for each epoch's batches and keeps its RNG states in the loader's state."""

    def draw(self, epoch: int) -> list[list[int]]:
        """Epoch `epoch`'s batches (all of them; [] on ranks that do not read in dispatch)."""
        ...

    def batch_sizes(self) -> list[int]:
        """Sizes of an epoch's batches, known without drawing (for `len`)."""
        ...

    def state_dict(self, finished: bool) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def deal_dispatched(
        self, batches: list[list[int]], *, world: int, split_batches: bool, drop_last: bool
    ) -> Deal:
        """How rank 0 deals drawn batches when it dispatches them."""
        ...


#: `order(loader, state, dispatch=...)` -> EpochDraws, built when the loader is prepared.
DrawsFactory = Callable[..., EpochDraws]


@dataclass(frozen=True)
class Deal:
    """An epoch dealt out: `rounds[k][r]` is rank r's part of round k."""

    rounds: list[list[Part]]
    remainder: int
    """Real (non-duplicate) samples in the last round; 0 when there are no rounds."""
    duplicates: int
    """Wrap-around samples at the end of the last round (0 unless even_batches padded it)."""

    def parts_of(self, rank: int) -> list[list[int]]:
        """Rank `rank`'s batches in order."""
        return [part for round_ in self.rounds if (part := round_[rank]) is not None]


def epoch_batches(batch_sampler: Iterable[Sequence[int]], seed: int, epoch: int) -> list[list[int]]:
    """The batch sampler's batches for `epoch`, shuffled from `seed + epoch` only.

    Samplers shuffle from torch's global RNG or from their own `generator`; both are seeded
    with `seed + epoch` for this one pass and restored afterwards, so every rank that agrees on
    `seed` gets the same order, each epoch a different one, and the caller's RNG is untouched.
    A sampler or dataset-aware sampler with `set_epoch` is told the epoch as well.
    """
    sampler = getattr(batch_sampler, "sampler", None)
    for owner in (batch_sampler, sampler):
        if hasattr(owner, "set_epoch"):
            owner.set_epoch(epoch)
    generators = list(
        {
            id(g): g
            for owner in (batch_sampler, sampler)
            if isinstance(g := getattr(owner, "generator", None), torch.Generator)
        }.values()
    )
    saved = [g.get_state() for g in generators]
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + epoch)
            for g in generators:
                g.manual_seed(seed + epoch)
            return [list(batch) for batch in batch_sampler]
    finally:
        for g, state in zip(generators, saved, strict=True):
            g.set_state(state)


def deal_rounds(
    batches: Sequence[Sequence[int]],
    *,
    world: int,
    batch_size: int | None,
    split_batches: bool,
    even_batches: bool,
    drop_last: bool,
) -> Deal:
    """Deal an epoch's `batches` (from `epoch_batches`) out to `world` ranks.

    `batch_size` is the loader's batch size (needed by split_batches and even_batches; a
    batch sampler of varying sizes has none). See the module docstring for the rules.
    """
    indices = [i for batch in batches for i in batch]
    if split_batches:
        assert batch_size is not None and batch_size % world == 0
        return _deal_split(batches, indices, world, batch_size, even_batches)
    duplicates = 0
    if drop_last:
        batches = batches[: len(batches) // world * world]
    elif even_batches and indices:
        assert batch_size is not None
        duplicates = -len(indices) % (batch_size * world)
        padded = indices + _wrap(indices, duplicates)
        batches = [padded[i : i + batch_size] for i in range(0, len(padded), batch_size)]
    rounds = [
        [list(batches[k + r]) if k + r < len(batches) else None for r in range(world)]
        for k in range(0, len(batches), world)
    ]
    return Deal(rounds, _size(rounds) - duplicates, duplicates)


def _deal_split(
    batches: Sequence[Sequence[int]], indices: list[int], world: int, size: int, even: bool
) -> Deal:
    share = size // world
    rounds, duplicates = [], 0
    for batch in batches:
        batch = list(batch)
        if even and len(batch) < size:
            duplicates = size - len(batch)
            batch += _wrap(indices, duplicates)
        rounds.append([batch[r * share : (r + 1) * share] or None for r in range(world)])
    return Deal(rounds, _size(rounds) - duplicates, duplicates)


def _size(rounds: list[list[Part]]) -> int:
    """Samples in the last round."""
    return sum(len(part) for part in rounds[-1] if part) if rounds else 0


def _wrap(indices: list[int], count: int) -> list[int]:
    """The first `count` indices of `indices` repeated from its start as often as needed."""
    return list(itertools.islice(itertools.cycle(indices), count)) if count else []


class IterableShard(IterableDataset):
    """One rank's items of an IterableDataset: every rank reads the stream, keeps its slices.

    The stream is cut into rounds of `per_rank x world` items; rank r keeps items
    `[r * per_rank, (r + 1) * per_rank)` of each round, so ranks never share an item. An
    incomplete last round is dropped (`drop_last`), completed from the stream's first round
    (`even_batches`), or dealt as far as it goes. With `rank=None` (dispatch) every round is
    yielded as `(rank, items)` for each rank that has items, for rank 0 to send out.

    Every rank must read the same stream, so the stream draws from torch's global RNG seeded
    with `seed` alone (swapped in around each read): a torch-shuffled stream agrees across
    ranks and the training loop's RNG is untouched. `skip_rounds` rounds at the start are read
    but not yielded (resume). After a pass, `last_round_real` is the number of real items in
    the last round (0 for an empty stream; -1 before any pass).
    """

    def __init__(
        self,
        dataset: Iterable[Any],
        *,
        world: int,
        rank: int | None,
        per_rank: int,
        even_batches: bool,
        drop_last: bool,
        seed: int,
        skip_rounds: int = 0,
    ):
        self.dataset = dataset
        self.world, self.rank, self.per_rank = world, rank, per_rank
        self.even_batches, self.drop_last = even_batches, drop_last
        self.seed, self.skip_rounds = seed, skip_rounds
        self.last_round_real = -1

    def __iter__(self) -> Iterator[Any]:
        self.last_round_real = 0
        size = self.per_rank * self.world
        first: list[Any] = []
        for index, chunk in enumerate(_chunks_with_own_rng(self.dataset, size, self.seed)):
            first = first or list(chunk)
            real = len(chunk)
            if real < size:
                if self.drop_last:
                    break
                if self.even_batches:
                    chunk += list(itertools.islice(itertools.cycle(first), size - real))
            if index >= self.skip_rounds:
                yield from self._slices(chunk)
            self.last_round_real = real

    def _slices(self, chunk: list[Any]) -> Iterator[Any]:
        if self.rank is not None:
            yield from chunk[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
            return
        for r in range(self.world):
            if items := chunk[r * self.per_rank : (r + 1) * self.per_rank]:
                yield r, items


def _chunks_with_own_rng(items: Iterable[Any], size: int, seed: int) -> Iterator[list[Any]]:
    """`items` in lists of `size`, read with torch's global RNG set to a stream of its own."""
    own = torch.Generator().manual_seed(seed).get_state()
    stream = None
    while True:
        outer = torch.random.get_rng_state()
        torch.random.set_rng_state(own)
        try:
            if stream is None:
                stream = iter(items)
            chunk = list(itertools.islice(stream, size))
        finally:
            own = torch.random.get_rng_state()
            torch.random.set_rng_state(outer)
        if not chunk:
            return
        yield chunk
