"""Accelerate's batch order: each epoch drawn as Accelerate's prepared DataLoader draws it.

retarget's own order (`sharding.epoch_batches`) shuffles from `seed + epoch` and leaves the caller's
RNG alone. A script moved from Accelerate expects more: the same batches *and* the same random
numbers afterwards (dropout masks, augmentation), so with `ShardOptions(order=AccelerateDraws)` (the
Accelerator's default) a map-style loader consumes RNG exactly as accelerate 1.15's
`prepare_data_loader` and `DataLoaderShard` do (default settings: rng_types ["generator"], no
seedable sampler):

- when the loader is prepared on several processes (not dispatching): a sampler whose
  `generator` is None (the RandomSampler of `shuffle=True`) gets a generator seeded with one
  int64 drawn from torch's global RNG: the generator Accelerate keeps in sync across ranks;
- each epoch: that generator takes rank 0's state (broadcast), samplers and the dataset are told
  the epoch (`set_epoch`), one int64 is drawn from the loader's `generator` (else the global RNG),
  as torch's DataLoader iterator draws its base seed, then the batch sampler is iterated (in
  dispatch mode by rank 0 only).

The drawn batches are then dealt by `sharding.deal_rounds`, which gives each rank what Accelerate's
`BatchSamplerShard` gives it, or in dispatch mode by `deal_dispatched` (what its
`DataLoaderDispatcher` sends); tests/compat/accelerate/test_accelerate_order.py checks both against
the installed accelerate. Resume inside an epoch: the generators' states at the epoch's start are
part of `state_dict()`; `replay(states)` makes the next draw start from them, then puts torch's
global RNG back where it was (a checkpoint restores it) and leaves private generators as the
uninterrupted run left them. Resume at an epoch's end: the private generators' states then are saved
and set back, so the next epoch shuffles as it would have (not as epoch 0 again).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader

from retarget.execution.process import ProcessState
from retarget.runtime.data.sharding import Deal, Part


class AccelerateDraws:
    """Draws one loader's epochs with Accelerate's RNG use; build it when the loader is
    prepared (on every rank together: it may draw from the global RNG)."""

    def __init__(self, loader: DataLoader, state: ProcessState, *, dispatch: bool) -> None:
        self.loader, self.state, self.dispatch = loader, state, dispatch
        sampler = _sampler_of(loader)
        self.sampler_generator: torch.Generator | None = None
        if state.world_size > 1 and not dispatch and hasattr(sampler, "generator"):
            if sampler.generator is None:
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
                sampler.generator = torch.Generator().manual_seed(seed)
            self.sampler_generator = sampler.generator
        self._replay: list[torch.Tensor] | None = None
        self.epoch_start: list[torch.Tensor] = []

    def _generators(self) -> list[torch.Generator | None]:
        """What an epoch draws from: the loader's generator (None: the global RNG), then the
        synchronised sampler generator."""
        drawn = [self.loader.generator]
        if self.sampler_generator is not None and self.sampler_generator is not drawn[0]:
            drawn.append(self.sampler_generator)
        return drawn

    def replay(self, states: list[torch.Tensor]) -> None:
        """Make the next `draw` start from these epoch-start states (a resumed epoch)."""
        self._replay = [s.clone() for s in states]

    def state_dict(self, finished: bool) -> dict[str, list[torch.Tensor]]:
        """Inside an epoch: the states it was drawn from (replayed on resume). At its end: the
        loader's own generators as they are now, which the next epoch draws from (the global
        RNG is the checkpoint's to restore)."""
        if not finished:
            return {"epoch_start_rng": list(self.epoch_start)}
        return {"next_epoch_rng": [g.get_state() for g in self._generators() if g is not None]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict`'s point (a loader state without RNG states changes nothing)."""
        if "epoch_start_rng" in state:
            self.replay(state["epoch_start_rng"])
        if "next_epoch_rng" in state:
            owned = [g for g in self._generators() if g is not None]
            for generator, saved in zip(owned, state["next_epoch_rng"], strict=True):
                generator.set_state(saved)

    def draw(self, epoch: int) -> list[list[int]]:
        """Epoch `epoch`'s batches (all of them; [] on ranks that do not read in dispatch)."""
        if self.sampler_generator is not None and dist.is_initialized():
            box = [self.sampler_generator.get_state()]
            dist.broadcast_object_list(box, src=0)
            self.sampler_generator.set_state(box[0])
        generators = self._generators()
        outer = torch.random.get_rng_state()
        replaying, self._replay = self._replay, None
        if replaying is not None:
            for generator, start in zip(generators, replaying, strict=True):
                _set_state(generator, start)
        self.epoch_start = [_get_state(g) for g in generators]
        _tell_epoch(self.loader, epoch)
        torch.empty((), dtype=torch.int64).random_(generator=self.loader.generator)
        read = not self.dispatch or self.state.rank == 0
        batches = [list(batch) for batch in self.loader.batch_sampler] if read else []
        if replaying is not None:
            torch.random.set_rng_state(outer)
        return batches

    def deal_dispatched(
        self, batches: list[list[int]], *, world: int, split_batches: bool, drop_last: bool
    ) -> Deal:
        return deal_dispatched(
            batches, world=world, split_batches=split_batches, drop_last=drop_last
        )

    def batch_sizes(self) -> list[int]:
        """Sizes of an epoch's batches, known without drawing (for `len`)."""
        batch_sampler = self.loader.batch_sampler
        if type(batch_sampler) is BatchSampler:
            samples = len(batch_sampler.sampler)
            full, rest = divmod(samples, batch_sampler.batch_size)
            tail = [rest] if rest and not batch_sampler.drop_last else []
            return [batch_sampler.batch_size] * full + tail
        size = getattr(batch_sampler, "batch_size", None) or 1
        return [size] * len(batch_sampler)


def _sampler_of(loader: DataLoader) -> Any:
    """The index sampler under the batch sampler (as Accelerate's get_sampler finds it)."""
    return getattr(loader.batch_sampler, "sampler", loader.sampler)


def _tell_epoch(loader: DataLoader, epoch: int) -> None:
    """Accelerate's DataLoaderShard.set_epoch for samplers (the loader tells the dataset)."""
    for owner in (loader.batch_sampler, _sampler_of(loader)):
        if hasattr(owner, "set_epoch"):
            owner.set_epoch(epoch)


def _get_state(generator: torch.Generator | None) -> torch.Tensor:
    return torch.random.get_rng_state() if generator is None else generator.get_state()


def _set_state(generator: torch.Generator | None, state: torch.Tensor) -> None:
    if generator is None:
        torch.random.set_rng_state(state)
    else:
        generator.set_state(state)


def deal_dispatched(
    batches: list[list[int]], *, world: int, split_batches: bool, drop_last: bool
) -> Deal:
    """Accelerate's DataLoaderDispatcher deal: rank 0 concatenates a round (`world` batches, or
    one batch with split_batches) and cuts it into `world` equal slices. An uneven last round
    is first completed with the epoch's first `world` samples and each rank gets
    `len // world + 1` samples; with drop_last a round short of batches is dropped (a round
    whose samples do not divide evenly loses its tail); even_batches plays no part.
    """
    per_round = 1 if split_batches else world
    if drop_last:  # the loader dropped its short batch; a round short of batches goes too
        batches = batches[: len(batches) // per_round * per_round]
    rounds: list[list[Part]] = []
    first = [i for batch in batches for i in batch][:world]
    remainder = duplicates = 0
    for start in range(0, len(batches), per_round):
        samples = [i for batch in batches[start : start + per_round] for i in batch]
        share = len(samples) // world
        remainder, duplicates = len(samples), 0
        if not drop_last and len(samples) % world:
            share += 1
            duplicates = share * world - len(samples)
            samples += first * (-(-duplicates // len(first)))  # first samples, as many as needed
        rounds.append([samples[r * share : (r + 1) * share] or None for r in range(world)])
    return Deal(rounds, remainder, duplicates)
