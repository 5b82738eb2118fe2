"""ResumableLoader: a loader restored mid-epoch hands out the uninterrupted run's next batches."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

from retarget.runtime.data.resumable_loader import ResumableLoader
from retarget.runtime.state.rng import RngState

DATA = TensorDataset(torch.arange(10))


def _global_shuffle():
    return DataLoader(DATA, batch_size=3, shuffle=True)


def _loader_generator():
    return DataLoader(DATA, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(7))


def _sampler_generator():
    sampler = RandomSampler(DATA, generator=torch.Generator().manual_seed(8))
    return DataLoader(DATA, batch_size=3, sampler=sampler)


def _distributed():
    sampler = DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=True, seed=3)
    return DataLoader(DATA, batch_size=2, sampler=sampler)


def _run(loader: ResumableLoader, n: int, record: list, *, save_at: int | None = None):
    """Take `n` batches over epochs, drawing dropout-like randoms between them."""
    saved = None
    while len(record) < n:
        for (batch,) in loader:
            record.append((batch.tolist(), torch.rand(1).item()))
            if len(record) == save_at:
                saved = (loader.state_dict(), RngState.capture())
            if len(record) == n:
                break
    return saved


@pytest.mark.parametrize(
    "make", [_global_shuffle, _loader_generator, _sampler_generator, _distributed]
)
@pytest.mark.parametrize("save_at", [2, 4, 5])  # mid-epoch, at an epoch's end, next epoch
def test_resume_continues_with_the_next_unseen_batch(make, save_at, fresh_rng):
    torch.manual_seed(0)
    full: list = []
    saved = _run(ResumableLoader(make()), 9, full, save_at=save_at)
    torch.manual_seed(123)  # a fresh process would be in another state
    resumed = ResumableLoader(make())
    resumed.load_state_dict(saved[0])
    saved[1].restore()
    rest: list = full[:save_at]
    _run(resumed, 9, rest)
    assert rest == full
    # Epochs are really shuffled (else this test could not fail).
    assert sorted(b for batch, _ in full[:4] for b in batch) != [
        b for batch, _ in full[:4] for b in batch
    ]


def test_state_counts_epochs_and_batches():
    loader = ResumableLoader(_global_shuffle())
    it = iter(loader)
    next(it), next(it)
    assert (loader.epoch, loader.state_dict()["batches_seen"]) == (0, 2)
    list(it)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["epoch_start"] is None
    next(iter(loader))
    iter(loader).__next__()  # the first new epoch was left after one batch: it still counts
    assert loader.epoch == 2 and len(loader) == 4 and loader.batch_size == 3


def test_resume_into_a_shorter_epoch_is_refused():
    loader = ResumableLoader(_global_shuffle())
    it = iter(loader)
    for _ in range(3):
        next(it)
    short = ResumableLoader(DataLoader(TensorDataset(torch.arange(4)), batch_size=3, shuffle=True))
    short.load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="batch 3 of epoch 0.*ends after 2 batches"):
        next(iter(short))


def test_only_dataloaders_are_wrapped():
    with pytest.raises(TypeError, match="wraps a torch DataLoader, got list"):
        ResumableLoader([1, 2])


def test_resume_into_a_loader_with_other_generators_is_refused():
    loader = ResumableLoader(_global_shuffle())
    next(iter(loader))
    with pytest.raises(ValueError, match="drawing from 0 own generator.*this one has 1"):
        ResumableLoader(_loader_generator()).load_state_dict(loader.state_dict())
