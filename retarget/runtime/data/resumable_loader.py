"""A DataLoader that knows its position, so a checkpoint can resume in the middle of an epoch.

A plain `torch.utils.data.DataLoader` does not know how far it got. To continue a shuffled
epoch with the next unseen batch, a resumed run needs three things, which this wrapper keeps:

- `epoch`: how many epochs were started before the current one (0 first);
- `batches_seen`: batches handed out in the current epoch;
- the state of every generator the loader's shuffling draws from, taken *when the epoch's
  iterator was created*: the loader's `generator` (or the global torch generator when it has
  none, as `DataLoader(shuffle=True)` does), and a sampler's own `generator`.

On resume the epoch's iterator is rebuilt from those start states, the `batches_seen` batches
already trained on are drawn and dropped, and the generators are then put back where the
checkpoint left them: the global generator to the restored RNG state, a private generator to
its own saved state. The next batch is the first unseen one, in the same order as the
uninterrupted run. Skipped batches are loaded and discarded (cost: `batches_seen` batch loads).

    >>> loader = ResumableLoader(DataLoader(dataset, batch_size=8, shuffle=True))
    >>> for batch in loader: ...             # each `iter()` is one epoch
    >>> state = loader.state_dict()          # save_state does this for you
    >>> loader.load_state_dict(state)        # the next iter() continues where it stopped

A sampler with `set_epoch` (DistributedSampler) is told the epoch before each one starts, so
its shuffle differs per epoch without the caller doing it. Loaders from `sharded_loader.py` and
torchdata's StatefulDataLoader keep their own position and need no wrapper.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader


class ResumableLoader:
    """Wraps a DataLoader; iterates exactly like it and adds `state_dict`/`load_state_dict`."""

    def __init__(self, loader: DataLoader) -> None:
        if not isinstance(loader, DataLoader):
            raise TypeError(
                f"ResumableLoader wraps a torch DataLoader, got {type(loader).__name__}"
            )
        self.loader = loader
        self.epoch = 0
        self.batches_seen = 0
        self._epoch_start: list[torch.Tensor] | None = None
        self._in_epoch = False
        self._resume: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        # dataset, batch_size, sampler, ... read through to the wrapped loader.
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def _generators(self) -> list[torch.Generator]:
        """The generators an epoch's shuffle draws from, the loader's (or the global) first."""
        own = self.loader.generator
        found = [torch.default_generator if own is None else own]
        for sampler in (self.loader.sampler, getattr(self.loader.batch_sampler, "sampler", None)):
            gen = getattr(sampler, "generator", None)
            if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
                found.append(gen)
        return found

    def _private(self, generators: list[torch.Generator]) -> list[torch.Generator]:
        # The global generator's state belongs to the RNG state of the checkpoint.
        return [g for g in generators if g is not torch.default_generator]

    def _set_epoch(self) -> None:
        for sampler in (self.loader.sampler, getattr(self.loader.batch_sampler, "sampler", None)):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)

    def __iter__(self) -> Iterator[Any]:
        generators = self._generators()
        resume, self._resume = self._resume, None
        if self._in_epoch:  # the previous epoch was left before its end: it still counts
            self.epoch += 1
        self._in_epoch = True
        if resume is None:
            self.batches_seen = 0
            self._epoch_start = [g.get_state() for g in generators]
            self._set_epoch()
            batches = iter(self.loader)
        else:
            batches = self._replay(generators, resume)
        for batch in batches:
            self.batches_seen += 1
            yield batch
        self.epoch += 1
        self.batches_seen = 0
        self._epoch_start = None
        self._in_epoch = False

    def _replay(self, generators: list[torch.Generator], resume: dict[str, Any]) -> Iterator[Any]:
        """The epoch's iterator rebuilt from its start states, past the batches already seen."""
        start = resume["epoch_start"]
        now = torch.default_generator.get_state()
        for gen, state in zip(generators, start, strict=True):
            gen.set_state(state)
        self._epoch_start = list(start)
        self._set_epoch()
        batches = iter(self.loader)
        for seen in range(resume["batches_seen"]):
            if next(batches, _END) is _END:
                raise ValueError(
                    f"the saved loader position is batch {resume['batches_seen']} of epoch "
                    f"{self.epoch}, but this loader's epoch ends after {seen} batches: the "
                    "dataset or batch size differs from the saved run"
                )
        self.batches_seen = resume["batches_seen"]
        torch.default_generator.set_state(now)
        for gen, state in zip(self._private(generators), resume["private_now"], strict=True):
            gen.set_state(state)
        return batches

    def state_dict(self) -> dict[str, Any]:
        """The position: epoch, batches seen, generator states at the epoch's start and now."""
        generators = self._generators()
        mid_epoch = self._in_epoch and self._epoch_start is not None
        return {
            "epoch": self.epoch,
            "batches_seen": self.batches_seen if mid_epoch else 0,
            "epoch_start": list(self._epoch_start) if mid_epoch else None,
            "private_now": [g.get_state() for g in self._private(generators)],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` at the next `iter()`."""
        generators = self._generators()
        saved, have = len(state["private_now"]), len(self._private(generators))
        # epoch_start holds one more state: the loader's generator or the global one.
        if saved != have:
            raise ValueError(
                f"the saved loader position is for a loader drawing from {saved} own "
                f"generator(s), and this one has {have}: build the DataLoader (generator=, "
                "sampler=) as in the saved run"
            )
        self.epoch = state["epoch"]
        self.batches_seen = 0
        self._in_epoch = False
        self._epoch_start = None
        self._resume = state if state["epoch_start"] is not None else None
        if self._resume is None:
            for gen, own in zip(self._private(generators), state["private_now"], strict=True):
                gen.set_state(own)


_END = object()
